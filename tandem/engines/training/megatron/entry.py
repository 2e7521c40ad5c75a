"""Registry entry of the Megatron-core training engine (`tandem.engines.registry`). Importing it does
not import megatron-core."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engines.registry import EngineEntry, RunFacts, TrainerFacts, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``trainer.megatron`` section with the run's model, seed and rollout temperature, a
    reference for a KL term (with LoRA: the base, adapters off), and the LoRA sync mode of ``sync.lora_mode``."""
    from tandem.engines.training.megatron.config import MegatronConfig, MegatronRefConfig

    mc, changes = run_section(config, MegatronConfig, facts)
    changes["temperature"] = facts.temperature or 1.0
    if facts.needs_ref and mc.ref is None:
        changes["ref"] = MegatronRefConfig()
    if facts.adapter_sync and mc.lora is not None:
        changes["lora"] = dataclasses.replace(mc.lora, sync="adapter")
    return dataclasses.replace(mc, **changes)


def describe(config: Any) -> TrainerFacts:
    lora = config.lora
    return TrainerFacts(lora_rank=lora.rank if lora else None, lora_alpha=lora.alpha if lora else None)


ENTRY = EngineEntry(
    name="megatron",
    kind="training",
    config="tandem.engines.training.megatron.config:MegatronConfig",
    factory="tandem.engines.training.megatron.engine:MegatronEngine",
    fill=fill,
    describe=describe,
    capabilities=frozenset({"can_sleep", "ref", "lora_adapters"}),
    hints={"trainer_deterministic": "trainer.megatron.deterministic: true",
           "same_temperature": "trainer.megatron.temperature equal to rollout.sampling.temperature"},
    install="pip install 'tandem-rl[megatron]' (megatron-core==0.16.1 on Python 3.11)",
)
