"""Configuration of the FSDP2 training engine: one small dataclass per concern, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# shared by every engine; re-exported here
from tandem.engines.training.common.config import LoRAConfig, OptimizerConfig
from tandem.kernels.config import QuantConfig
from tandem.models.registry import ModelConfig

__all__ = [
    "CriticConfig",
    "FSDPConfig",
    "LoRAConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RefConfig",
]

DType = Literal["float32", "bfloat16", "float16"]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the data-parallel ranks hold the model.

    ``replicate`` > 1 gives HSDP: the world is a ``replicate x shard`` mesh; parameters are sharded
    within a row and replicated across rows. ``replicate = 1`` is plain FSDP over the whole world.
    ``param_dtype`` / ``reduce_dtype`` form FSDP2's mixed-precision policy (master weights keep the
    model dtype); without a process group (one process) ``param_dtype`` runs the forward under autocast.
    """

    replicate: int = 1
    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params, grads, optimizer state on CPU
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    reshard_after_forward: bool = True  # False keeps layers gathered between forward and backward
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # used only if the engine creates the group
    # the policy's embedding / LM head used shard by shard over the vocabulary, never gathered
    # (fsdp/vocab_parallel.py); world > 1 without replicate, native model, off in deterministic mode
    vocab_parallel: bool = True
    # on a gloo group, FSDP's all-gather and reduce-scatter as point-to-point rings (fsdp/ring_comms.py):
    # no staging copies of a layer, a third to a half of gloo's time (a world-2 step 0.92-0.94x); false: gloo's
    ring_collectives: bool = True
    # world > 1, native model, no QAT: each rank reads the weights module by module as it shards them, and a QLoRA
    # base (any world) each weight as it quantizes it (fsdp/deferred.py); false: load whole, then shard
    sharded_load: bool = True

    def __post_init__(self) -> None:
        if self.replicate < 1:
            raise ValueError(f"replicate={self.replicate} must be >= 1")


@dataclass(kw_only=True, slots=True)
class RefConfig:
    """The frozen reference model for KL. ``model`` defaults to the policy's initial weights.

    With LoRA the reference is the policy with its adapters switched off (no second copy).
    ``cpu_offload`` keeps its shards on the CPU between forwards (no effect on a CPU-only machine).
    """

    model: ModelConfig | None = None
    cpu_offload: bool = False


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """A value model for PPO/GAE: a transformer backbone plus a linear value head (zero-initialised).

    ``model`` defaults to the policy's model. It trains with its own AdamW (``optimizer``).
    """

    model: ModelConfig | None = None
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """Everything the FSDP2 engine needs; the world size comes from the process group.

    ``model`` may be left unset in a recipe (the run fills in its model); the engine requires it.

    ``micro_batch_tokens`` bounds the tokens of one forward/backward (dynamic batch size): sequences
    are packed into micro-batches of at most that many tokens. ``packing = False`` (or a model the
    native implementation does not cover) uses the HF model with padded micro-batches instead, whose
    rows x longest row the budget bounds.
    ``share_prompts`` (packed only): rows that share a prompt (a GRPO group) feed it once per
    micro-batch instead of once per row, and stay in one micro-batch; the same log-probs and gradients
    (bit for bit in deterministic mode) for fewer tokens. Off with ``routing_replay`` (a prompt's
    routing is recorded per row).
    ``temperature`` scales logits before the log-softmax, like the inference engine's sampler.

    ``qat`` (`tandem.kernels.QuantConfig`): quantization-aware training. The targeted linear layers
    of the policy (and reference) model compute with fake-quantized weights (INT4, or FP8 block / MX,
    with ``quantize_activations`` also fake-quantized inputs) and a straight-through backward; the
    master weights stay in full precision, and `named_parameters_for_sync` yields them. Pair it with
    an engine holding the same format (``inference.torch.quantization``, and optionally
    ``sync.quantize`` to send fp8/int4 bytes): all three take the same QuantConfig. Not with LoRA.
    """

    model: ModelConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoRAConfig | None = None
    ref: RefConfig | None = None
    critic: CriticConfig | None = None
    micro_batch_tokens: int = 8192
    # rows of full-vocabulary logits computed at once (docs/training.md, "Log-prob chunk"): 256 (was 1,024, then 512)
    # keeps each logits buffer at 48 MiB for SmolLM2's 49k vocabulary, small enough to reuse the memory a step
    # freed; the log-prob head of 1,500 rows costs +1% (frozen head) to +5% (trained head) over 512
    logprob_chunk: int = 256
    temperature: float = 1.0
    packing: bool = True
    share_prompts: bool = True  # a prompt shared by several rows is fed once (training/common/prompts.py)
    routing_replay: bool = False  # R3: replay batch.routed_experts in MoE layers
    deterministic: bool = False  # batch-invariant ops (tandem.ops): log-probs equal the embedded engine's
    qat: QuantConfig | None = None  # fake-quantized forward of the targeted linears (tandem.kernels)
    # RMSNorm, rotary and SwiGLU backward passes: "native" = one-pass C kernels (tandem/ops/csrc/pointwise.c,
    # built with the system's C compiler on first use); "torch" = torch ops; "auto" = native when it builds.
    # CPU and normal mode only (the deterministic mode keeps torch's); gradients ~1e-7 relative apart.
    pointwise_kernels: Literal["auto", "native", "torch"] = "auto"
    # keep the RMSNorm and SwiGLU outputs (and attention rows gathered from SDPA's output) that linear layers save for
    # backward as how to compute them again (tandem/models/recompute.py): ~3,300 fewer floats per token and layer for
    # SmolLM2, the same gradients bit for bit (deterministic mode included); native models
    recompute_pointwise: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 1")
        if self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk={self.logprob_chunk} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy: 1.0)")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.pointwise_kernels not in ("auto", "native", "torch"):
            raise ValueError(f"pointwise_kernels={self.pointwise_kernels!r} must be 'auto', 'native' or 'torch'")
        if self.qat is not None and self.lora is not None:
            raise ValueError(
                "qat and lora cannot be combined: the engine would receive merged weights quantized as a "
                "whole, while training fake-quantizes the base weight alone; for LoRA on a quantized frozen base "
                "set lora.quantize_base (QLoRA) instead of qat"
            )
