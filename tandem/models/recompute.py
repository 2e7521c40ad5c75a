"""Saved activations that backward computes again from what it keeps anyway (`recompute_saved`).

Autograd keeps the input of every linear layer for its weight gradient. Three of those inputs in a decoder
layer are the outputs of cheap pointwise functions whose own inputs autograd keeps too: both RMSNorms' outputs
(their inputs, the residual stream, and the per-row ``rsqrt`` are kept for the norm's backward) and SwiGLU's
``silu(a) * b`` (``a`` and ``b`` are kept for SwiGLU's backward); where attention pads or gathers, the output
projection keeps a gather of SDPA's output, which SDPA keeps itself (tandem/models/attention.py). For SmolLM2-135M
that is 2 x 576 + 1,536 (+ 576) of the 8,502 floats a training forward kept per token and layer.

Inside `recompute_saved`, those functions `offer` their output: a saved-tensor pack hook that is handed the
output (or a view of it) stores how to compute it (the function and its inputs, all held by autograd already)
instead of the tensor, and the first unpack in backward computes it again, once for all the layers that saved
it (q, k, v and their LoRA adapters read the same norm output); the value lives until the last of them has
run its backward. The recomputation calls the forward's own torch ops on the same inputs, so it gives the
same bits and the gradients are unchanged (tests/models/test_recompute.py checks them bit for bit).

Not substituted (kept as before): outputs made while a torch function mode other than the deterministic mode's
batch-invariant one is active (a recomputation outside it might not give the same bits), a tensor modified in
place after it was made, one whose maker is gone (the registry holds weak references only), and anything saved
inside an activation-checkpointed region, whose own saved-tensor hooks take precedence.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["offer", "recompute_saved"]

_state = threading.local()  # .registry: the enclosing `recompute_saved`'s {storage pointer: _Maker}


class _Maker:
    """How to compute one offered output again: ``fn(*inputs)``, with the output's geometry to check. Keyed by
    its storage's address, held through a weak reference: the entry goes when the output does, so no later tensor
    at the same address is taken for it (empty outputs, address 0, are never offered)."""

    __slots__ = ("fn", "inputs", "input_versions", "ref", "size", "stride", "offset", "dtype", "version", "value",
                 "__weakref__")

    def __init__(self, out: torch.Tensor, fn: Callable[..., torch.Tensor], inputs: tuple, ref) -> None:
        self.fn, self.inputs, self.ref = fn, inputs, ref
        self.input_versions = tuple(x._version if isinstance(x, torch.Tensor) else None for x in inputs)
        self.size, self.stride, self.offset = tuple(out.shape), out.stride(), out.storage_offset()
        self.dtype, self.version, self.value = out.dtype, out._version, None

    def compute(self) -> torch.Tensor:
        if self.value is None:
            for x, version in zip(self.inputs, self.input_versions, strict=True):
                if version is not None and x._version != version:  # what autograd would say of the saved output
                    raise RuntimeError(
                        f"one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: an input {list(x.shape)} of {getattr(self.fn, '__name__', self.fn)} (whose output "
                        f"backward computes again, tandem.models.recompute) is at version {x._version}; expected "
                        f"version {version} instead")
            with torch.no_grad():
                value = self.fn(*self.inputs)
            if value.stride() != self.stride or value.storage_offset() != 0:  # the layout the views were taken in
                value = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=value.device).copy_(value)
            self.value = value
        return self.value


class _Kept:
    """A saved tensor kept as it is, with its version: autograd skips its own in-place check on tensors that
    saved-tensor hooks handle, so `unpack` makes it."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {self.version} instead "
                f"(saved inside tandem.models.recompute.recompute_saved)")
        return t


class _Saved:
    """A saved tensor stood in for by its maker and where it lies in the maker's output."""

    __slots__ = ("maker", "size", "stride", "offset")

    def __init__(self, maker: _Maker, t: torch.Tensor) -> None:
        self.maker, self.size, self.stride = maker, tuple(t.shape), t.stride()
        self.offset = t.storage_offset() - maker.offset

    def unpack(self) -> torch.Tensor:
        value = self.maker.compute()
        if self.offset == 0 and self.size == self.maker.size and self.stride == self.maker.stride:
            return value
        return value.as_strided(self.size, self.stride, value.storage_offset() + self.offset)


def offer(out: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs) -> torch.Tensor:
    """Inside `recompute_saved` (this thread): a saved ``out`` (or view of it) is kept as ``fn(*inputs)``, to be
    computed again in backward; ``fn`` must give ``out``'s bits from ``inputs``, which autograd must keep anyway
    (else this costs memory rather than saving it). Outside: nothing. Returns ``out``."""
    registry = getattr(_state, "registry", None)
    if (registry is None or out.numel() == 0 or out.is_inference() or not _plain(out) or not _owns_its_storage(out)
            or not _modes_known()):
        return out
    key = out.untyped_storage().data_ptr()
    ref = weakref.ref(out, lambda _r, key=key, registry=registry: _forget(registry, key, _r))
    registry[key] = _Maker(out, fn, inputs, ref)
    return out


def _plain(t: torch.Tensor) -> bool:
    """A strided tensor with storage of its own (not a wrapper subclass such as DTensor, whose storage is not its
    data)."""
    return t.layout == torch.strided and not is_traceable_wrapper_subclass(t)


def _owns_its_storage(out: torch.Tensor) -> bool:
    """``out`` is its storage, whole and contiguous: every tensor a pack hook finds at that address is a view of
    ``out`` itself, never of other data sharing the storage."""
    return (out.layout == torch.strided and out.storage_offset() == 0 and out.is_contiguous()
            and out.untyped_storage().nbytes() == out.numel() * out.element_size())


def _modes_known() -> bool:
    """No torch function mode is active, or only the batch-invariant one (tandem.ops), which changes ``F.linear``
    and ``F.silu`` alone: the offering functions call its SiLU themselves (`tandem.models.lean_ops`), so their
    recomputation outside the mode gives the same bits. Any other mode might change what the forward's ops computed."""
    if not torch._C._is_torch_function_mode_enabled():
        return True
    from torch.overrides import _get_current_function_mode_stack

    from tandem.ops.batch_invariant import is_invariant_mode

    return all(is_invariant_mode(m) for m in _get_current_function_mode_stack())


def _forget(registry: dict, key: int, ref) -> None:
    maker = registry.get(key)
    if maker is not None and maker.ref is ref:
        del registry[key]


@contextlib.contextmanager
def recompute_saved(enabled: bool = True) -> Iterator[None]:
    """Around a training forward (this thread): outputs offered by `offer` are saved as how to compute them
    again, not as tensors (module docstring). Backward may run outside the block. ``enabled=False``: a no-op."""
    if not enabled:
        yield
        return
    registry: dict[int, _Maker] = {}

    def pack(t: torch.Tensor):
        if t.is_inference():
            return t  # no version counter (autograd does not save these for a backward anyway)
        maker = registry.get(t.untyped_storage().data_ptr()) if registry and _plain(t) else None
        made = None if maker is None else maker.ref()
        if (made is None or made._version != maker.version or t.dtype != maker.dtype or t.device != made.device
                or t.is_neg() or t.is_conj()):
            return _Kept(t)  # not offered, its maker gone (the registry entry with it), changed in place, not alike
        return _Saved(maker, t)

    def unpack(saved):
        return saved.unpack() if isinstance(saved, _Kept | _Saved) else saved

    previous = getattr(_state, "registry", None)
    _state.registry = registry
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _state.registry = previous
