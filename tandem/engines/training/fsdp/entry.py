"""Registry entry of the FSDP2 training engine (`tandem.engines.registry`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engines.registry import EngineEntry, RunFacts, TrainerFacts, cuda_available, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``trainer.fsdp`` section with the run's model and seed, the rollout's temperature
    (the shared log-prob convention), a reference for a KL term, a critic for GAE, and the LoRA sync
    mode of ``sync.lora_mode``."""
    from tandem.engines.training.fsdp.config import CriticConfig, FSDPConfig, RefConfig

    fc, changes = run_section(config, FSDPConfig, facts)
    changes["temperature"] = facts.temperature or 1.0
    if facts.needs_ref and fc.ref is None:
        changes["ref"] = RefConfig()
    if facts.needs_critic and fc.critic is None:
        changes["critic"] = CriticConfig()
    if facts.adapter_sync and fc.lora is not None:
        changes["lora"] = dataclasses.replace(fc.lora, sync="adapter")
    return dataclasses.replace(fc, **changes)


def refuse(facts: RunFacts, config: Any) -> dict[str, str]:
    if config.routing_replay and not _moe_layers(config.model.name):
        return {"trainer.fsdp.routing_replay: true": f"{config.model.name} is a dense model: there are no routes "
                                                     "to replay"}
    return {}


def _moe_layers(name: str) -> tuple[int, ...]:
    """The model's MoE layers by its config (no weights loaded); () for an architecture Tandem does not
    implement natively (the engine itself then refuses replay: it needs the native model)."""
    from tandem.models import resolve_model
    from tandem.models.hf_config import read_hf_config
    from tandem.models.transformer import TransformerArgs, UnsupportedModelError

    try:
        return tuple(TransformerArgs.from_hf_config(read_hf_config(resolve_model(name))).moe_layers)
    except UnsupportedModelError:
        return ()


def describe(config: Any) -> TrainerFacts:
    lora = config.lora
    return TrainerFacts(routing_replay=config.routing_replay, lora_rank=lora.rank if lora else None,
                        lora_alpha=lora.alpha if lora else None,
                        lora_base_quantization=lora.quantize_base if lora else None)


ENTRY = EngineEntry(
    name="fsdp",
    kind="training",
    config="tandem.engines.training.fsdp.config:FSDPConfig",
    factory="tandem.engines.training.fsdp.engine:FSDPEngine",
    fill=fill,
    refuse=refuse,
    describe=describe,
    capabilities=frozenset({"can_sleep", "routed_experts", "lora_adapters", "critic", "ref"}),
    gpus=lambda config: 1.0 if config.device == "cuda" or (config.device == "auto" and cuda_available()) else 0.0,
    hints={
        "trainer_deterministic": "trainer.fsdp.deterministic: true",
        "same_temperature": "trainer.fsdp.temperature equal to rollout.sampling.temperature",
        "routing_replay": "trainer.fsdp.routing_replay: true (R3) for a MoE model",
    },
)
