"""Tandem's own implementation of the Llama family (Llama, Qwen2, Qwen3, Qwen3-MoE).

Both the embedded inference engine and the training engines run this one model code, so rollout and
training compute the same operations in the same order: the basis of bit-exact log-probs in the
batch-invariant mode (see tandem/ops). Module and parameter names are exactly those of the HF
checkpoints (``model.layers.3.self_attn.q_proj.weight``, per-expert MoE weights), so HF weights load
without a mapping, peft LoRA targets the usual names, and weight sync speaks HF names.

Layout: **flat, token-major**. A forward takes ``input_ids [N]`` and ``positions [N]`` for all tokens of
the step (several sequences packed, or one decode token per running sequence) plus an attention
context that knows how tokens group into sequences and where a KV cache lives
(tandem/models/attention.py). Every linear layer therefore sees a 2-D ``[N, hidden]`` input.

The numerics follow HF's implementation (RMSNorm in float32, rotary tables computed in float32 then
cast, router softmax in float32) so logits match HF to rounding.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import AttentionContext, MoERouting
from tandem.models.lean_ops import rms_norm, rotary, swiglu
from tandem.models.logprobs import TiedGrad, tied_embedding, token_logprobs
from tandem.models.vector_math import warm_vector_math

__all__ = ["CausalLM", "TransformerArgs", "UnsupportedModelError", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """An HF architecture (or setting) the native implementation does not cover."""


@dataclass(kw_only=True, slots=True)
class TransformerArgs:
    """The architecture, read off an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    hf_config: Any = field(default=None, repr=False)  # kept for rotary scaling and save_pretrained

    @classmethod
    def from_hf_config(cls, config: Any) -> TransformerArgs:
        mt = config.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {mt!r} has no native implementation (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kw: dict[str, Any] = dict(
            model_type=mt,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hf_config=config,
        )
        if mt == "llama":
            bias = bool(getattr(config, "attention_bias", False))
            kw.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
        elif mt == "qwen2":
            kw.update(qkv_bias=True)
        else:  # qwen3, qwen3_moe
            bias = bool(getattr(config, "attention_bias", False))
            kw.update(qkv_bias=bias, o_bias=bias, qk_norm=True)
        if mt == "qwen3_moe":
            only_mlp = set(getattr(config, "mlp_only_layers", None) or [])
            step = getattr(config, "decoder_sparse_step", 1) or 1
            layers = tuple(
                i for i in range(config.num_hidden_layers) if i not in only_mlp and (i + 1) % step == 0
            )
            kw.update(
                num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=bool(config.norm_topk_prob),
                moe_layers=layers,
            )
        return cls(**kw)


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary tables; inverse frequencies from HF's rope functions (default, llama3, yarn, ...)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N]`` -> ``cos, sin [N, head_dim]`` in ``dtype``."""
        warm_vector_math(positions.device)  # a thread's first MKL cos/sin can be inaccurate (vector_math.py)
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rope_inv_freq(args: TransformerArgs) -> tuple[torch.Tensor, float]:
    cfg = args.hf_config
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        d = args.head_dim
        # on the CPU even under a meta device: arange on meta goes through a Python reference whose first
        # call imports torch._dynamo (~0.9 s a process); the loaded model sets these again anyway
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d)), 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError("dynamic rope scaling is not supported (it changes with sequence length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.float(), float(scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [N, heads, D]``, ``cos/sin [N, D]``: ``x * cos + rotate_half(x) * sin``."""
    return rotary(x, cos[:, None, :], sin[:, None, :])


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        h = args.hidden_size
        self.q_proj = nn.Linear(h, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, h, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)  # [N, heads, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoE(nn.Module):
    """Qwen3-MoE block: softmax router (float32), top-k, optional renormalisation, SwiGLU experts.

    With routing replay the top-k ids come from the rollout; the gate weights are recomputed from this
    model's router probabilities at those ids (renormalised the same way), so gradients reach both the
    router and the experts that produced the rollout.
    """

    def __init__(self, args: TransformerArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.num_experts)
        )

    def forward(self, x: torch.Tensor, routing: MoERouting | None) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # this model's own routing
        if routing is not None:
            replay = routing.replay_ids(self.layer_idx)
            routing.observe(self.layer_idx, ids, replay)
            if replay is not None:
                ids = replay.long()
                weights = probs.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # Experts in ascending id order: each token's contributions are added in the same order
        # whatever else is in the batch (needed for batch invariance).
        hit = torch.unique(ids).tolist()
        for e in hit:
            tok, slot = torch.where(ids == e)
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: TransformerArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.is_moe = layer_idx in args.moe_layers
        if self.is_moe:
            self.mlp: nn.Module = SparseMoE(args, layer_idx)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: AttentionContext, routing: MoERouting | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, routing) if self.is_moe else self.mlp(h))


class Backbone(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)


class CausalLM(nn.Module):
    """A decoder-only LM in the flat token-major layout. ``forward`` returns final hidden states."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        routing: MoERouting | None = None,
        *,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        logprob_chunk: int = 1024,
        tied_grad: TiedGrad | None = None,
    ):
        """``input_ids, positions [N]`` -> final-norm hidden states ``[N, hidden]``.

        With ``targets [N]`` it returns ``(log_probs [N], entropy [N] | None)`` of those tokens under
        ``softmax(logits / temperature)`` instead, computed chunk by chunk (models/logprobs.py). Doing
        it inside ``forward`` lets FSDP see the vocabulary projection as part of the root module.
        ``tied_grad`` (from `tied_grad_slot`, passed on to ``token_logprobs`` by a caller that projects the
        hidden states itself): the tied weight's gradient is built in one buffer (models/logprobs.py).
        """
        if targets is not None and tied_grad is None:
            tied_grad = self.tied_grad_slot()
        embed = self.model.embed_tokens
        x = embed(input_ids) if tied_grad is None else tied_embedding(input_ids, embed.weight, tied_grad)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx, routing)
        hidden = self.model.norm(x)
        if targets is None:
            return hidden
        return token_logprobs(
            hidden,
            self.lm_head.weight,
            targets,
            temperature=temperature,
            chunk_size=logprob_chunk,
            with_entropy=with_entropy,
            tied_grad=tied_grad,
        )

    def tied_grad_slot(self) -> TiedGrad | None:
        """A `TiedGrad` for one forward when the input embedding is the output projection's weight and
        needs a gradient (None otherwise): the backward then keeps one dense gradient of it, not three."""
        embed = self.model.embed_tokens
        if (type(embed) is nn.Embedding and embed.weight is self.lm_head.weight and embed.weight.requires_grad
                and torch.is_grad_enabled() and embed.padding_idx is None and embed.max_norm is None
                and not embed.scale_grad_by_freq and not embed.sparse):
            return TiedGrad()
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` in float32 (small ``N`` only; see models/logprobs.py)."""
        return self.lm_head(hidden).float()

    # -- HF checkpoints -----------------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under HF checkpoint names (a tied ``lm_head.weight`` is left out, as HF does)."""
        sd = self.state_dict()
        if self.args.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        given: Mapping[str, torch.Tensor] | None = None, unallocated: Container[str] = (),
    ) -> CausalLM:
        """Load an HF folder (config.json + *.safetensors) into the native implementation.

        Each tensor is read into memory of its own, one at a time (`read_safetensors`: no memory map, so the
        load costs the model, not the model plus the file). ``given``: HF-named tensors to hold as they are
        instead of reading the file's (a colocated trainer's frozen base): used where the shape, dtype and
        device are the model's, else the file's tensor is read. ``unallocated``: names left on the meta device
        (not read) for the caller to fill."""
        from tandem.models.hf_config import read_hf_config
        from tandem.models.safetensors_read import read_safetensors

        path = Path(path)
        args = TransformerArgs.from_hf_config(read_hf_config(path))
        with torch.device("meta"), _SkipInitOnMeta():
            model = cls(args)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        expected = model.hf_state_dict()
        device = torch.device(device)
        state: dict[str, torch.Tensor] = {}
        for name, t in (given or {}).items():
            want = expected.get(name)
            if (want is not None and t.shape == want.shape and t.dtype == dtype and t.is_contiguous()
                    and t.device.type == device.type):
                state[name] = t.detach()
        for name in unallocated:
            if name in expected and name not in state:
                state[name] = expected[name]  # the meta model's own tensor
        def skip(name: str) -> bool:  # held already, or a tied LM head (the embedding serves it)
            return name in state or (args.tie_word_embeddings and name == "lm_head.weight")

        for f in files:
            for name, t in read_safetensors(f, dtype=dtype, skip=skip):
                state[name] = t.to(device)
        missing, unexpected = set(expected) - set(state), set(state) - set(expected)
        if missing or unexpected:
            raise ValueError(
                f"{path}: checkpoint does not match {args.model_type}: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        model.load_state_dict(state, strict=False, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        inv_freq, _ = _rope_inv_freq(args)
        model.model.rotary_emb.inv_freq = inv_freq.to(device)
        return model.eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write an HF folder (config.json + model.safetensors) that HF, vLLM and Tandem can load."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.hf_state_dict().items()}
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.args.hf_config.to_dict()
        cfg["torch_dtype"] = cfg["dtype"] = str(self.dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str))


class _SkipInitOnMeta(torch.overrides.TorchFunctionMode):
    """Random initialisation of a meta tensor is a no-op: skip it. A meta tensor's ``normal_``/``uniform_``
    runs through a Python reference whose first call imports torch._dynamo (~0.9 s in every process that
    loads a model); the loaded checkpoint replaces every such tensor. Thread-local, as modes are."""

    _SKIP = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes its tensor by name
        if (isinstance(target, torch.Tensor) and target.is_meta
                and (func in self._SKIP or getattr(func, "__module__", None) == "torch.nn.init")):
            return target  # an initialiser fills its tensor in place and returns it
        return func(*args, **kwargs)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(args: TransformerArgs) -> float:
    """Approximate forward FLOPs per token (2 x active matmul parameters), for throughput reports."""
    h, d = args.hidden_size, args.head_dim
    attn = h * d * (2 * args.num_heads + 2 * args.num_kv_heads)
    dense_mlp = 3 * h * args.intermediate_size
    moe_mlp = 3 * h * args.moe_intermediate_size * args.num_experts_per_tok + h * args.num_experts
    mlp = sum(moe_mlp if i in args.moe_layers else dense_mlp for i in range(args.num_layers))
    return 2.0 * (args.num_layers * attn + mlp + h * args.vocab_size)
