"""Configuration of the embedded torch inference engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.core.speculative import SpeculativeConfig
from tandem.kernels.config import QuantConfig
from tandem.models.registry import ModelConfig

__all__ = ["DEFAULT_MAX_NUM_SEQS", "KV_BUDGET_TOKENS", "TorchEngineConfig", "auto_num_seqs"]

DEFAULT_MAX_NUM_SEQS = 32  # slots of an engine whose max_num_seqs is left unset and no run sized it
KV_BUDGET_TOKENS = DEFAULT_MAX_NUM_SEQS * 2048  # what a run's automatic slot count may hold: the default's memory


def auto_num_seqs(rollout_batch: int, max_model_len: int) -> int:
    """The slots a run gives an engine whose ``max_num_seqs`` is unset: its rollout batch (every sequence of a
    step decoded together: one 64-row step costs far less than two of 32 rows on a CPU), never fewer than
    `DEFAULT_MAX_NUM_SEQS`, and never more than `KV_BUDGET_TOKENS` of cache allows (so a long-context run keeps
    the default's memory)."""
    cap = max(DEFAULT_MAX_NUM_SEQS, KV_BUDGET_TOKENS // max_model_len)
    return min(max(DEFAULT_MAX_NUM_SEQS, rollout_batch), cap)


@dataclass(kw_only=True, slots=True)
class TorchEngineConfig:
    """How the embedded engine runs a model.

    The KV cache is preallocated once: ``num_slots = min(max_num_seqs, kv_cache_tokens // slot_len)``
    sequence slots of ``slot_len = max_model_len`` rounded up to a multiple of 64 tokens each, so
    memory stays at ``kv_cache_tokens`` tokens (x layers x 2 x kv_heads x head_dim x dtype bytes).
    A sequence occupies one slot from admission to finish; requests that find no free slot wait.

    ``quantization`` (`tandem.kernels.QuantConfig`): serve that format's weights, dequantized on load.
    Every targeted linear weight is held as ``dequantize(quantize(w))`` in the model dtype: the model
    files at start, full-precision tensors given to ``update_weights``, or quantized tensors with their
    scales (quantize-on-send). Give it the trainer's ``qat`` config to serve the trainer's weights.
    """

    model: ModelConfig | None = None  # None: the run's model (the runtime fills it in)
    # sequences decoded together (each sample of a request is one sequence). None: a run sizes it to its rollout
    # batch (`auto_num_seqs`: prompts_per_step x n_samples_per_prompt, 32 at least, within the cache budget of
    # 32 x 2048 tokens); an engine built on its own gets 32.
    max_num_seqs: int | None = None
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    kv_cache_tokens: int | None = None  # KV-cache budget in tokens; None: max_num_seqs * max_model_len
    prefill_chunk: int = 512  # prompt tokens computed per step (the rest in later steps)
    deterministic: bool = False  # batch-invariant numerics (tandem.ops): exact rollout/train parity
    # decode attention of the normal mode (CPU): "native" = tandem/ops/csrc/decode_attention.c, built with
    # the system's C compiler on first use (tandem.ops.native); "torch" = two batched products; "auto" =
    # native when it builds, else torch. The deterministic mode always uses its batch-invariant kernel.
    decode_attention: Literal["auto", "native", "torch"] = "auto"
    # token sampling of the normal mode (CPU): "native" = tandem/ops/csrc/sample.c for rows without top-k /
    # top-p (three passes over the logits instead of five; the same draw up to float rounding), "torch" =
    # engines/inference/torch/sampling.py, "auto" = native when it builds. Deterministic mode: always torch.
    sampler: Literal["auto", "native", "torch"] = "auto"
    # RMSNorm, rotary and SwiGLU of the normal mode (CPU): "native" = tandem/ops/csrc/pointwise.c, one pass
    # each (float32 arithmetic, bf16 rounded where torch rounds); "torch" = the model's torch ops; "auto" =
    # native when it builds. Deterministic mode: always torch.
    pointwise: Literal["auto", "native", "torch"] = "auto"
    num_threads: int | None = None  # torch intra-op threads (process-wide); None leaves torch's default
    seed: int = 0  # seeds the samplers of requests without their own seed
    pack_weights: bool = True  # CPU: run the linear layers on oneDNN-packed weight copies (faster)
    # with pack_weights: keep the plain copy of each packed weight of the decoder layers too (2x their memory,
    # and a sync writes both). False (default): the packed copy is the weight, a sync packs straight into it,
    # and the plain one is rebuilt (exactly: packing is a permutation) only where something needs it (a
    # merged LoRA fold, `named_weights`); the embedding and the vocabulary projection always stay plain.
    keep_plain_weights: bool = False
    # with pack_weights: also pack a vocabulary projection that is tied to the input embedding. The embedding
    # lookup keeps the plain tensor anyway, so the packed copy is a second copy of the whole vocabulary
    # (108 MiB for SmolLM2-135M in float32) while the engine is awake. False: the projection runs oneDNN's
    # product on the plain tensor (the 64-sequence float32 rollout 3-4% slower on an AVX2 EPYC; docs/inference.md,
    # "The tied vocabulary projection"). The QLoRA recipe turns it off (memory first); untied heads are packed.
    pack_tied_head: bool = True
    # sleep() also drops those packed-only weights' packed copies (all but one per shape), so a colocated
    # trainer's step has their memory (~400 MB for SmolLM2-135M in float32); the next update_weights must
    # rewrite every one of them, and wake_up refuses until it has, naming them. For a colocated full-weight
    # sync run that must fit in less memory: measured 340-430 MiB off the demo's peak but 1.03-1.11x slower
    # steps on the 2-core VM (docs/benchmarks.md, "Weights freed while asleep"), so off by default. Like
    # vLLM's sleep level 2.
    sleep_frees_weights: bool = False
    device: Literal["cpu", "cuda"] = "cpu"
    quantization: QuantConfig | None = None  # serve quantize->dequantize weights (tandem.kernels)
    # LoRA adapters served unmerged (engines/inference/torch/lora.py): the scaling alpha of the adapters
    # `load_lora_adapter` receives (a LoRA run with sync.lora_mode: adapter fills in the trainer's);
    # None: no adapter-only sync (adapters from peft folders carry their own alpha)
    lora_alpha: float | None = None
    lora_max_rank: int = 64
    max_loras: int = 4  # adapters loaded at once (requests choose one by name)
    # fold the synced policy adapter into the packed float32 weights (pack(W + s·BA) at each sync or wake-up)
    # so that its rows skip the low-rank products; not in the deterministic mode (its exact contract needs
    # the unmerged sum) nor in bfloat16 (W + s·BA would round small updates away); other adapters' rows and
    # the base model's subtract it. False: every adapter served unmerged.
    merge_lora: bool = True
    # speculative decoding (engines/inference/torch/speculative.py): same samples' distribution, same
    # log-probs, fewer target passes when drafts are accepted; None: off (a run's rollout.speculative fills it)
    speculative: SpeculativeConfig | None = None

    def native_kernel(self, name: str, choice: str, device):
        """Kernel ``name`` of tandem.ops.native for a part set to ``choice`` (auto | native | torch), or None
        for the torch path: never on GPU nor in the deterministic mode (its batch-invariant ops are the
        contract). ``native`` raises `tandem.ops.native.NativeKernelError` when it cannot be built."""
        from tandem.ops import native

        return native.choose(name, choice, device, self.deterministic)

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool) or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1 (or None: sized by the run)")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2 (one prompt + one new token)")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_model_len:
            raise ValueError(
                f"kv_cache_tokens={self.kv_cache_tokens} must be >= max_model_len={self.max_model_len} "
                "(one sequence must fit)"
            )
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1 (or None)")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be > 0 (or None)")
        if self.lora_max_rank < 1:
            raise ValueError(f"lora_max_rank={self.lora_max_rank} must be >= 1")
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be >= 1")
        if self.decode_attention not in ("auto", "native", "torch"):
            raise ValueError(f"decode_attention={self.decode_attention!r} must be 'auto', 'native' or 'torch'")
        if self.sampler not in ("auto", "native", "torch"):
            raise ValueError(f"sampler={self.sampler!r} must be 'auto', 'native' or 'torch'")
        if self.pointwise not in ("auto", "native", "torch"):
            raise ValueError(f"pointwise={self.pointwise!r} must be 'auto', 'native' or 'torch'")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")

    @property
    def num_seqs(self) -> int:
        """``max_num_seqs``, or `DEFAULT_MAX_NUM_SEQS` where it is unset."""
        return self.max_num_seqs if self.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS

    @property
    def cache_tokens(self) -> int:
        return self.kv_cache_tokens if self.kv_cache_tokens is not None else self.num_seqs * self.max_model_len
