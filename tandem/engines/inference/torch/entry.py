"""Registry entry of the embedded torch engine (`tandem.engines.registry`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engines.registry import EngineEntry, RunFacts, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``inference.torch`` section with the run's model and seed; the KV-cache slots are
    sized for the run's longest prompt + response (never longer than the section asks)."""
    from tandem.engines.inference.torch.config import TorchEngineConfig

    ec, changes = run_section(config, TorchEngineConfig, facts)
    return dataclasses.replace(ec, **changes, max_model_len=min(ec.max_model_len, facts.max_context))


ENTRY = EngineEntry(
    name="torch",
    kind="inference",
    config="tandem.engines.inference.torch.config:TorchEngineConfig",
    factory="tandem.engines.inference.torch.engine:TorchEngine",
    fill=fill,
    # routed experts for MoE models only, and LoRA adapters are served merged (sync.lora_mode: merged)
    capabilities=frozenset({"can_sleep", "can_score", "routed_experts", "exposes_weights", "partial_updates"}),
    hints={"engine_deterministic": "inference.torch.deterministic: true"},
    gpus=lambda config: 1.0 if config.device == "cuda" else 0.0,
)
