"""FP8 e4m3 block quantization: weights in ``128 x 128`` blocks, activations in ``1 x 128`` token groups.

Layout (the block-FP8 checkpoints SGLang and vLLM load, e.g. DeepSeek-V3's): a weight ``[N, K]``
becomes e4m3 bytes ``[N, K]`` plus one fp32 ``weight_scale_inv`` per block,
``[ceil(N/bn), ceil(K/bk)]``, with ``w ~= fp8 * scale_inv``. Despite its name the stored number is the
dequantization multiplier ``amax / 448``; quantization divides by it.

Rules (the same in the torch reference and the Triton kernel, bit for bit):

* ``scale_inv = max(amax, 2**-33) / 448`` in fp32, ``amax`` over the block's finite values. With
  ``scale="ue8m0"`` it is rounded up to a power of two (DeepGEMM's UE8M0 scales), so
  ``w / scale_inv`` is exact before the fp8 rounding.
* ``fp8 = e4m3(w / scale_inv)``: round to nearest even, e4m3 subnormals kept, saturating at +-448.
* All-zero block: ``scale_inv = 2**-33 / 448`` (finite, non-zero); every code is +-0.
* NaN encodes as the e4m3fn NaN 0x7F (its sign is dropped: GPUs do not keep NaN signs) and
  dequantizes to NaN; +-Inf saturates to +-448 * scale_inv. Neither affects the block's scale.
* Subnormal fp32/bf16 inputs are exact inputs; they quantize to +-0 unless the whole block is tiny.
* A dimension that is not a multiple of the block: the last block is ragged (it behaves as if
  zero-padded; nothing padded is stored), so scale shapes are ceil-divided.

Round-trip bound: ``|w - dequant(quant(w))| <= 2**-4 * |w| + 2**-10 * scale_inv`` per element
(half an e4m3 ulp at 3 mantissa bits, or half the subnormal step), plus fp32 rounding.

Weights with more than two dimensions (``[E, N, K]`` MoE experts) are quantized per matrix; the scale
is ``[E, ceil(N/bn), ceil(K/bk)]``.
"""

from __future__ import annotations

from typing import Literal

import torch

from tandem.kernels import reference
from tandem.kernels._backend import (
    Backend,
    as_rows,
    ceil_div,
    check_codes,
    check_float,
    check_out_dtype,
    use_triton,
)
from tandem.kernels._backend import kernels as _triton_kernels
from tandem.kernels.config import MAX_BLOCK_DIM, MAX_BLOCK_ELEMENTS

__all__ = [
    "dequantize_fp8_activation",
    "dequantize_fp8_block",
    "fake_quantize_fp8_activation",
    "fake_quantize_fp8_block",
    "quantize_fp8_activation",
    "quantize_fp8_block",
]

ScaleFormat = Literal["fp32", "ue8m0"]


def impl_for(x: torch.Tensor, backend: Backend):
    """The module (`reference` or `triton_kernels`) that runs ops on ``x``."""
    return _triton_kernels() if use_triton(x, backend) else reference


def _native_dequant(codes: torch.Tensor, scales: torch.Tensor, bm: int, bk: int) -> torch.Tensor | None:
    """The native CPU kernel for float32 block dequantization, or None (no compiler, native kernels off)."""
    from tandem.ops import native  # lazily: the kernel module does not need it otherwise

    lib = native.load("dequant")
    return None if lib is None else native.dequant_fp8_block(lib, codes, scales, bm, bk)


def _check_block(block_size: tuple[int, int]) -> tuple[int, int]:
    if len(block_size) != 2 or any(b < 1 or b & (b - 1) or b > MAX_BLOCK_DIM for b in block_size):
        raise ValueError(f"block_size={tuple(block_size)} must be two powers of two in [1, {MAX_BLOCK_DIM}]")
    if block_size[0] * block_size[1] > MAX_BLOCK_ELEMENTS:
        raise ValueError(f"block_size={tuple(block_size)} has more than {MAX_BLOCK_ELEMENTS} elements")
    return int(block_size[0]), int(block_size[1])


def _check_scale(scale: str) -> None:
    if scale not in ("fp32", "ue8m0"):
        raise ValueError(f"scale={scale!r} is not one of fp32, ue8m0")


def _check_scale_shape(scale: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(scale.shape)}; the codes and block size need {expected}")


@torch.no_grad()
def quantize_blocks(w: torch.Tensor, bm: int, bk: int, mode: str, backend: Backend, fake: bool = False,
                    out_dtype: torch.dtype | None = None):
    """Quantize the last two dims of ``w`` ``[..., N, K]`` in ``bm x bk`` blocks, matrix by matrix."""
    impl = impl_for(w, backend)
    *lead, N, K = w.shape
    if not lead or bm == 1 or N % bm == 0:  # blocks never straddle two matrices: one launch
        out = impl.quant(as_rows(w), bm, bk, mode, fake, out_dtype)
        if fake:
            return out.view(w.shape)
        codes, scale, zp = out
        shape = (*lead, ceil_div(N, bm), ceil_div(K, bk))
        return codes.view(w.shape), scale.view(shape), None if zp is None else zp.view(shape)
    parts = [quantize_blocks(m, bm, bk, mode, backend, fake, out_dtype) for m in w.reshape(-1, N, K)]
    if fake:
        return torch.stack(parts).view(w.shape)
    codes, scale, zp = (torch.stack(p) if p[0] is not None else None for p in zip(*parts, strict=True))
    grid = scale.shape[-2:]
    return codes.view(w.shape), scale.view(*lead, *grid), None if zp is None else zp.view(*lead, *grid)


@torch.no_grad()
def dequantize_blocks(q, scale, zp, bm: int, bk: int, mode: str, dtype: torch.dtype, backend: Backend):
    """Inverse of `quantize_blocks` for codes ``[..., N, K]`` and scales ``[..., Nb, Kb]``."""
    check_out_dtype(dtype)
    *lead, N, K = q.shape
    grid = (ceil_div(N, bm), ceil_div(K, bk))
    _check_scale_shape(scale, (*lead, *grid), "scale")
    if zp is not None:
        _check_scale_shape(zp, (*lead, *grid), "zero_point")
    impl = impl_for(q, backend)
    codes = q.view(torch.uint8).reshape(-1, N, K)
    scales = scale.reshape(-1, *grid)
    zps = None if zp is None else zp.reshape(-1, *grid)
    if not lead or bm == 1 or N % bm == 0:
        rows, row_scales = as_rows(codes), scales.reshape(-1, grid[1])
        if (impl is reference and zps is None and mode in ("fp32", "ue8m0") and dtype == torch.float32 and q.is_cpu
                and scale.dtype == torch.float32):
            out = _native_dequant(rows, row_scales, bm, bk)
            if out is not None:  # one pass, the reference's bits (csrc/dequant.c)
                return out.view(q.shape)
        zp2 = None if zps is None else zps.reshape(-1, grid[1])
        out = impl.dequant(rows, row_scales, zp2, bm, bk, mode, dtype)
        return out.view(q.shape)
    mats = [
        impl.dequant(codes[i], scales[i], None if zps is None else zps[i], bm, bk, mode, dtype)
        for i in range(codes.shape[0])
    ]
    return torch.stack(mats).view(q.shape)


def quantize_fp8_block(w: torch.Tensor, block_size: tuple[int, int] = (128, 128), scale: ScaleFormat = "fp32",
                       *, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Weight ``[..., N, K]`` (fp32/bf16/fp16) -> (e4m3 bytes ``[..., N, K]`` uint8, fp32 scale_inv
    ``[..., ceil(N/bn), ceil(K/bk)]``). View the bytes as ``torch.float8_e4m3fn`` to store them."""
    check_float(w, "w", min_dim=2)
    bm, bk = _check_block(block_size)
    _check_scale(scale)
    codes, scale_inv, _ = quantize_blocks(w, bm, bk, scale, backend)
    return codes, scale_inv


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.bfloat16, *, backend: Backend = "auto") -> torch.Tensor:
    """e4m3 codes ``[..., N, K]`` (uint8 or float8_e4m3fn) * per-block ``scale_inv`` -> ``dtype``."""
    check_codes(q, "q")
    bm, bk = _check_block(block_size)
    return dequantize_blocks(q, scale_inv.to(torch.float32), None, bm, bk, "fp32", dtype, backend)


def fake_quantize_fp8_block(w: torch.Tensor, block_size: tuple[int, int] = (128, 128), scale: ScaleFormat = "fp32",
                            *, backend: Backend = "auto") -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w.dtype``, fused; the same bits as the two-step path."""
    check_float(w, "w", min_dim=2)
    bm, bk = _check_block(block_size)
    _check_scale(scale)
    return quantize_blocks(w, bm, bk, scale, backend, fake=True)


def _check_group(group_size: int) -> int:
    if group_size < 1 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} must be a power of two")
    return group_size


@torch.no_grad()
def quantize_fp8_activation(x: torch.Tensor, group_size: int = 128, scale: ScaleFormat = "fp32",
                            *, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization: ``[..., K]`` -> (e4m3 bytes ``[..., K]``, fp32 scales
    ``[..., ceil(K/group_size)]``), one scale per ``group_size`` consecutive channels of a token."""
    check_float(x, "x")
    _check_scale(scale)
    g = _check_group(group_size)
    codes, scales, _ = impl_for(x, backend).quant(as_rows(x), 1, g, scale, False)
    return codes.view(x.shape), scales.view(*x.shape[:-1], -1)


@torch.no_grad()
def dequantize_fp8_activation(q: torch.Tensor, scales: torch.Tensor, group_size: int = 128,
                              dtype: torch.dtype = torch.bfloat16, *, backend: Backend = "auto") -> torch.Tensor:
    """Inverse of `quantize_fp8_activation`."""
    check_codes(q, "q")
    g = _check_group(group_size)
    K = q.shape[-1]
    _check_scale_shape(scales, (*q.shape[:-1], ceil_div(K, g)), "scales")
    codes = as_rows(q.view(torch.uint8))
    out = impl_for(q, backend).dequant(codes, scales.reshape(codes.shape[0], -1).float(), None, 1, g, "fp32", dtype)
    return out.view(q.shape)


@torch.no_grad()
def fake_quantize_fp8_activation(x: torch.Tensor, group_size: int = 128, scale: ScaleFormat = "fp32",
                                 *, backend: Backend = "auto") -> torch.Tensor:
    """``dequantize(quantize(x))`` per token group, in ``x.dtype``."""
    check_float(x, "x")
    _check_scale(scale)
    g = _check_group(group_size)
    return impl_for(x, backend).quant(as_rows(x), 1, g, scale, True).view(x.shape)
