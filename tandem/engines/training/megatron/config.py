"""Configuration of the Megatron-core training engine: one small dataclass per concern, validated on creation.

The optimizer section is the `OptimizerConfig` every training engine shares (AdamW + clipping), so a
recipe switches engines without touching it. Megatron-only settings that Tandem does not interpret go to
``transformer_config`` verbatim (extra ``TransformerConfig`` fields, e.g. ``recompute_granularity``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.engines.training.common.config import LoRAConfig, OptimizerConfig
from tandem.models.registry import ModelConfig

__all__ = ["LoRAConfig", "MegatronConfig", "MegatronParallelConfig", "MegatronRefConfig", "OptimizerConfig"]


@dataclass(kw_only=True, slots=True)
class MegatronParallelConfig:
    """Model parallelism; the data-parallel size is what is left of the world: ``world / (tp * pp)``.

    ``expert_parallel`` splits MoE experts over ranks carved out of ``data x tensor`` parallelism;
    ``expert_tensor_parallel`` splits each expert's matrices (1 is Megatron's advice for MoE).
    ``sequence_parallel`` splits activations outside attention/MLP along the sequence (required by
    Megatron for MoE with ``tensor_parallel > 1``; with the local layer spec it needs TransformerEngine's
    norms, so it is GPU-only). ``distributed_optimizer`` shards AdamW's state over data-parallel ranks
    (ZeRO-1).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # used only if the engine creates the group

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_tensor_parallel"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel=True needs tensor_parallel > 1")


@dataclass(kw_only=True, slots=True)
class MegatronRefConfig:
    """The frozen reference model for KL; ``model`` defaults to the policy's initial weights."""

    model: ModelConfig | None = None


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """Everything the Megatron engine needs; the world size comes from the process group.

    ``micro_batch_tokens`` bounds one forward/backward's tokens as Megatron sees them: right-padded, rows x the
    longest row (a GRPO group with ``share_prompts`` is one row: its prompt and every response).
    ``layer_spec``: ``local`` is Megatron's own modules (runs on CPU), ``transformer_engine`` its fused
    TE modules (CUDA only), ``auto`` picks TE when CUDA and TE are both present.
    ``temperature`` scales logits before the log-softmax, like the inference engine's sampler.
    ``deterministic`` sets Megatron's ``deterministic_mode`` and torch's deterministic algorithms:
    the same inputs give the same bits run after run (it does not make the numerics batch-invariant;
    see docs/megatron.md).
    """

    model: ModelConfig | None = None
    parallel: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ref: MegatronRefConfig | None = None
    micro_batch_tokens: int = 8192
    logprob_chunk: int = 256  # rows of [rows, V / TP] logits the log-prob head holds at a time (megatron/logprobs.py)
    temperature: float = 1.0
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto"
    # the local spec's core attention: torch SDPA (fused, memory linear in the sequence; attention.py) or
    # Megatron's DotProductAttention (materialises [b, heads, s, s] scores)
    attention: Literal["sdpa", "megatron"] = "sdpa"
    # rows that share a prompt (a GRPO group) feed it once, in one row with a block mask (with `attention: sdpa`
    # on the local spec; common/prompts.py, pipeline.py: pad_rows)
    share_prompts: bool = True
    vocab_divisible_by: int = 128  # Megatron pads the vocabulary to a multiple of this x tensor_parallel
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    transformer_config: dict[str, Any] = field(default_factory=dict)
    # adapters on the policy's linear layers, peft's layout (megatron/lora.py); the base frozen
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 1")
        if self.attention not in ("sdpa", "megatron"):
            raise ValueError(f"attention={self.attention!r}: choose 'sdpa' or 'megatron'")
        if self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk={self.logprob_chunk} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy: 1.0)")
        if self.vocab_divisible_by < 1:
            raise ValueError(f"vocab_divisible_by={self.vocab_divisible_by} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
