"""LoRA on Megatron's tensor-parallel linear layers, in peft's layout (the FSDP engine's, fsdp/lora.py).

Megatron fuses q/k/v into ``linear_qkv`` (grouped by query group, convert.py) and gate/up into ``linear_fc1``,
and shards its linear layers over the tensor-parallel (TP) ranks. Each HF projection a recipe targets
(``q_proj`` ... ``down_proj``) gets its own adapter pair, exactly as peft gives it on the HF model: ``A``
``[rank, in]``, ``B`` ``[out, rank]``, output ``x A^T B^T * alpha / rank`` added to the projection's, ``A``
Kaiming-uniform (``a = sqrt(5)``), ``B`` zero. The pair lives on the Megatron layer that computes the
projection and is sharded like it:

* **column-parallel** (``linear_qkv``, ``linear_fc1``: output rows split): ``A`` whole on every TP rank, ``B``
  this rank's rows of the projection. The rank-``r`` product ``x A^T`` is the same on every rank and goes
  through Megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so the
  gradient of ``A`` (and of ``x``) is the sum over the ranks' rows, the same on every rank.
* **row-parallel** (``linear_proj``, ``linear_fc2``: input columns split): ``A`` this rank's columns, ``B``
  whole; the partial products ``x_r A_r^T`` are summed over TP (``reduce_from_tensor_model_parallel_region``)
  before ``B``, so ``B``'s gradient is the same on every rank.

A forward hook adds the adapters' output to the layer's in one ``addmm``: the pieces' ``A`` stacked, their ``B``
placed in the fused output's rows (q/k/v per query group, gate/up), zero across pieces, and ``alpha / rank``
applied to the rank-sized product (peft scales the output; the same up to rounding). Each ``A`` is drawn whole from a generator seeded by the engine seed and the adapter's
name, then sliced, so every TP/PP layout starts from the same adapters (and trains the same: tested against
one process). Only the adapters train; ``adapters_disabled`` runs the base (the LoRA reference model).

Export: the adapters gathered over TP, under peft's file names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``), loadable by peft, vLLM, SGLang and the
embedded engine like the FSDP engine's; or merged into the HF weights (``W + B @ A * alpha / rank``).

Not supported (refused when the engine is built): MoE models (adapters on the experts), the
TransformerEngine layer spec (its ``linear_qkv`` / ``linear_fc1`` fuse the preceding norm, so the hook would
see the un-normalised input), sequence parallelism, dropout on the adapters' input, and a quantized base
(``quantize_base``; QLoRA runs on the FSDP engine).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engines.training.common.config import LoRAConfig
from tandem.engines.training.megatron import convert

__all__ = ["TARGETS", "adapter_rules", "adapters_disabled", "apply_lora", "check_lora", "load_adapters", "merge_into",
           "peft_name"]

# HF projection -> (Megatron module under decoder.layers.{i}., its piece of the fused output, HF module path)
TARGETS: dict[str, tuple[str, str | None, str]] = {
    "q_proj": ("self_attention.linear_qkv", "q", "self_attn.q_proj"),
    "k_proj": ("self_attention.linear_qkv", "k", "self_attn.k_proj"),
    "v_proj": ("self_attention.linear_qkv", "v", "self_attn.v_proj"),
    "o_proj": ("self_attention.linear_proj", None, "self_attn.o_proj"),
    "gate_proj": ("mlp.linear_fc1", "gate", "mlp.gate_proj"),
    "up_proj": ("mlp.linear_fc1", "up", "mlp.up_proj"),
    "down_proj": ("mlp.linear_fc2", None, "mlp.down_proj"),
}
_COLUMN = {"self_attention.linear_qkv", "mlp.linear_fc1"}  # output rows split over TP; the others: input columns


def peft_name(layer: int, target: str, matrix: str) -> str:
    """peft's file name of adapter ``matrix`` (``A`` or ``B``) on HF projection ``target`` of layer ``layer``."""
    return f"base_model.model.model.layers.{layer}.{TARGETS[target][2]}.lora_{matrix}.weight"


def check_lora(cfg: LoRAConfig, *, moe: bool, transformer_engine: bool, sequence_parallel: bool) -> None:
    """Raise ValueError naming what this engine cannot do with ``cfg`` (before anything is built)."""
    unknown = [t for t in cfg.target_modules if t not in TARGETS]
    if unknown:
        raise ValueError(f"LoRA target modules {unknown} do not exist on the Megatron engine; it adapts "
                         f"{', '.join(TARGETS)}")
    refusals = {
        "a quantized base (quantize_base): QLoRA runs on trainer.engine: fsdp": cfg.quantize_base is not None,
        "dropout on the adapters' input (dropout > 0)": cfg.dropout > 0,
        "a MoE model (adapters on the experts)": moe,
        "the TransformerEngine layer spec (its linear_qkv / linear_fc1 fuse the norm before them): set "
        "layer_spec: local": transformer_engine,
        "sequence parallelism": sequence_parallel,
    }
    found = [what for what, hit in refusals.items() if hit]
    if found:
        raise ValueError(f"LoRA on the Megatron engine does not support {'; '.join(found)}; the FSDP engine "
                         "(trainer.engine: fsdp) does, except a MoE model's experts")


class _Adapters(nn.Module):
    """The adapter pairs of one Megatron linear layer (``A_<i>``, ``B_<i>`` parameters, one pair per piece)."""

    def __init__(self, pieces: list[str], column: bool, scaling: float, layout: tuple[int, ...]) -> None:
        super().__init__()
        self.pieces, self.column, self.scaling, self.layout = pieces, column, scaling, layout
        self.enabled = True

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus every piece's ``x A^T B^T * scaling`` in ``out``'s layout, as two products: the pieces'
        ``A`` stacked (``[n r, in]``), and their ``B`` placed in one ``[out, n r]`` matrix (zero where a row
        belongs to another piece), added to ``out`` by the same ``addmm``: no pass over the layer's output
        beyond the one that adds, forward or backward."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        n = len(self.pieces)
        a = torch.cat([getattr(self, f"A_{i}") for i in range(n)]) if n > 1 else self.A_0
        h = x.to(a.dtype) @ a.t()
        h = copy_to_tensor_model_parallel_region(h) if self.column else reduce_from_tensor_model_parallel_region(h)
        h = (h * self.scaling).to(out.dtype)
        b = self._placed_b(n).to(out.dtype)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), b.t())
        return flat.view(out.shape)

    def _placed_b(self, n: int) -> torch.Tensor:
        """``[out rows of this rank, n r]``: piece ``i``'s ``B`` in columns ``i r .. (i + 1) r`` of its own rows of
        the fused output (``layout``: query groups and the q/k/v rows of each, or the gate/up rows), zero elsewhere."""
        if not self.column:
            return self.B_0
        rank = self.B_0.shape[1]
        if len(self.layout) == 4:  # linear_qkv: per local query group, its q heads, its k head, its v head
            groups, names, widths = self.layout[0], "qkv", self.layout[1:]
        else:  # linear_fc1: [gate; up]
            groups, names, widths = 1, ("gate", "up"), self.layout
        blocks = []
        for name, width in zip(names, widths, strict=True):
            if name in self.pieces:
                i = self.pieces.index(name)
                b = getattr(self, f"B_{i}").reshape(groups, width, rank)
                blocks.append(F.pad(b, (i * rank, (n - 1 - i) * rank)))
            else:
                blocks.append(self.B_0.new_zeros(groups, width, n * rank))
        return torch.cat(blocks, dim=1).reshape(-1, n * rank)


def _hook(module: nn.Module, args: tuple, kwargs: dict, output):
    adapters: _Adapters = module.lora
    if not adapters.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return adapters.add_to(x, out), bias


def _draw_a(seed: int, name: str, rank: int, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole ``A`` of adapter ``name``: Kaiming-uniform with ``a = sqrt(5)`` (peft's, nn.Linear's), from a
    generator seeded by the engine seed and the name, so every parallel layout draws the same matrix."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def _plan(cfg: LoRAConfig) -> dict[str, list[str]]:
    """Megatron module (under ``decoder.layers.{i}.``) -> the HF projections adapted on it, in a fixed order."""
    by_module: dict[str, list[str]] = {}
    for target in TARGETS:  # the table's order, whatever the config lists
        if target in cfg.target_modules:
            by_module.setdefault(TARGETS[target][0], []).append(target)
    return by_module


def adapter_rules(built, cfg: LoRAConfig) -> dict[str, tuple[convert.Rule, torch.Size]]:
    """Global adapter name -> (its rule, its full shape), for every layer of the whole model (every pipeline
    stage walks the same list when it exports)."""
    layout, args = built.layout, built.args
    rows = {"q": layout.num_heads * layout.head_dim, "k": layout.num_kv_heads * layout.head_dim,
            "v": layout.num_kv_heads * layout.head_dim, "gate": args.intermediate_size, "up": args.intermediate_size}
    fan_in = {"self_attention.linear_qkv": layout.hidden_size, "mlp.linear_fc1": layout.hidden_size,
              "self_attention.linear_proj": layout.num_heads * layout.head_dim,
              "mlp.linear_fc2": args.intermediate_size}
    out = {}
    for layer in range(layout.num_layers):
        for module, targets in _plan(cfg).items():
            column = module in _COLUMN
            for i, target in enumerate(targets):
                stem = f"decoder.layers.{layer}.{module}.lora."
                a = convert.Rule(megatron=stem + f"A_{i}", hf=(peft_name(layer, target, "A"),),
                                 split="replicated" if column else "cols")
                b = convert.Rule(megatron=stem + f"B_{i}", hf=(peft_name(layer, target, "B"),),
                                 split="rows" if column else "replicated")
                out_rows = rows[TARGETS[target][1]] if column else layout.hidden_size
                out[a.megatron] = (a, torch.Size((cfg.rank, fan_in[module])))
                out[b.megatron] = (b, torch.Size((out_rows, cfg.rank)))
    return out


@torch.no_grad()
def apply_lora(built, cfg: LoRAConfig, *, tp_rank: int, tp_size: int, seed: int) -> None:
    """Add adapters to every targeted projection of this rank's layers and freeze everything else.

    Registers every adapter's rule and full shape (all layers) in ``built.rules`` / ``built.full_shapes``.
    ``built``: a `tandem.engines.training.megatron.model.BuiltModel`."""
    layout, args = built.layout, built.args
    d = layout.head_dim
    fused_layout = {"self_attention.linear_qkv": (layout.num_kv_heads // tp_size, layout.heads_per_group * d, d, d),
                    "mlp.linear_fc1": (args.intermediate_size // tp_size,) * 2}
    rules = adapter_rules(built, cfg)
    for name, (rule, shape) in rules.items():
        built.rules[name], built.full_shapes[name] = rule, shape
    plan = _plan(cfg)
    for p in built.module.parameters():
        p.requires_grad_(False)
    for local_name, module in list(built.module.named_modules()):
        parts = local_name.split(".", 3)
        if parts[:2] != ["decoder", "layers"] or len(parts) < 4 or parts[3] not in plan:
            continue
        stem = built.global_name(local_name) + ".lora."
        targets = plan[parts[3]]
        adapters = _Adapters([TARGETS[t][1] or t for t in targets], parts[3] in _COLUMN, cfg.alpha / cfg.rank,
                             fused_layout.get(parts[3], ()))
        weight = module.weight
        for i in range(len(targets)):
            rule_a, shape_a = rules[stem + f"A_{i}"]
            rule_b, shape_b = rules[stem + f"B_{i}"]
            a = convert.shard(rule_a, _draw_a(seed, rule_a.hf[0], *shape_a, weight.dtype), tp_rank, tp_size)
            b = convert.shard(rule_b, weight.new_zeros(shape_b), tp_rank, tp_size)
            adapters.register_parameter(f"A_{i}", nn.Parameter(a.clone().to(weight.device)))
            adapters.register_parameter(f"B_{i}", nn.Parameter(b.clone()))
        module.lora = adapters
        module.register_forward_hook(_hook, with_kwargs=True)


def _adapter_modules(module: nn.Module) -> list[_Adapters]:
    return [m for m in module.modules() if isinstance(m, _Adapters)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its frozen base (the LoRA reference model)."""
    adapters = _adapter_modules(module)
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True


def merge_into(named: Iterator[tuple[str, torch.Tensor]], adapters: Mapping[str, torch.Tensor],
               scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors with their adapters merged, peft's arithmetic: ``W + (B @ A) * scaling`` in ``W``'s dtype.
    ``adapters``: full adapter tensors under peft names."""
    prefix = "base_model.model."
    for name, t in named:
        a = adapters.get(prefix + name.removesuffix(".weight") + ".lora_A.weight")
        if a is None:
            yield name, t
            continue
        b = adapters[prefix + name.removesuffix(".weight") + ".lora_B.weight"]
        yield name, t + ((b @ a) * scaling).to(t.dtype)


@torch.no_grad()
def load_adapters(built, named: Mapping[str, torch.Tensor], *, tp_rank: int, tp_size: int) -> int:
    """Copy full adapter tensors under peft's names (an FSDP engine's or peft's export) into this rank's
    adapters, sharded like them; returns how many were set. Every adapter of this rank must be named."""
    count = 0
    for name, p in built.module.named_parameters():
        gname = built.global_name(name)
        if ".lora." not in gname:
            continue
        rule = built.rules[gname]
        full = named.get(rule.hf[0])
        if full is None:
            raise KeyError(f"{rule.hf[0]} (for {gname}) is not among the {len(named)} adapter tensors given")
        if tuple(full.shape) != tuple(built.full_shapes[gname]):
            raise ValueError(f"{rule.hf[0]}: shape {tuple(full.shape)}, the adapter is "
                             f"{tuple(built.full_shapes[gname])}")
        p.copy_(convert.shard(rule, full, tp_rank, tp_size).to(p.dtype))
        count += 1
    return count
