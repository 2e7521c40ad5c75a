"""A faster ``F.linear`` for CPUs: oneDNN's matmul instead of MKL's SGEMM for float32.

torch routes float32 ``F.linear`` on CPU to MKL, which on this machine (AMD EPYC, AVX-512) runs a slow
generic path: a ``[32, 576] x [576, 1536]`` product takes ~0.58 ms on one core where oneDNN takes
~0.31 ms, and the ``[128, 576] x [576, 49152]`` vocabulary projection 122 ms vs 34 ms (measured, see
docs/inference.md). bfloat16 ``F.linear`` already uses oneDNN; for it `fast_linear` is the same call.

`fast_linear` calls oneDNN (``torch.ops.mkldnn._linear_pointwise``) when it can (CPU, plain tensors,
float32 or bfloat16) and ``F.linear`` otherwise. It is differentiable: the backward uses ordinary
matmuls. `fast_linear_mode` swaps it in for every ``F.linear`` (every ``nn.Linear``) on this thread.

The mode is a ``TorchFunctionMode``: it sees every torch call of the code it wraps, ~4,500 per decode step of
SmolLM2-135M, and adds ~1 us to each (attribute reads like ``x.shape`` included): ~10% of a one-sequence
step. A hot loop uses the cheaper pair instead: `install_fast_linears(module)` once (each ``nn.Linear`` of
``module`` checks a thread-local at its call) and `fast_linear_scope(packed)` around the work; code that
calls ``F.linear`` directly calls `linear` instead. Outside a scope those are plain ``F.linear``.

An inference engine can also hand the mode oneDNN-*packed* copies of its weights (`pack_weights`):
the blocked layout saves oneDNN a reorder per call (a decode-sized product gets ~20% faster, the
vocabulary projection ~25%) and gives exactly the bits of the plain weights. The copies cost memory
(one more copy of every linear weight) and must be refreshed when the weights change (`repack`).
oneDNN's own reorder allocates a new packed tensor and runs at a quarter of memcpy's rate here; where this
process has checked (once per shape and dtype) that oneDNN's layout is the one ``csrc/pack.c`` writes,
`repack`, `pack_into` and `copy_and_repack` write the new values into the existing packed tensor instead
(same bytes, near memcpy's rate; `copy_and_repack` also updates the plain weight in the same pass).
An engine that needs no plain copy drops it (`drop_plain`): the weight becomes a `PackedOnlyWeight`, which
keeps its identity, shape and dtype, runs through `fast_linear` from its packed copy, and refuses every other
use of its values; `restore_plain` unpacks it again (exactly). `packed_like` allocates a packed tensor of a
layout this process already has (an asleep engine that freed its weights gets them back at the next sync).

**Few-row products.** A float32 or bfloat16 product of at most `SKINNY_MAX_ROWS` rows with a packed weight (a
decode step's) runs ``csrc/skinny.c`` on the packed bytes instead of oneDNN, where oneDNN's layout for the shape
is the one ``csrc/pack.c`` writes: it reads each 64-output block of the weight once per 6 rows, float32 1.46x
oneDNN's speed at 1 row and 1.03x at 64 on this machine (docs/inference.md). Its rows are row-count invariant
too, but not oneDNN's bits: the batch-invariant mode (``few_rows=False``) keeps oneDNN.

oneDNN's float32 result rows are independent of the row count from 2 rows on (1 row takes another
path with plain weights; packed weights give the same bits at 1 row too), and of the thread count;
the batch-invariant mode builds on that (tandem/ops/batch_invariant.py).

**Bounded shape caches.** oneDNN builds a primitive for each product shape, and the row count is part of
the shape: a decode step of 37 sequences and one of 38 are two primitives per weight shape, and every
prefill of a new total length is another. PyTorch keeps them in two LRU caches of 1,024 entries each
(ideep's descriptors, per thread, ``LRU_CACHE_CAPACITY``; oneDNN's primitives, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``),
and one entry costs ~0.6 MiB here (two ~250 KB brgemm descriptors and the kernel), so an engine whose batch
sizes and prompt lengths vary grows by up to ~0.6 GiB before the caches evict (measured: +0.65 MiB per new row
count, 600 row counts of one weight shape +353 MiB; SmolLM2's engine +366 MiB of live heap over 60 varied
batches, still growing). Importing ``tandem`` sets both capacities to ``tandem.ONEDNN_CACHE_CAPACITY`` (64)
unless the environment already names them: the same engine stays flat (+0 MiB from batch 5 to 60) and takes
no measurably longer (a miss rebuilds a primitive in ~0.5 ms; a decode step is tens of ms). The caches read
the variables at their first use, so this holds where ``tandem`` is imported before the process's first
oneDNN product (every Tandem entry point); set them yourself for another bound (docs/runtime.md, "Host
memory"). Known upstream: oneDNN issue #489, onnxruntime #2008.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CAN_PACK", "ONEDNN_BF16", "PackedOnlyWeight", "PackedWeights", "copy_and_repack", "drop_plain", "fast_linear",
           "fast_linear_mode", "fast_linear_scope", "install_fast_linears", "linear", "ScopedLinear", "pack_into",
           "pack_weight", "pack_weights", "packed_like", "packs_in_place", "repack", "restore_plain",
           "uses_onednn"]

log = logging.getLogger(__name__)

_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
CAN_PACK = _HAS_ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 linears on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on
    an AVX2-only CPU (many AMD EPYC / Ryzen and laptop parts) its bf16 reorder and inner product refuse."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(_HAS_ONEDNN and check is not None and check())
    except RuntimeError:
        return False


ONEDNN_BF16 = _onednn_bf16()  # False: bfloat16 linears take F.linear and are never packed (float32 still are)
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if ONEDNN_BF16 else (torch.float32,)

PackedWeights = Mapping[int, torch.Tensor]  # id(weight parameter) -> its oneDNN-packed copy


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `fast_linear` runs oneDNN for these operands (after autocast's cast, if active)."""
    return (
        _HAS_ONEDNN
        and x.is_cpu  # (not .device.type: ~1 us each, a decode step asks ~200 times)
        and weight.is_cpu
        and type(x) is torch.Tensor
        and isinstance(weight, torch.Tensor)
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and _compute_dtype(x, weight) in _ONEDNN_DTYPES
        and x.shape[-1] == weight.shape[-1]
        and weight.dim() == 2
    )


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return x.dtype if x.dtype == weight.dtype else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = torch.matmul(grad, weight) if ctx.needs_input_grad[0] else None
        gw = g2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def fast_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    packed: PackedWeights | None = None,
    few_rows: bool = True,
) -> torch.Tensor:
    """``F.linear(x [..., K], weight [N, K], bias [N])`` through oneDNN when possible -> ``[..., N]``.

    ``packed`` maps ``id(weight)`` to a packed copy (`pack_weights`), used when grad is not needed. For a
    `PackedOnlyWeight` (`drop_plain`) only the packed product exists: an operand it cannot take is an error.
    ``few_rows``: a float32 or bfloat16 product of a few rows with a packed weight may run csrc/skinny.c
    (`SKINNY_MAX_ROWS`); False keeps oneDNN's bits (the batch-invariant mode: the trainer's products are oneDNN's).
    """
    if isinstance(weight, PackedOnlyWeight):
        if not packed or id(weight) not in packed:
            raise RuntimeError(f"a packed-only weight {tuple(weight.shape)} has no packed copy in this product's "
                               f"packed weights: its values exist nowhere else")
        return _packed_only(x, packed[id(weight)], bias, few_rows)
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")  # what autocast would have cast F.linear's operands to
        with torch.autocast("cpu", enabled=False):
            return fast_linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                           few_rows=few_rows)
    if bias is not None and bias.dtype != x.dtype:
        return F.linear(x, weight, bias)
    x = x.contiguous()
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if needs_grad:
        return _OneDNNLinear.apply(x, weight.contiguous(), bias)
    packed_weight = packed.get(id(weight)) if packed else None
    if packed_weight is not None:
        return _packed_product(x, packed_weight, bias) if few_rows else _onednn(x, packed_weight, bias)
    return _onednn(x, weight.contiguous(), bias)


# Few-row products: at or below this many rows a float32 or bfloat16 product with a packed weight runs
# csrc/skinny.c on the packed bytes instead of oneDNN (0: never). Set at run time to compare the two
# (bench/skinny_linear.py).
SKINNY_MAX_ROWS = 64
# Where the kernel runs its AVX2 tile (a CPU without AVX-512), at most this many rows: it was 1.0-1.3x oneDNN's
# speed at 1-16 rows on an AVX2-only EPYC and 0.83-0.89x at 24-64 (docs/inference.md, "Few-row products").
SKINNY_MAX_ROWS_256 = 16
_SKINNY_WIDE = True  # whether the loaded kernel runs its 512-bit tile (set when it loads)
_SKINNY: dict[tuple[int, int, torch.dtype], Callable | None] = {}  # (N, K, dtype) -> the kernel's product, or None
_BLOCKS_OF_16: set[tuple[int, int, torch.dtype]] = set()  # (N, K, dtype) whose product is the 16-output blocks' tile


def _packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` (contiguous) times a oneDNN-packed weight: oneDNN's product, or for a few rows csrc/skinny.c's,
    which reads the same packed bytes once per 6 rows (docs/inference.md, "Few-row products")."""
    k, dtype = x.shape[-1], x.dtype
    if (dtype == packed_weight.dtype and dtype in _SKINNY_DTYPES and x.numel() <= SKINNY_MAX_ROWS * k
            and packed_weight.shape[1] == k and (bias is None or bias.dtype == dtype)):  # else oneDNN's error
        n = packed_weight.shape[0]
        product = _skinny_for((n, k), dtype)
        if product is not None and (x.numel() <= SKINNY_MAX_ROWS_256 * k
                                    or (_SKINNY_WIDE and (n, k, dtype) not in _BLOCKS_OF_16)):
            flat = x.dim() == 2  # a decode step's: no views (~3 us each, ~200 products a step)
            y = product(x if flat else x.view(-1, k), _data_ptr(packed_weight), n,
                        None if bias is None else bias.contiguous())
            return y if flat else y.view(*x.shape[:-1], n)
    return _onednn(x, packed_weight, bias)


def _data_ptr(packed: torch.Tensor) -> int:
    """A oneDNN tensor's data address, kept on the tensor after the first call (asking oneDNN costs ~3.5 us; a
    oneDNN tensor's memory stays where it is for its life: in-place packing writes into it, and
    `torch.utils.swap_tensors` swaps ``__dict__`` with the memory; a oneDNN tensor cannot be deep-copied)."""
    ptr = getattr(packed, "_tandem_data_ptr", None)
    if ptr is None:
        ptr = packed._tandem_data_ptr = int(torch.ops.mkldnn.data_ptr(packed))
    return ptr


_SKINNY_DTYPES = (torch.float32, torch.bfloat16)


def _skinny_product(shape: tuple[int, int], dtype: torch.dtype) -> Callable | None:
    """`native.skinny` bound to its library where csrc/skinny.c can read the packed weights of this shape and
    dtype: the kernel builds (bfloat16: with AVX-512 BF16), and oneDNN's layout for the shape is the one
    csrc/pack.c writes (checked once per shape, as for in-place packing); else None (oneDNN's product)."""
    from tandem.ops import native

    if dtype not in _ONEDNN_DTYPES:  # bfloat16 on a CPU whose oneDNN does not pack it (AVX2 only)
        return None
    global _SKINNY_WIDE
    skinny, pack = native.load("skinny"), native.load("pack")
    if skinny is None or pack is None:
        return None
    _SKINNY_WIDE = skinny.tandem_skinny_vector_bits() >= 512
    if not _in_place_ok(pack, shape, dtype, 32):
        if not _packs_in_blocks_of_16(shape, dtype):
            return None
        _BLOCKS_OF_16.add((*shape, dtype))  # its tile takes at most SKINNY_MAX_ROWS_256 rows on every CPU
        return functools.partial(native.skinny, skinny, block=16)
    try:  # a 64 x 2 probe: says whether this build has the dtype's kernel
        probe = _pack(torch.zeros(64, 2, dtype=dtype), 32)
        native.skinny(skinny, torch.zeros(1, 2, dtype=dtype), _buffer(probe)[0], 64, None)
    except ValueError as e:
        log.info("few-row products: oneDNN's for %s (%s)", dtype, e)
        return None
    return functools.partial(native.skinny, skinny)


_LAYOUT_16: dict[tuple, bool] = {}  # (shape, dtype, batch_hint) -> oneDNN lays the weight out as [N/16][K][16]


def _packs_in_blocks_of_16(shape: tuple[int, int], dtype: torch.dtype, batch_hint: int = 32) -> bool:
    """Whether oneDNN packs a float32 weight of this shape as ``[N/16][K][16]`` (on an AVX2-only CPU it does so for
    some shapes, such as 192 x 576, where most take blocks of 64): checked once per process and shape on
    `_in_place_ok`'s probe weight, 2x the weight at most (the probe and its packing; compared block by block).
    Where it is, csrc/skinny.c's 16-output tile reads it and csrc/pack.c's ``tandem_pack_b16`` writes it."""
    key = (tuple(shape), dtype, batch_hint)
    if key not in _LAYOUT_16:
        _LAYOUT_16[key] = _check_blocks_of_16(tuple(shape), dtype, batch_hint)
    return _LAYOUT_16[key]


def _check_blocks_of_16(shape: tuple[int, int], dtype: torch.dtype, batch_hint: int) -> bool:
    n, k = shape
    if dtype != torch.float32 or n <= 0 or k <= 0 or n % 16:
        return False
    probe = _probe_rows(0, n, k, dtype)
    try:
        packed_probe = _pack(probe, batch_hint)
        raw = _raw(packed_probe)  # a view of its memory: valid while packed_probe lives
    except (AttributeError, RuntimeError) as e:
        log.info("few-row products: no packed bytes for %s %s: %s", dtype, shape, e)
        return False
    if raw.numel() != n * k * 4:
        return False
    packed = raw.view(torch.float32)
    rows = max(16, (4 << 20) // (k * 4) // 16 * 16)  # ~4 MiB at a time
    for r in range(0, n, rows):
        m = min(rows, n - r)
        want = probe[r:r + m].view(m // 16, 16, k).transpose(1, 2).contiguous()
        if not torch.equal(packed[r * k:(r + m) * k].view(m // 16, k, 16), want):
            return False
    return True


def _skinny_for(shape: tuple[int, int], dtype: torch.dtype) -> Callable | None:
    """The kernel's product for packed weights of this shape and dtype, or None (oneDNN's): decided once."""
    key = (*shape, dtype)
    if key not in _SKINNY:
        _SKINNY[key] = _skinny_product(shape, dtype)
    return _SKINNY[key]


def _skinny_ok(shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> bool:
    """Whether `_packed_product` runs csrc/skinny.c for weights of this shape and dtype (at most
    `SKINNY_MAX_ROWS` rows)."""
    return _skinny_for(shape, dtype) is not None


def _packed_only(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                 few_rows: bool = True) -> torch.Tensor:
    if (not x.is_cpu or x.dtype != packed_weight.dtype or (bias is not None and bias.dtype != x.dtype)
            or x.shape[-1] != packed_weight.shape[-1] or (torch.is_grad_enabled() and x.requires_grad)):
        raise RuntimeError(
            f"a packed-only weight {tuple(packed_weight.shape)} {packed_weight.dtype} (its plain copy dropped) "
            f"takes CPU {packed_weight.dtype} inputs of width {packed_weight.shape[-1]} without grad; got "
            f"{x.dtype} {tuple(x.shape)} on {x.device}, requires_grad={x.requires_grad}: keep the plain "
            f"weights (inference.torch.keep_plain_weights: true) for this use")
    x = x.contiguous()
    return _packed_product(x, packed_weight, bias) if few_rows else _onednn(x, packed_weight, bias)


_T = torch.Tensor
_METADATA = frozenset({_T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.is_cpu.__get__, _T.is_meta.__get__,
                       _T.ndim.__get__, _T.requires_grad.__get__, _T.layout.__get__, _T.dim, _T.size, _T.numel,
                       _T.element_size, _T.is_contiguous, _T.is_floating_point})


class PackedOnlyWeight(torch.nn.Parameter):
    """A linear weight whose plain values were dropped (`drop_plain`): its oneDNN-packed copy holds them.
    Shape, dtype and the like still answer (its storage is on the meta device, which holds no values); every
    other torch operation on it raises, naming the operation: a meta tensor alone would let ``F.linear``
    return uninitialised memory. `fast_linear` runs it from the packed copy; `restore_plain` brings it back."""

    # what an operation on it is told, after "<op>() on "; a subclass with another keeper says its own
    refusal = ("a packed-only linear weight: its plain values were dropped to save memory (the engine's packed "
               "copy holds them); read the engine's weights with named_weights(), or keep them "
               "(inference.torch.keep_plain_weights: true)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(f"{getattr(func, '__name__', func)}() on {cls.refusal}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


def packs_in_place(weight: torch.Tensor, batch_hint: int = 32) -> bool:
    """Whether a sync can write ``weight``'s packed copy in place (csrc/pack.c builds and gives oneDNN's
    layout for its shape and dtype); otherwise each update re-packs it with oneDNN's reorder into new memory."""
    if not CAN_PACK or weight.dim() != 2 or weight.dtype not in _ONEDNN_DTYPES:
        return False
    from tandem.ops import native

    lib = native.load("pack")
    return lib is not None and _in_place_block(lib, tuple(weight.shape), weight.dtype, batch_hint) != 0


def drop_plain(weight: torch.nn.Parameter) -> None:
    """Make ``weight`` (a packed linear weight) a `PackedOnlyWeight`, freeing its memory; it keeps its
    identity (``id``, the key of its packed copy), shape and dtype (`torch.utils.swap_tensors`)."""
    torch.utils.swap_tensors(weight, PackedOnlyWeight(
        torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False))


def restore_plain(weight: torch.nn.Parameter, packed_weight: torch.Tensor) -> None:
    """Give a packed-only ``weight`` its plain values back from its packed copy (exact: the packed layout is
    a permutation of the plain one)."""
    torch.utils.swap_tensors(weight, torch.nn.Parameter(packed_weight.to_dense(), requires_grad=False))


def pack_weights(module: torch.nn.Module, batch_hint: int = 32, *,
                 skip: frozenset[int] = frozenset()) -> dict[int, torch.Tensor]:
    """oneDNN-packed copies of the weights of every ``nn.Linear`` in ``module`` that oneDNN runs (except
    those whose ``id`` is in ``skip``)."""
    packed: dict[int, torch.Tensor] = {}
    if not CAN_PACK:
        return packed
    weights = {id(m.weight): m.weight for m in module.modules()
               if isinstance(m, torch.nn.Linear) and id(m.weight) not in skip and _packable(m.weight)}
    for w in weights.values():  # each shape's layout check (cached) before any packed copy exists: it holds 2x a
        packs_in_place(w, batch_hint)  # weight for a moment, better here than in a rollout's caches or a sync
    for key, w in weights.items():
        packed[key] = _pack(w, batch_hint)
    return packed


def pack_weight(weight: torch.Tensor, batch_hint: int = 32) -> torch.Tensor:
    """The oneDNN-packed copy of one CPU float32/bfloat16 weight ``[N, K]`` (needs ``CAN_PACK``)."""
    if not (CAN_PACK and _packable(weight)):
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device} "
                         f"(oneDNN packing available: {CAN_PACK})")
    return _pack(weight, batch_hint)


def repack(packed: dict[int, torch.Tensor], weights, batch_hint: int = 32) -> None:
    """Refresh the packed copies of ``weights`` (parameters whose values changed), in place where possible."""
    for w in weights:
        if id(w) in packed:
            pack_into(packed, w, batch_hint=batch_hint)


def pack_into(packed: dict[int, torch.Tensor], weight: torch.Tensor, source: torch.Tensor | None = None,
              batch_hint: int = 32) -> None:
    """``packed[id(weight)]`` becomes the packed copy of ``source`` (default: ``weight``'s own values), written
    into the existing packed tensor when the native path applies, else a new one from oneDNN's reorder.
    The existing packed tensor must not be in use by a running product."""
    src = (weight if source is None else source).detach()
    current = packed.get(id(weight))
    if current is None or not _write_packed(current, src, None, batch_hint):
        packed[id(weight)] = _pack(src, batch_hint)


def copy_and_repack(packed: dict[int, torch.Tensor], weight: torch.Tensor, source: torch.Tensor,
                    batch_hint: int = 32) -> bool:
    """``weight.copy_(source)`` and its packed copy refreshed in one pass over ``source``, in place. Returns
    False, having written nothing, when this path does not apply (no packed copy of ``weight``, another dtype,
    a non-contiguous operand, no native kernel, a layout this process found not to match): then copy and
    `repack`."""
    current = packed.get(id(weight))
    src = source.detach()
    if current is None or src.dtype != weight.dtype or not weight.is_contiguous() or weight.device.type != "cpu":
        return False
    return _write_packed(current, src, weight.detach(), batch_hint)


_IN_PLACE: dict[tuple, bool] = {}  # (shape, dtype, batch_hint) -> oneDNN's layout is the one csrc/pack.c writes


def _write_packed(current: torch.Tensor, src: torch.Tensor, plain: torch.Tensor | None, batch_hint: int) -> bool:
    if (current.layout != torch._mkldnn or current.dtype != src.dtype or current.shape != src.shape
            or src.device.type != "cpu" or not src.is_contiguous()):
        return False
    from tandem.ops import native  # lazily: only packing engines need it

    lib = native.load("pack")
    block = 0 if lib is None else _in_place_block(lib, tuple(src.shape), src.dtype, batch_hint)
    if not block:
        return False
    ptr, nbytes = _buffer(current)
    native.pack_b64(lib, src, ptr, nbytes, plain, block=block)
    return True


def _in_place_block(lib, shape: tuple, dtype: torch.dtype, batch_hint: int) -> int:
    """The output block of oneDNN's layout for this shape where ``csrc/pack.c`` writes it: 64 (`_in_place_ok`),
    16 (float32 weights oneDNN lays out as ``[N/16][K][16]``, `_packs_in_blocks_of_16`), else 0."""
    if _in_place_ok(lib, shape, dtype, batch_hint):
        return 64
    return 16 if _packs_in_blocks_of_16(shape, dtype, batch_hint) else 0


def _buffer(packed: torch.Tensor) -> tuple[int, int]:
    """Address and size of a oneDNN tensor's memory."""
    return int(torch.ops.mkldnn.data_ptr(packed)), int(torch.ops.mkldnn._nbytes(packed))


def packed_like(template: torch.Tensor) -> torch.Tensor:
    """A new oneDNN tensor in ``template``'s layout (a copy of its bytes, meant to be overwritten by
    `pack_into`): new memory for a packed weight from the allocator at memcpy's rate, where oneDNN's reorder,
    the only other way to make one, runs at a fraction of it."""
    with torch.no_grad():
        return template.clone()


def _raw(packed: torch.Tensor) -> torch.Tensor:
    """A oneDNN tensor's bytes (a view of its memory: valid while ``packed`` lives)."""
    ptr, nbytes = _buffer(packed)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _in_place_ok(lib, shape: tuple, dtype: torch.dtype, batch_hint: int) -> bool:
    """Whether writing ``csrc/pack.c``'s layout gives oneDNN's own bytes for this shape: checked once per
    process on a pseudo-random weight (oneDNN picks its layout by shape, dtype and CPU).

    It holds the probe and oneDNN's packing of it (2x the weight), not a third full copy: csrc/pack.c keeps
    each 64 rows in one contiguous stretch (``[n / 64][k][n % 64]``), so its bytes for the whole weight are
    its bytes for each block of rows, end to end, and each block is compared where it lies in oneDNN's."""
    key = (shape, dtype, batch_hint)
    if key not in _IN_PLACE:
        from tandem.ops import native

        ok = False
        n, k = shape
        if n > 0 and k > 0 and n % 64 == 0 and (dtype == torch.float32 or k % 2 == 0):
            probe = torch.empty(shape, dtype=dtype)
            row_bytes = k * dtype.itemsize
            block = max(64, (4 << 20) // row_bytes // 64 * 64)  # ~4 MiB of rows
            for r in range(0, n, block):
                probe[r:r + block] = _probe_rows(r, min(n, r + block), k, dtype)
            expected = _pack(probe, batch_hint)
            del probe
            try:
                raw = _raw(expected)
                if raw.numel() != n * row_bytes:
                    raise ValueError(f"oneDNN's packing holds {raw.numel()} bytes, the weight {n * row_bytes}")
                got = torch.empty(min(block, n) * row_bytes, dtype=torch.uint8)
                ok = True
                for r in range(0, n, block):
                    rows = min(block, n - r)
                    part = got[:rows * row_bytes].zero_()  # the kernel must write every byte
                    native.pack_b64(lib, _probe_rows(r, r + rows, k, dtype), part.data_ptr(), part.numel())
                    if not torch.equal(raw[r * row_bytes:(r + rows) * row_bytes], part):
                        ok = False
                        break
            except (AttributeError, RuntimeError, ValueError) as e:  # no mkldnn.data_ptr, or sizes differ
                ok = False
                log.info("in-place packing unavailable for %s %s: %s", dtype, shape, e)
        _IN_PLACE[key] = ok
    return _IN_PLACE[key]


def _probe_rows(start: int, stop: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[start, stop)`` of `_in_place_ok`'s probe weight (``k`` columns): a cheap pattern, distinct
    between neighbours in both dtypes, the same rows whichever block they are made in."""
    flat = torch.arange(start * k, stop * k, dtype=torch.int32).mul_(-1640531535).bitwise_right_shift_(12)
    return flat.to(dtype).view(stop - start, k)


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in _ONEDNN_DTYPES


def _pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


class _FastLinearMode(TorchFunctionMode):
    def __init__(self, packed: PackedWeights | None) -> None:
        super().__init__()
        self.packed = packed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return fast_linear(*args, **(kwargs or {}), packed=self.packed)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fast_linear_mode(enabled: bool = True, *, packed: PackedWeights | None = None) -> Iterator[None]:
    """Every ``F.linear`` in the enclosed code (this thread) runs `fast_linear` (with ``packed``)."""
    if not enabled:
        yield
        return
    with _FastLinearMode(packed):
        yield


_scope = threading.local()  # inside `fast_linear_scope`: .packed (the packed weights), .impl (the product)


@contextlib.contextmanager
def fast_linear_scope(packed: PackedWeights | None = None, *, invariant: bool = False) -> Iterator[None]:
    """Inside (this thread), every ``nn.Linear`` that `install_fast_linears` set up, and `linear`, run
    `fast_linear` with ``packed`` (with ``invariant``: `tandem.ops.batch_invariant.invariant_linear`), what
    `fast_linear_mode` (`batch_invariant_mode`) does for them, without a per-call mode."""
    if invariant:
        from tandem.ops.batch_invariant import invariant_linear as impl
    else:
        impl = fast_linear
    previous = getattr(_scope, "packed", None), getattr(_scope, "impl", None)
    _scope.packed, _scope.impl = ({} if packed is None else packed), impl
    try:
        yield
    finally:
        _scope.packed, _scope.impl = previous


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the scope's product inside a `fast_linear_scope`."""
    packed = getattr(_scope, "packed", None)
    if packed is None:
        return F.linear(x, weight, bias)
    return _scope.impl(x, weight, bias, packed=packed)


def install_fast_linears(module: torch.nn.Module) -> None:
    """Make every ``nn.Linear`` in ``module`` call `linear` (so `fast_linear_scope` applies to it); outside a
    scope they behave as before. Switches each layer's class to `ScopedLinear`, a subclass (as FSDP2 swaps
    classes): still an ``nn.Linear`` to ``isinstance``, picklable, idempotent."""
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = ScopedLinear


class ScopedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose product is `linear`: `fast_linear` inside a `fast_linear_scope`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
