"""Registry entry of the embedded torch engine (`tandem.engines.registry`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engines.registry import EngineEntry, RunFacts, adapter_changes, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``inference.torch`` section with the run's model and seed; the KV-cache slots are
    sized for the run's longest prompt + response (never longer than the section asks), and, where the section
    leaves ``max_num_seqs`` unset, there are as many as one rollout round submits to each engine (`auto_num_seqs`
    of the round's share of each of ``inference.replicas``: the router spreads requests evenly). With adapter-only
    LoRA sync the engine serves the trainer's adapter with the trainer's alpha and rank."""
    from tandem.engines.inference.torch.config import TorchEngineConfig, auto_num_seqs

    ec, changes = run_section(config, TorchEngineConfig, facts)
    changes["max_model_len"] = min(ec.max_model_len, facts.max_context)
    if ec.max_num_seqs is None:
        share = -(-facts.rollout_batch // max(1, facts.replicas))  # ceil: the router balances outstanding requests
        changes["max_num_seqs"] = auto_num_seqs(share, changes["max_model_len"])
    changes |= adapter_changes(facts, ec)
    if facts.speculative is not None and ec.speculative is None:
        changes["speculative"] = facts.speculative  # rollout.speculative, unless inference.torch sets its own
    if facts.adapter_sync and facts.lora_base_quantization is not None and ec.quantization is None:
        changes["quantization"] = facts.lora_base_quantization  # QLoRA: serve the trainer's base bits
    return dataclasses.replace(ec, **changes)


def refuse(facts: RunFacts, config: Any) -> dict[str, str]:
    refused = {}
    q = facts.lora_base_quantization
    if q is not None and facts.adapter_sync and config.quantization != q:
        refused["inference.torch.quantization"] = (f"the trainer's LoRA base is quantized as {q.format}; the engine "
                                                   "must serve the same format (leave quantization unset to get it)")
    if config.sleep_frees_weights and (facts.adapter_sync or facts.delta_sync):
        what = "adapter-only (sync.lora_mode: adapter)" if facts.adapter_sync else "delta (sync.delta: true)"
        refused["inference.torch.sleep_frees_weights"] = (
            f"this run's syncs are {what}: they do not rewrite every weight that sleep would free, and the "
            "engine could not wake up; leave it false")
    return refused


ENTRY = EngineEntry(
    name="torch",
    kind="inference",
    config="tandem.engines.inference.torch.config:TorchEngineConfig",
    factory="tandem.engines.inference.torch.engine:TorchEngine",
    fill=fill,
    refuse=refuse,
    # routed experts for MoE models only; LoRA adapters unmerged (sync.lora_mode: adapter) or merged
    capabilities=frozenset({"can_sleep", "can_score", "routed_experts", "exposes_weights", "partial_updates",
                            "lora_adapters"}),
    hints={"engine_deterministic": "inference.torch.deterministic: true"},
    gpus=lambda config: 1.0 if config.device == "cuda" else 0.0,
    takes_base=True,  # TorchEngine(config, base=...): a colocated LoRA run's engine reads no base of its own
)
