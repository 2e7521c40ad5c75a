"""Registry entry of the vLLM adapter (`tandem.engines.registry`). Importing it does not import vLLM."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engines.registry import EngineEntry, RunFacts, adapter_changes, cuda_available, run_section

__all__ = ["ENTRY"]


def fill(facts: RunFacts, config: Any):
    """The recipe's ``inference.vllm`` section with the run's model, seed and context; with adapter-only
    LoRA sync, vLLM serves the trainer's adapter with the trainer's scaling and rank."""
    from tandem.engines.inference.vllm.config import VLLMEngineConfig

    ec, changes = run_section(config, VLLMEngineConfig, facts)
    changes["max_model_len"] = min(ec.max_model_len, facts.max_context)
    changes |= adapter_changes(facts, ec)
    spec = facts.speculative
    if spec is not None and "speculative_config" not in ec.engine_kwargs:  # vLLM's n-gram prompt lookup
        changes["engine_kwargs"] = {**ec.engine_kwargs, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": spec.k, "prompt_lookup_max": spec.ngram_max,
            "prompt_lookup_min": spec.ngram_min}}
    return dataclasses.replace(ec, **changes)


def refuse(facts: RunFacts, config: Any) -> dict[str, str]:
    if facts.lora_base_quantization is not None:
        return {"trainer.fsdp.lora.quantize_base": "vLLM would serve the full-precision base under the trainer's "
                                                   "adapters, not the quantized base it trains on; use "
                                                   "inference.engine: torch (it serves the same quantized bits)"}
    return {}


ENTRY = EngineEntry(
    name="vllm",
    kind="inference",
    config="tandem.engines.inference.vllm.config:VLLMEngineConfig",
    factory="tandem.engines.inference.vllm.engine:VLLMEngine",
    fill=fill,
    refuse=refuse,
    # sleep mode on CUDA/ROCm/XPU only (the built engine's info says)
    capabilities=frozenset({"can_sleep", "lora_adapters"}),
    why_not={"can_score": "the adapter has no prefill score()", "routed_experts": "vLLM returns no routed experts",
             "partial_updates": "vLLM reloads whole layers, so it needs full updates",
             "exposes_weights": "vLLM repacks its weights; they are not readable by HF name"},
    install="pip install 'tandem-rl[vllm]' (CPU: scripts/install_vllm.sh builds a separate venv)",
    # one GPU per tensor-parallel rank where vLLM runs on CUDA (on CPU the bundle asks for none: set
    # ray.engine_gpus explicitly for a GPU cluster)
    gpus=lambda config: float(config.engine_kwargs.get("tensor_parallel_size", 1)) if cuda_available() else 0.0,
)
