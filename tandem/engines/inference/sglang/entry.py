"""Registry entry of the SGLang adapter (`tandem.engines.registry`). Importing it imports no SGLang."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.core.contracts import Contract, PairContract
from tandem.engines.registry import EngineEntry, RunFacts, adapter_changes, cuda_available, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``inference.sglang`` section with the run's model, seed and context; with adapter-only
    LoRA sync, the servers load the trainer's adapters with the trainer's scaling and rank."""
    from tandem.engines.inference.sglang.config import SGLangEngineConfig

    ec, changes = run_section(config, SGLangEngineConfig, facts)
    changes["max_model_len"] = min(ec.max_model_len, facts.max_context)
    changes |= adapter_changes(facts, ec)
    spec = facts.speculative
    if spec is not None and not ec.urls:  # servers the adapter launches; running servers have their own
        if ec.launch == "embedded":
            changes["server_args"] = {"speculative": {"drafter": spec.drafter, "k": spec.k, "adaptive": spec.adaptive,
                                                      "ngram_max": spec.ngram_max, "ngram_min": spec.ngram_min},
                                      **ec.server_args}
        elif "speculative_algorithm" not in ec.server_args:  # SGLang's n-gram speculation
            changes["server_args"] = {**ec.server_args, "speculative_algorithm": "NGRAM",
                                      "speculative_num_draft_tokens": spec.k}
    return dataclasses.replace(ec, **changes)


def refuse(facts: RunFacts, config: Any) -> dict[str, str]:
    if facts.lora_base_quantization is not None:
        return {"trainer.fsdp.lora.quantize_base": "SGLang would serve the full-precision base under the trainer's "
                                                   "adapters, not the quantized base it trains on; use "
                                                   "inference.engine: torch"}
    return {}


# Bounded until measured against real SGLang (no test here has run it): the bound is vLLM's, whose kernels
# differ from the trainer's the same way. Behind the API, the embedded engine keeps its own exact contract
# (tests/engines/test_sglang_engine.py measures |train - rollout| = 0 through HTTP).
_NOTE = "SGLang's kernels; bound not yet measured on real SGLang (docs/sglang.md)"
CONTRACTS = (
    PairContract(trainer="fsdp", engine="sglang", contract=Contract(relation="bounded", tolerance=0.1, note=_NOTE)),
    PairContract(trainer="megatron", engine="sglang", contract=Contract(relation="bounded", tolerance=0.1,
                                                                          note=_NOTE)),
)

ENTRY = EngineEntry(
    name="sglang",
    kind="inference",
    config="tandem.engines.inference.sglang.config:SGLangEngineConfig",
    factory="tandem.engines.inference.sglang.engine:SGLangEngine",
    fill=fill,
    refuse=refuse,
    # routed experts for MoE models whose servers capture them (the built engine's info says)
    capabilities=frozenset({"can_sleep", "routed_experts", "lora_adapters"}),
    why_not={"can_score": "the adapter has no prefill score()",
             "partial_updates": "SGLang reloads the weights it is given as a model folder; send full updates",
             "exposes_weights": "the weights live in the server process"},
    contracts=CONTRACTS,
    install="pip install 'sglang[all]==0.5.23' on the GPU machine, or point inference.sglang.urls at running servers",
    gpus=lambda config: float(config.server_args.get("tp_size", 1)) if cuda_available() and not config.urls else 0.0,
)
