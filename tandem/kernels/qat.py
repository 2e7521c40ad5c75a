"""Quantization-aware training: fake-quantized forward with a straight-through estimator (STE).

`apply_qat(model, cfg)` swaps the targeted ``nn.Linear`` modules for `QATLinear`, which runs
``F.linear(x, fake_quantize(weight))``. The master weight stays in full precision and receives the
gradient unchanged (STE); the forward sees exactly the weight an engine gets from
``dequantize(quantize(weight))`` (`tandem.kernels.state_dict`), bit for bit, in training and in eval.

STE policy: the backward of fake quantization is the identity, everywhere. With absmax (or min/max)
scaling every finite value of a block lies inside the representable range, so "inside the range" is
every finite value; +-Inf (saturated in the forward) also passes its gradient through unchanged.

Call `apply_qat` before sharding (``fully_shard``) or wrapping the model: it replaces modules whose
type is exactly ``nn.Linear`` and refuses subclasses it would silently strip. `qat_targets` names the
modules it would swap and refuses targets that match nothing; an inference engine that serves the
same format holds the quantized weights (`tandem.kernels.load`) and, for ``quantize_activations``,
fake-quantizes each targeted linear's input with `quantize_linear_inputs`.

Under autocast the weight (and input) are cast to the autocast dtype *before* fake quantization, so a
one-process trainer with autocast quantizes what an FSDP mixed-precision forward (weights gathered in
``param_dtype``) and an engine holding ``param_dtype`` weights quantize.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.config import DEFAULT_TARGETS, QuantConfig, matches_pattern
from tandem.kernels.fp8 import fake_quantize_fp8_activation, fake_quantize_fp8_block
from tandem.kernels.int4 import fake_quantize_int4
from tandem.kernels.mxfp8 import fake_quantize_mxfp8

__all__ = [
    "QATLinear",
    "apply_qat",
    "fake_quantize",
    "fake_quantize_activation_ste",
    "fake_quantize_weight",
    "qat_targets",
    "quantize_linear_inputs",
    "remove_qat",
]


def fake_quantize_weight(w: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w.dtype`` for ``cfg.format`` (no gradient)."""
    if cfg.format == "fp8_block":
        return fake_quantize_fp8_block(w, cfg.block_size, cfg.scale, backend=cfg.backend)
    if cfg.format == "mxfp8":
        return fake_quantize_mxfp8(w, backend=cfg.backend)
    return fake_quantize_int4(w, cfg.group_size, cfg.format == "int4_sym", backend=cfg.backend)


def _fake_quantize_activation(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    if cfg.format == "fp8_block":
        return fake_quantize_fp8_activation(x, cfg.group_size, cfg.scale, backend=cfg.backend)
    if cfg.format == "mxfp8":
        return fake_quantize_mxfp8(x, backend=cfg.backend)
    raise ValueError(f"activation quantization needs an fp8 format, got format={cfg.format!r}")


class _StraightThrough(torch.autograd.Function):
    """Forward: ``fn(x)``; backward: the incoming gradient, unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quantize(w: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Fake-quantized ``w`` (same shape and dtype) whose gradient flows straight through to ``w``."""
    return _StraightThrough.apply(w, partial(fake_quantize_weight, cfg=cfg))


def fake_quantize_activation_ste(x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Per-token-group (fp8_block) or MX (mxfp8) fake quantization of ``x`` ``[..., K]`` with an STE."""
    return _StraightThrough.apply(x, partial(_fake_quantize_activation, cfg=cfg))


def _in_compute_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t`` cast to the autocast dtype when autocast is on for its device (what F.linear would use)."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        if t.dtype != dtype:
            return t.to(dtype)
    return t


class QATLinear(nn.Linear):
    """``nn.Linear`` whose forward uses the fake-quantized weight (and input, if configured)."""

    qat_config: QuantConfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qat_config.quantize_activations:
            x = fake_quantize_activation_ste(_in_compute_dtype(x), self.qat_config)
        return F.linear(x, fake_quantize(_in_compute_dtype(self.weight), self.qat_config), self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: QuantConfig) -> QATLinear:
        """A QATLinear sharing ``linear``'s parameters, hooks and attributes (nothing is copied)."""
        new = cls.__new__(cls)
        new.__dict__.update(linear.__dict__)
        new.qat_config = cfg
        return new

    def to_linear(self) -> nn.Linear:
        plain = nn.Linear.__new__(nn.Linear)
        plain.__dict__.update({k: v for k, v in self.__dict__.items() if k != "qat_config"})
        return plain


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def qat_targets(model: nn.Module, cfg: QuantConfig, *, output_module: str | None = None) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that ``cfg`` targets (what `apply_qat` swaps).

    Raises ValueError, listing the model's linear layers, when nothing matches, when a pattern of
    ``target_modules`` matches no targeted linear (unless the list is the default one, which spans
    model families: ``gate_up_proj`` exists only in fused MoE models), or when ``output_module`` (the
    LM head, whose weight log-prob code reads directly, bypassing the module) is targeted.
    """
    linears = [name for name, m in model.named_modules() if name and isinstance(m, nn.Linear)]
    chosen = [name for name in linears if cfg.targets(name)]
    available = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in linears}))
    if output_module is not None and output_module in chosen:
        raise ValueError(
            f"quantization targets {output_module!r}, the output projection: log-probs read its weight "
            "directly (and it is often tied to the embedding), so it cannot be fake-quantized; remove it "
            "from target_modules or add it to exclude_modules"
        )
    spans_families = list(cfg.target_modules) == DEFAULT_TARGETS
    unmatched = [
        p for p in cfg.target_modules
        if not spans_families and not any(matches_pattern(name, p) for name in chosen)
    ]
    if unmatched or not chosen:
        raise ValueError(
            f"quantization target_modules={cfg.target_modules}: {unmatched or 'nothing'} matches no linear "
            f"layer (exclude_modules={cfg.exclude_modules}); the model's linear layers are: {available}"
        )
    return chosen


def quantize_linear_inputs(model: nn.Module, cfg: QuantConfig, names: list[str]) -> list:
    """Forward pre-hooks that fake-quantize the input of each named linear (no gradient): an engine's
    side of ``quantize_activations``, the same values `QATLinear` feeds its matmul. Returns the handles."""
    if not cfg.quantize_activations:
        return []

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (_fake_quantize_activation(args[0], cfg), *args[1:])

    return [model.get_submodule(name).register_forward_pre_hook(hook) for name in names]


def apply_qat(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Make the ``nn.Linear`` modules that ``cfg`` targets run a fake-quantized forward (STE).

    Returns the names of the swapped modules. Parameters keep their objects and names, so optimizers,
    state dicts and weight sync see no change. Raises ValueError when nothing matches or when a match
    is an ``nn.Linear`` subclass (e.g. already sharded), which the swap would break.
    """
    chosen = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.Linear) or isinstance(module, QATLinear):
            continue
        if not cfg.targets(name):
            continue
        if type(module) is not nn.Linear:
            raise ValueError(
                f"apply_qat: {name} is a {type(module).__name__}, not a plain nn.Linear; "
                "call apply_qat before fully_shard or other wrapping"
            )
        chosen.append(name)
    if not chosen:
        raise ValueError(
            f"apply_qat: no nn.Linear matches target_modules={cfg.target_modules} "
            f"(exclude_modules={cfg.exclude_modules})"
        )
    for name in chosen:
        _replace(model, name, QATLinear.from_linear(model.get_submodule(name), cfg))
    return chosen


def remove_qat(model: nn.Module) -> list[str]:
    """Undo `apply_qat`: every `QATLinear` becomes a plain ``nn.Linear`` again. Returns their names."""
    names = [name for name, m in model.named_modules() if isinstance(m, QATLinear)]
    for name in names:
        _replace(model, name, model.get_submodule(name).to_linear())
    return names
