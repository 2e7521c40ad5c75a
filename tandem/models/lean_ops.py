"""RMSNorm, rotary and SwiGLU with lean backward passes: fewer activations kept for the gradient.

Autograd keeps what each primitive op needs for its own backward, so the plain composition of these
three blocks keeps intermediates that the gradient can recompute cheaply from its inputs (per token
and layer, for SmolLM2-135M: the normalised ``h`` of both RMSNorms, 2 x 576 floats; the rotated copies
of ``q`` and ``k``, 2 x (576 + 192); ``silu(gate)``, 1,536). The functions here keep only their inputs
(and RMSNorm's per-row ``rsqrt``) and recompute the rest in backward. Measured on SmolLM2-135M (2,048
packed tokens, saved-tensor hooks): 11,190 -> 8,483 floats kept per token and layer, 2,623 -> 1,988 MiB
for the micro-batch, 0.76x.

The **forward computes exactly the plain ops** (the same torch calls in the same order, so the same
bits: the trainer/rollout log-prob contract is untouched, and the batch-invariant mode still swaps
``F.silu`` inside), and the lean path is taken only when a gradient is being recorded; inference runs
the plain ops with no autograd overhead. Backward formulas (``n = h * r``, ``r = (mean(h^2) + eps)^-1/2``):

* RMSNorm ``y = w * n``: ``dh = r * (g - n * mean(g * n))`` with ``g = dy * w``; ``dw = sum(dy * n)``.
* rotary ``y = x * cos + rot(x) * sin`` with ``rot([a, b]) = [-b, a]``: ``dx = dy * cos + rot^T(dy * sin)``,
  ``rot^T([a, b]) = [b, -a]``.
* SwiGLU ``y = silu(a) * b``, ``s = sigmoid(a)``: ``da = dy * b * s * (1 + a * (1 - s))``, ``db = dy * silu(a)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tandem.models.recompute import offer

__all__ = ["backward_kernels", "pointwise_kernels", "rms_norm", "rotary", "silu", "silu_override", "swiglu"]

_native = threading.local()  # .lib: tandem.ops.native's "pointwise" library inside `pointwise_kernels`;
# .grad_lib: the same inside `backward_kernels`; .silu: the SiLU inside `silu_override`


@contextlib.contextmanager
def _setting(name: str, value) -> Iterator[None]:
    """``_native.<name> = value`` in this thread for the enclosed code, then the previous value again."""
    previous = getattr(_native, name, None)
    setattr(_native, name, value)
    try:
        yield
    finally:
        setattr(_native, name, previous)


def silu_override(fn) -> contextlib.AbstractContextManager[None]:
    """Inside (this thread), `silu` (and `swiglu`'s SiLU) is ``fn``: the engine's deterministic mode passes
    `tandem.ops.batch_invariant.invariant_silu`, what `batch_invariant_mode` swaps in for ``F.silu``."""
    return _setting("silu", fn)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu``, or the function of the enclosing `silu_override`."""
    fn = getattr(_native, "silu", None)
    return F.silu(x) if fn is None else fn(x)


def pointwise_kernels(lib) -> contextlib.AbstractContextManager[None]:
    """Inside (this thread), `rms_norm`, `rotary` and `swiglu` run one-pass native kernels
    (tandem/ops/csrc/pointwise.c, ``lib = tandem.ops.native.load("pointwise")``) where no gradient is recorded
    and the operands suit them: the same arithmetic up to the order of RMSNorm's sum and a polynomial exp
    (~1e-7 relative). For the embedded engine's normal mode; never the deterministic mode's contract.
    ``lib=None``: a no-op."""
    return _setting("lib", _with_module(lib))


def backward_kernels(lib) -> contextlib.AbstractContextManager[None]:
    """Inside (this thread), the lean autograd functions recorded here run their backward passes as one-pass
    native kernels (csrc/pointwise.c) where the operands suit them: the formulas below in float32, ~1e-7
    relative from the torch ops' results (a polynomial exp, reordered sums). The forward is untouched. The
    library is captured when a function is recorded, so the backward may run outside the block; wrap the
    backward too where it recomputes (activation checkpointing). The FSDP engine's normal mode on CPU
    (``trainer.fsdp.pointwise_kernels``). ``lib=None``: a no-op."""
    return _setting("grad_lib", _with_module(lib))


def _grad_lib():
    return getattr(_native, "grad_lib", None) or _NONE


def _kernels():
    return getattr(_native, "lib", None) or _NONE


_NONE = (None, None)


def _with_module(lib):
    """``(lib, tandem.ops.native)`` for the thread-local, imported once per scope, not per call (~150 calls a
    decode step); None for no library. Lazily: tandem.models does not need the module otherwise."""
    if lib is None:
        return None
    from tandem.ops import native

    return lib, native


def _recording(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- RMSNorm ------------------------------------------------------------------------------------------


def _rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rms_norm_from(x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """RMSNorm's output from its input and per-row ``rsqrt`` (the forward, and its recomputation)."""
    return weight * (x.float() * r).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        ctx.kernels = _grad_lib()
        return offer(_rms_norm_from(x, weight, r), _rms_norm_from, x, weight, r)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        lib, native = ctx.kernels
        if lib is not None and (out := native.rms_norm_backward(lib, x, weight, r, dy)) is not None:
            dx, dw = out
            return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None
        n = x.float() * r
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = (dy * weight).float()
            dx = (r * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy * n.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (normalise in float32, cast back, scale) over the last dimension."""
    if _recording(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    lib, native = _kernels()
    if lib is not None and (out := native.rms_norm(lib, x, weight, eps)) is not None:
        return out
    return _rms_norm_plain(x, weight, eps)


# -- rotary -------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_t(x: torch.Tensor) -> torch.Tensor:
    """The transpose of `_rotate_half`: ``[a, b] -> [b, -a]``."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.kernels = _grad_lib()
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        lib, native = ctx.kernels
        if lib is not None and (dx := native.rotary_backward(lib, dy, cos, sin)) is not None:
            return dx, None, None
        return dy * cos + _rotate_half_t(dy * sin), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``; ``cos``/``sin`` broadcast against ``x`` and take no gradient."""
    if _recording(x) and not (cos.requires_grad or sin.requires_grad):
        return _Rotary.apply(x, cos, sin)
    lib, native = _kernels()
    if lib is not None and not _recording(x, cos, sin) and (out := native.rotary(lib, x, cos, sin)) is not None:
        return out
    return x * cos + _rotate_half(x) * sin


# -- SwiGLU -------------------------------------------------------------------------------------------


def _forward_silu():
    """The SiLU ``F.silu`` stands for here: the batch-invariant mode's where it is active (it swaps ``F.silu``),
    named so that a recomputation outside the mode (`tandem.models.recompute`) calls the same function."""
    if torch._C._is_torch_function_mode_enabled():
        from tandem.ops.batch_invariant import invariant_silu, is_batch_invariant

        if is_batch_invariant():
            return invariant_silu
    return F.silu


def _swiglu_with(silu_fn, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu_fn(a) * b``: the forward, and its recomputation with the SiLU the forward used (the
    batch-invariant mode's, where it is on)."""
    return silu_fn(a) * b


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.kernels = _grad_lib()
        silu_fn = _forward_silu()
        return offer(_swiglu_with(silu_fn, a, b), _swiglu_with, silu_fn, a, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        lib, native = ctx.kernels
        if lib is not None and (out := native.swiglu_backward(lib, a, b, dy)) is not None:
            da, db = out
            return (da if ctx.needs_input_grad[0] else None), (db if ctx.needs_input_grad[1] else None)
        wide = torch.promote_types(a.dtype, torch.float32)
        af = a.to(wide)
        s = torch.sigmoid(af)
        da = db = None
        if ctx.needs_input_grad[0]:
            da = (dy.to(wide) * b.to(wide) * s * (1.0 + af * (1.0 - s))).to(a.dtype)
        if ctx.needs_input_grad[1]:
            db = (dy.to(wide) * (af * s)).to(b.dtype)
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (``F.silu``, so the batch-invariant mode's SiLU applies)."""
    if _recording(a, b):
        return _SwiGLU.apply(a, b)
    lib, native = _kernels()
    if lib is not None and (out := native.swiglu(lib, a, b)) is not None:
        return out
    return silu(a) * b
