"""HF <-> Megatron-core weight conversion for the Llama family (Llama/SmolLM2, Qwen2, Qwen3, Qwen3-MoE).

Pure torch: nothing here imports megatron, so the layout logic is tested without it. Every Megatron
parameter has one `Rule` that says which HF tensors it is built from and how it is split over the
tensor-parallel (TP) ranks. Names are *global*: ``decoder.layers.{i}`` counts layers over all pipeline
stages and ``local_experts.{j}`` counts experts over all expert-parallel ranks; `localize` /
`globalize` translate to one rank's module names.

Layouts (``nh`` query heads, ``ng`` KV heads / query groups, ``d`` head dim, ``H`` hidden size):

* ``linear_qkv`` is grouped by query group: for each of the ``ng`` groups, its ``nh / ng`` query heads,
  then its key head, then its value head: ``[ng * (nh / ng + 2) * d, H]`` (bias likewise). A TP split
  of dim 0 therefore hands each rank whole groups, which is how Megatron shards attention.
* ``linear_fc1`` is ``[gate; up]`` (SwiGLU: ``silu(first half) * second half``). Each TP rank holds
  its slice of gate stacked on its slice of up, so sharding splits the two halves separately.
* ``linear_proj`` and ``linear_fc2`` are row-parallel (split along dim 1); norms, routers and the
  qk-norm weights are replicated.
* the word embeddings and the output layer are split by vocabulary rows, padded with zero rows to
  ``padded_vocab_size`` (a multiple of the TP size); export drops the padding again.
* tied embeddings: there is no ``output_layer.weight`` (Megatron reads the word embeddings) and, as in
  HF checkpoints, no ``lm_head.weight``.
* TransformerEngine's fused-norm layer spec keeps the pre-attention norm in
  ``linear_qkv.layer_norm_weight`` and the dense pre-MLP norm in ``linear_fc1.layer_norm_weight``
  (``fused_norms=True``); the local spec has ``input_layernorm`` / ``pre_mlp_layernorm`` modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.models.transformer import TransformerArgs, UnsupportedModelError

__all__ = [
    "Layout",
    "Rule",
    "convert_hf_to_megatron",
    "export_megatron_to_hf",
    "from_megatron",
    "globalize",
    "localize",
    "rules",
    "shard",
    "to_megatron",
    "unshard",
]

Fuse = Literal["same", "qkv", "gate_up"]
Split = Literal["replicated", "rows", "cols", "gate_up"]


@dataclass(frozen=True, slots=True)
class Layout:
    """The shapes that decide how HF tensors map onto Megatron's."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    linear_bias: bool = False  # o_proj and MLP biases (Megatron's add_bias_linear)
    qk_norm: bool = False
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    fused_norms: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} must be >= vocab_size={self.vocab_size}"
            )

    @classmethod
    def from_args(cls, args: TransformerArgs, *, padded_vocab_size: int, fused_norms: bool = False) -> Layout:
        """The layout of an HF architecture; raises `UnsupportedModelError` for what Megatron cannot express."""
        if args.o_bias != args.mlp_bias:
            raise UnsupportedModelError(
                f"{args.model_type}: o_proj bias={args.o_bias} but MLP bias={args.mlp_bias}; Megatron's "
                "add_bias_linear sets both together"
            )
        if args.o_bias and not args.qkv_bias:
            raise UnsupportedModelError(f"{args.model_type}: output/MLP biases without q/k/v biases")
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            vocab_size=args.vocab_size,
            padded_vocab_size=padded_vocab_size,
            tie_word_embeddings=args.tie_word_embeddings,
            qkv_bias=args.qkv_bias,
            linear_bias=args.o_bias,
            qk_norm=args.qk_norm,
            moe_layers=tuple(args.moe_layers),
            num_experts=args.num_experts,
            fused_norms=fused_norms,
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class Rule:
    """One Megatron parameter (global name) and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    fuse: Fuse = "same"
    split: Split = "replicated"
    vocab: bool = False  # rows padded to the padded vocabulary size
    expert: bool = False  # sharded over expert-tensor-parallel ranks (not attention TP)


def _layer_rules(layout: Layout, i: int) -> list[Rule]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn, mlp = hf + "self_attn.", hf + "mlp."
    is_moe = i in layout.moe_layers
    input_norm = mg + (
        "self_attention.linear_qkv.layer_norm_weight" if layout.fused_norms else "input_layernorm.weight"
    )
    pre_mlp_fused = layout.fused_norms and not is_moe  # a MoE layer keeps its own pre-MLP norm module
    out = [
        Rule(megatron=input_norm, hf=(hf + "input_layernorm.weight",)),
        Rule(
            megatron=mg + "self_attention.linear_qkv.weight",
            hf=tuple(attn + f"{p}_proj.weight" for p in "qkv"),
            fuse="qkv",
            split="rows",
        ),
    ]
    if layout.qkv_bias:
        out.append(
            Rule(
                megatron=mg + "self_attention.linear_qkv.bias",
                hf=tuple(attn + f"{p}_proj.bias" for p in "qkv"),
                fuse="qkv",
                split="rows",
            )
        )
    out.append(
        Rule(megatron=mg + "self_attention.linear_proj.weight", hf=(attn + "o_proj.weight",), split="cols")
    )
    if layout.linear_bias:
        out.append(Rule(megatron=mg + "self_attention.linear_proj.bias", hf=(attn + "o_proj.bias",)))
    if layout.qk_norm:
        out.append(Rule(megatron=mg + "self_attention.q_layernorm.weight", hf=(attn + "q_norm.weight",)))
        out.append(Rule(megatron=mg + "self_attention.k_layernorm.weight", hf=(attn + "k_norm.weight",)))
    pre_mlp = mg + ("mlp.linear_fc1.layer_norm_weight" if pre_mlp_fused else "pre_mlp_layernorm.weight")
    out.append(Rule(megatron=pre_mlp, hf=(hf + "post_attention_layernorm.weight",)))
    if is_moe:
        out.append(Rule(megatron=mg + "mlp.router.weight", hf=(mlp + "gate.weight",)))
        for e in range(layout.num_experts):
            out.extend(
                _mlp_rules(layout, mlp + f"experts.{e}.", mg + f"mlp.experts.local_experts.{e}.", expert=True)
            )
    else:
        out.extend(_mlp_rules(layout, mlp, mg + "mlp.", expert=False))
    return out


def _mlp_rules(layout: Layout, hf: str, mg: str, *, expert: bool) -> list[Rule]:
    bias = layout.linear_bias and not expert
    out = [
        Rule(
            megatron=mg + "linear_fc1.weight",
            hf=(hf + "gate_proj.weight", hf + "up_proj.weight"),
            fuse="gate_up",
            split="gate_up",
            expert=expert,
        ),
    ]
    if bias:
        out.append(
            Rule(
                megatron=mg + "linear_fc1.bias",
                hf=(hf + "gate_proj.bias", hf + "up_proj.bias"),
                fuse="gate_up",
                split="gate_up",
            )
        )
    out.append(
        Rule(megatron=mg + "linear_fc2.weight", hf=(hf + "down_proj.weight",), split="cols", expert=expert)
    )
    if bias:
        out.append(Rule(megatron=mg + "linear_fc2.bias", hf=(hf + "down_proj.bias",)))
    return out


def rules(layout: Layout) -> list[Rule]:
    """Every Megatron parameter of the whole model (global names), embeddings first, output layer last."""
    out = [
        Rule(
            megatron="embedding.word_embeddings.weight",
            hf=("model.embed_tokens.weight",),
            split="rows",
            vocab=True,
        )
    ]
    for i in range(layout.num_layers):
        out.extend(_layer_rules(layout, i))
    out.append(Rule(megatron="decoder.final_layernorm.weight", hf=("model.norm.weight",)))
    if not layout.tie_word_embeddings:
        out.append(Rule(megatron="output_layer.weight", hf=("lm_head.weight",), split="rows", vocab=True))
    return out


# -- full tensors ------------------------------------------------------------------------------------


def to_megatron(rule: Rule, layout: Layout, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The full (unsharded) Megatron tensor of ``rule`` from the HF tensors it names."""
    parts = [hf[name] for name in rule.hf]
    if rule.fuse == "qkv":
        q, k, v = parts
        ng, d = layout.num_kv_heads, layout.head_dim
        trailing = q.shape[1:]
        grouped = torch.cat(
            [
                q.reshape(ng, layout.heads_per_group * d, *trailing),
                k.reshape(ng, d, *trailing),
                v.reshape(ng, d, *trailing),
            ],
            dim=1,
        )
        return grouped.reshape(-1, *trailing)
    if rule.fuse == "gate_up":
        return torch.cat(parts, dim=0)
    (full,) = parts
    if rule.vocab and layout.padded_vocab_size > full.shape[0]:
        pad = full.new_zeros(layout.padded_vocab_size - full.shape[0], *full.shape[1:])
        full = torch.cat([full, pad])
    return full


def from_megatron(rule: Rule, layout: Layout, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors (name, tensor) held in the full Megatron tensor of ``rule``; views where possible."""
    if rule.fuse == "qkv":
        ng, d, hpg = layout.num_kv_heads, layout.head_dim, layout.heads_per_group
        trailing = full.shape[1:]
        grouped = full.reshape(ng, (hpg + 2) * d, *trailing)
        q, k, v = grouped.split([hpg * d, d, d], dim=1)
        tensors = [q.reshape(-1, *trailing), k.reshape(-1, *trailing), v.reshape(-1, *trailing)]
        return list(zip(rule.hf, tensors, strict=True))
    if rule.fuse == "gate_up":
        return list(zip(rule.hf, full.chunk(2, dim=0), strict=True))
    if rule.vocab:
        full = full[: layout.vocab_size]
    return [(rule.hf[0], full)]


# -- tensor-parallel shards --------------------------------------------------------------------------


def shard(rule: Rule, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s slice (of ``size``) of a full Megatron tensor."""
    if rule.split == "replicated" or size == 1:
        return full
    if rule.split == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_piece(gate, 0, rank, size), _piece(up, 0, rank, size)])
    return _piece(full, 0 if rule.split == "rows" else 1, rank, size)


def unshard(rule: Rule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from every TP rank's slice, in rank order (inverse of `shard`)."""
    if rule.split == "replicated" or len(shards) == 1:
        return shards[0]
    if rule.split == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(list(shards), dim=0 if rule.split == "rows" else 1)


def _piece(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of size {t.shape[dim]} does not split over {size} tensor-parallel ranks"
        )
    return t.chunk(size, dim=dim)[rank]


# -- global <-> local names --------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def localize(name: str, layer_offset: int, expert_offset: int) -> str:
    """A global Megatron name as this rank's module name (layers and experts counted from its offsets)."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) - layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) - expert_offset}.", name)


def globalize(name: str, layer_offset: int, expert_offset: int) -> str:
    """This rank's module name as a global Megatron name (inverse of `localize`)."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


# -- whole state dicts -------------------------------------------------------------------------------


def convert_hf_to_megatron(
    layout: Layout, hf: Mapping[str, torch.Tensor], *, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Every Megatron parameter (global names) as TP rank ``tp_rank``'s shard. Checks names both ways."""
    table = rules(layout)
    needed = {n for r in table for n in r.hf}
    missing, unexpected = needed - set(hf), set(hf) - needed
    if missing or unexpected:
        raise ValueError(
            f"HF weights do not match the layout: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return {r.megatron: shard(r, to_megatron(r, layout, hf), tp_rank, tp_size) for r in table}


def export_megatron_to_hf(
    layout: Layout, gather: Callable[[Rule], torch.Tensor | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors, rule by rule; ``gather(rule)`` returns the full Megatron tensor (or None to skip)."""
    for rule in rules(layout):
        full = gather(rule)
        if full is not None:
            yield from from_megatron(rule, layout, full)
