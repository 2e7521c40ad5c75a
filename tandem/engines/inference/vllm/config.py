"""Configuration of the vLLM inference adapter.

Only what Tandem itself needs is a field here; every other vLLM setting goes through ``engine_kwargs``
untouched (``vllm.EngineArgs`` / ``AsyncEngineArgs`` keyword arguments), so a vLLM upgrade never
needs a change to this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.models.registry import ModelConfig

__all__ = ["OWNED_KWARGS", "VLLMEngineConfig"]

# vLLM arguments the adapter sets itself: the model (the safetensors folder of `resolve_model`), its
# dtype, the context length and seed (used for validation and per-request seeds), and the log-prob
# mode that gives Tandem's convention (log_softmax(logits / T) of the sampled token).
OWNED_KWARGS = {
    "model": "VLLMEngineConfig.model",
    "dtype": "VLLMEngineConfig.model.dtype",
    "max_model_len": "VLLMEngineConfig.max_model_len",
    "seed": "VLLMEngineConfig.seed",
    "logprobs_mode": "nothing (the adapter needs processed_logprobs)",
    "enable_lora": "VLLMEngineConfig.lora_alpha",
}


@dataclass(kw_only=True, slots=True)
class VLLMEngineConfig:
    """How the vLLM adapter runs a model.

    ``backend``: ``inprocess`` runs vLLM's engine core in this process (``vllm.LLMEngine``): the
    caller's thread drives it, like the embedded engine, and weight updates are handed over as tensors
    without a copy (the colocated default). ``async`` runs ``vllm.AsyncLLM`` (engine core in its own
    process) on a background event loop; weight updates travel as a safetensors folder under
    ``staging_dir`` (a tmpfs by default).
    """

    model: ModelConfig | None = None  # None: the run's model (the runtime fills it in)
    backend: Literal["inprocess", "async"] = "inprocess"
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    seed: int = 0  # seeds the samplers of requests without their own seed
    # top-k / top-p: vLLM renormalises the returned log-prob over the kept tokens; Tandem's convention
    # is the full vocabulary. `reject` fails such a request alone; `renormalized` accepts vLLM's value.
    filtered_logprobs: Literal["reject", "renormalized"] = "reject"
    lora_alpha: float | None = None  # enables adapter-only sync (vLLM LoRA) with this scaling alpha
    lora_max_rank: int = 16
    sleep_level: int = 1  # vLLM sleep level (GPU only): 1 offloads weights to host memory, 2 drops them
    # CPU: vLLM binds its OpenMP threads and by default leaves one core unused. `all` binds every core
    # (measured faster on 2 cores); None leaves vLLM's defaults; any other string is a core list "0-3".
    cpu_threads_bind: str | None = "all"
    staging_dir: str | None = None  # async backend: where weight updates are written (None: /dev/shm or tmp)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to vLLM as they are

    def __post_init__(self) -> None:
        if self.backend not in ("inprocess", "async"):
            raise ValueError(f"backend={self.backend!r} must be 'inprocess' or 'async'")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2 (one prompt + one new token)")
        if self.filtered_logprobs not in ("reject", "renormalized"):
            raise ValueError(f"filtered_logprobs={self.filtered_logprobs!r} must be 'reject' or 'renormalized'")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be > 0 (or None: no LoRA)")
        if self.lora_max_rank < 1:
            raise ValueError(f"lora_max_rank={self.lora_max_rank} must be >= 1")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={self.sleep_level} must be 1 or 2")
        if not isinstance(self.engine_kwargs, dict):
            raise ValueError(f"engine_kwargs must be a mapping, got {type(self.engine_kwargs).__name__}")
        owned = sorted(set(self.engine_kwargs) & set(OWNED_KWARGS))
        if owned:
            raise ValueError(
                f"engine_kwargs[{owned[0]!r}] is set by the adapter: use {OWNED_KWARGS[owned[0]]} instead"
            )
