"""Quantization-aware training: fake-quantized forward with a straight-through estimator (STE).

`apply_qat(model, cfg)` swaps the targeted ``nn.Linear`` modules for `QATLinear`, which runs
``F.linear(x, fake_quantize(weight))``. The master weight stays in full precision and receives the
gradient unchanged (STE); the forward sees exactly the weight an engine gets from
``dequantize(quantize(weight))`` (`tandem.kernels.state_dict`), bit for bit, in training and in eval.

STE policy: the backward of fake quantization is the identity, everywhere. With absmax (or min/max)
scaling every finite value of a block lies inside the representable range, so "inside the range" is
every finite value; +-Inf (saturated in the forward) also passes its gradient through unchanged.

Call `apply_qat` before sharding (``fully_shard``) or wrapping the model: it replaces modules whose
type is exactly ``nn.Linear`` and refuses subclasses it would silently strip.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.config import QuantConfig
from tandem.kernels.fp8 import fake_quantize_fp8_activation, fake_quantize_fp8_block
from tandem.kernels.int4 import fake_quantize_int4
from tandem.kernels.mxfp8 import fake_quantize_mxfp8

__all__ = [
    "QATLinear",
    "apply_qat",
    "fake_quantize",
    "fake_quantize_activation_ste",
    "fake_quantize_weight",
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


class QATLinear(nn.Linear):
    """``nn.Linear`` whose forward uses the fake-quantized weight (and input, if configured)."""

    qat_config: QuantConfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qat_config.quantize_activations:
            x = fake_quantize_activation_ste(x, self.qat_config)
        return F.linear(x, fake_quantize(self.weight, self.qat_config), self.bias)

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
