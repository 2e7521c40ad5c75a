"""INT4 per-group quantization (W4A16): symmetric and asymmetric, fake quantization and packing.

Groups are ``group_size`` consecutive elements of a row (the last dimension, ``K``); a weight
``[N, K]`` gets scales ``[N, ceil(K/group_size)]``. The last group of a row is ragged when
``group_size`` does not divide ``K`` (it behaves as if zero-padded; nothing padded is stored).

* Symmetric (``int4_sym``, as Miles/slime's INT4 QAT): ``scale = max(amax, 2**-33) / 7``,
  ``q = clamp(round(w / scale), -7, 7)``, ``w ~= q * scale``. Codes are offset binary, ``q + 8`` in
  ``1..15`` (vLLM's ``uint4b8``); code 0 (-8) is never produced.
* Asymmetric (``int4_asym``): the range ``[lo, hi]`` always contains 0 (``lo = min(min w, 0)``,
  ``hi = max(max w, 0)``) so zero stays exact; ``scale = max(hi - lo, 2**-33) / 15``,
  ``zero_point = round(-lo / scale)`` in ``0..15``, ``code = clamp(round(w / scale) + zero_point, 0, 15)``,
  ``w ~= (code - zero_point) * scale``.

``round`` is half-to-even. Round-trip bound: ``|w - deq| <= scale / 2`` per element (plus fp32
rounding). All-zero group: scale ``2**-33 / 7`` (or ``/ 15``), codes at the zero point.
NaN/Inf do not enter the range; +-Inf saturates to the extreme level. INT4 has no NaN code:
`fake_quantize_int4` passes NaN through (its output is a float), `quantize_int4` raises on NaN.

Packing (`pack_int4`): two codes per byte along ``K``, element ``2j`` in the low nibble and ``2j+1`` in
the high nibble (``byte = c[2j] | c[2j+1] << 4``, the order GPTQ/compressed-tensors use within their
int32 words). An odd ``K`` leaves the last high nibble 0; `unpack_int4` needs ``K`` to drop it.
"""

from __future__ import annotations

import torch

from tandem.kernels._backend import Backend, ceil_div, check_float
from tandem.kernels.fp8 import dequantize_blocks, impl_for, quantize_blocks

__all__ = ["dequantize_int4", "fake_quantize_int4", "pack_int4", "quantize_int4", "unpack_int4"]


def _mode(symmetric: bool) -> str:
    return "int4_sym" if symmetric else "int4_asym"


def _check_group(group_size: int) -> int:
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} must be a power of two >= 2 (32, 64 and 128 are usual)")
    return group_size


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = True, *, backend: Backend = "auto"):
    """``[..., K]`` float -> (codes ``[..., K]`` uint8 in 0..15, fp32 scales ``[..., G]``, uint8 zero
    points ``[..., G]`` or None when symmetric), ``G = ceil(K / group_size)``."""
    check_float(w, "w")
    g = _check_group(group_size)
    if torch.isnan(w).any():
        raise ValueError("w contains NaN; int4 has no NaN code (use fake_quantize_int4 to pass NaN through)")
    codes, scales, zero_points = quantize_blocks(w.unsqueeze(0) if w.dim() == 1 else w, 1, g, _mode(symmetric), backend)
    if w.dim() == 1:
        return codes[0], scales[0], None if zero_points is None else zero_points[0]
    return codes, scales, zero_points


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None = None,
                    group_size: int = 128, dtype: torch.dtype = torch.bfloat16,
                    *, backend: Backend = "auto") -> torch.Tensor:
    """Inverse of `quantize_int4` (symmetric when ``zero_points`` is None) -> ``[..., K]`` in ``dtype``."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes has dtype {codes.dtype}; expected uint8 (unpack packed bytes with unpack_int4)")
    g = _check_group(group_size)
    mode = _mode(zero_points is None)
    c = codes.unsqueeze(0) if codes.dim() == 1 else codes
    s = scales.unsqueeze(0) if codes.dim() == 1 else scales
    z = zero_points.unsqueeze(0) if codes.dim() == 1 and zero_points is not None else zero_points
    out = dequantize_blocks(c, s.to(torch.float32), z, 1, g, mode, dtype, backend)
    return out.view(codes.shape)


def fake_quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                       *, backend: Backend = "auto") -> torch.Tensor:
    """``dequantize_int4(*quantize_int4(w))`` in ``w.dtype``, fused; the same bits. No gradient: see
    `tandem.kernels.qat.fake_quantize` for the straight-through version."""
    check_float(w, "w")
    g = _check_group(group_size)
    w2 = w.unsqueeze(0) if w.dim() == 1 else w
    return quantize_blocks(w2, 1, g, _mode(symmetric), backend, fake=True).view(w.shape)


@torch.no_grad()
def pack_int4(codes: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``[..., K]`` uint8 codes in 0..15 -> ``[..., ceil(K/2)]`` bytes (low nibble = even element)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes has dtype {codes.dtype}; expected uint8")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes hold {int(codes.max())}; int4 codes must be in 0..15")
    rows = codes.reshape(-1, codes.shape[-1]).contiguous()
    packed = impl_for(codes, backend).pack_int4(rows)
    return packed.view(*codes.shape[:-1], packed.shape[-1])


@torch.no_grad()
def unpack_int4(packed: torch.Tensor, k: int, *, backend: Backend = "auto") -> torch.Tensor:
    """Inverse of `pack_int4`: ``[..., ceil(k/2)]`` bytes -> ``[..., k]`` uint8 codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed has dtype {packed.dtype}; expected uint8")
    if ceil_div(k, 2) != packed.shape[-1]:
        raise ValueError(f"k={k} needs {ceil_div(k, 2)} packed bytes per row, got {packed.shape[-1]}")
    rows = packed.reshape(-1, packed.shape[-1]).contiguous()
    codes = impl_for(packed, backend).unpack_int4(rows, k)
    return codes.view(*packed.shape[:-1], k)
