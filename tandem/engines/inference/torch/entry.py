"""Registry entry of the embedded torch engine (`tandem.engines.registry`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engines.registry import EngineEntry, RunFacts, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``inference.torch`` section with the run's model and seed; the KV-cache slots are
    sized for the run's longest prompt + response (never longer than the section asks). With adapter-only
    LoRA sync the engine serves the trainer's adapter with the trainer's alpha and rank."""
    from tandem.engines.inference.torch.config import TorchEngineConfig

    ec, changes = run_section(config, TorchEngineConfig, facts)
    changes["max_model_len"] = min(ec.max_model_len, facts.max_context)
    if facts.adapter_sync and facts.lora_rank is not None and ec.lora_alpha is None:
        changes |= {"lora_alpha": facts.lora_alpha, "lora_max_rank": max(ec.lora_max_rank, facts.lora_rank)}
    return dataclasses.replace(ec, **changes)


ENTRY = EngineEntry(
    name="torch",
    kind="inference",
    config="tandem.engines.inference.torch.config:TorchEngineConfig",
    factory="tandem.engines.inference.torch.engine:TorchEngine",
    fill=fill,
    # routed experts for MoE models only; LoRA adapters unmerged (sync.lora_mode: adapter) or merged
    capabilities=frozenset({"can_sleep", "can_score", "routed_experts", "exposes_weights", "partial_updates",
                            "lora_adapters"}),
    hints={"engine_deterministic": "inference.torch.deterministic: true"},
    gpus=lambda config: 1.0 if config.device == "cuda" else 0.0,
)
