"""Pure-torch reference of every op; `triton_kernels` mirrors it function for function, bit for bit.

All arithmetic is fp32 and written so that it rounds the same on CPU and CUDA: divisions are
tensor / tensor (torch turns ``cuda_tensor / python_float`` into a multiplication by the reciprocal,
which can differ in the last bit), no multiply feeds an add, and NaN is masked before any min/max.

Layout: a 2-D input ``[M, K]`` is cut into ``bm x bk`` blocks (ragged last blocks behave as if
zero-padded; the padding is never stored). Scales are ``[ceil(M/bm), ceil(K/bk)]``, row-major.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels._backend import AMAX_FLOOR, E4M3_MAX, ceil_div

__all__ = ["decode_e4m3", "dequant", "encode_e4m3", "pack_int4", "quant", "unpack_int4"]

E4M3_NAN = 0x7F


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


def encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn bytes (uint8): nearest even, saturating at +-448; NaN -> 0x7F (sign dropped)."""
    code = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), E4M3_NAN, code)


def decode_e4m3(code: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8) -> fp32, exactly."""
    return code.view(torch.float8_e4m3fn).to(torch.float32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e for int32 e in [-127, 127], built from bits (2**-127 is an fp32 subnormal)."""
    bits = torch.where(e >= -126, (e + 127) << 23, 0x00400000)
    return bits.to(torch.int32).view(torch.float32)


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s, for positive normal fp32 s (the UE8M0 scale rule)."""
    bits = s.view(torch.int32)
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def _blocks(x: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """``[M, K]`` -> zero-padded fp32 ``[Mb, bm, Kb, bk]``."""
    M, K = x.shape
    n_mb, n_kb = ceil_div(M, bm), ceil_div(K, bk)
    padded = F.pad(x.to(torch.float32), (0, n_kb * bk - K, 0, n_mb * bm - M))
    return padded.view(n_mb, bm, n_kb, bk)


def _unblock(y: torch.Tensor, M: int, K: int) -> torch.Tensor:
    n_mb, bm, n_kb, bk = y.shape
    return y.reshape(n_mb * bm, n_kb * bk)[:M, :K]


def _per_block(s: torch.Tensor) -> torch.Tensor:
    return s[:, None, :, None]


def _quant_fp8(xb: torch.Tensor, amax: torch.Tensor, mode: str):
    """(codes, dequantization multiplier, stored scale) of an fp8 mode."""
    if mode == "mx":
        # OCP MX v1.0, 6.3: X = 2**(floor(log2(amax)) - emax_elem), emax_elem = 8 for e4m3
        shared = (((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 8).clamp(-127, 127)
        codes = encode_e4m3(xb * _per_block(_pow2(-shared)))
        return codes, _pow2(shared), (shared + 127).to(torch.uint8)
    scale = amax.clamp_min(AMAX_FLOOR) / _const(E4M3_MAX, amax)
    if mode == "ue8m0":
        scale = _pow2_ceil(scale)
    return encode_e4m3(xb / _per_block(scale)), scale, scale


def _quant_int4(xb: torch.Tensor, amax: torch.Tensor, finite: torch.Tensor, symmetric: bool):
    """(rounded levels r, scale, lowest level, zero point or None) of an int4 mode."""
    if symmetric:
        scale = amax.clamp_min(AMAX_FLOOR) / _const(7.0, amax)
        q_lo, q_hi, zp = torch.full_like(scale, -7.0), torch.full_like(scale, 7.0), None
    else:
        values = torch.where(finite, xb, 0.0)
        lo = values.amin(dim=(1, 3)).clamp_max(0.0)
        hi = values.amax(dim=(1, 3)).clamp_min(0.0)
        scale = (hi - lo).clamp_min(AMAX_FLOOR) / _const(15.0, amax)
        zp = torch.round(torch.minimum(-lo / scale, _const(15.0, amax)))
        q_lo, q_hi = -zp, 15.0 - zp
    v = xb / _per_block(scale)
    clamped = torch.minimum(torch.maximum(v, _per_block(q_lo)), _per_block(q_hi))
    r = torch.round(torch.where(torch.isnan(v), v, clamped))
    r = torch.where(r == 0, 0.0, r)  # one zero: -0.0 would differ in bits between backends
    return r, scale, q_lo, zp


def quant(x: torch.Tensor, bm: int, bk: int, mode: str, fake: bool, out_dtype: torch.dtype | None = None):
    """Block quantization of ``x`` ``[M, K]`` with ``bm x bk`` blocks.

    mode: ``fp32`` / ``ue8m0`` (fp8 e4m3, fp32 scale = amax/448, or its power-of-two ceiling),
    ``mx`` (fp8 e4m3, E8M0 scale byte), ``int4_sym`` / ``int4_asym``.
    fake: returns ``dequant(quant(x))`` ``[M, K]`` in ``out_dtype`` (default ``x.dtype``). Otherwise
    returns ``(codes [M, K] uint8, scale [Mb, Kb], zero_point [Mb, Kb] uint8 or None)``; the scale
    is fp32, or uint8 E8M0 for ``mx``.
    """
    M, K = x.shape
    xb = _blocks(x, bm, bk)
    finite = xb.abs() < float("inf")
    amax = torch.where(finite, xb.abs(), 0.0).amax(dim=(1, 3))
    zp = None
    if mode.startswith("int4"):
        r, scale, q_lo, zp = _quant_int4(xb, amax, finite, symmetric=mode == "int4_sym")
        if fake:
            return _unblock(r * _per_block(scale), M, K).to(out_dtype or x.dtype)
        codes = (r - _per_block(q_lo)).to(torch.int32) + (1 if zp is None else 0)
        stored = scale
        zp = None if zp is None else zp.to(torch.uint8)
    else:
        codes, multiplier, stored = _quant_fp8(xb, amax, mode)
        if fake:
            return _unblock(decode_e4m3(codes) * _per_block(multiplier), M, K).to(out_dtype or x.dtype)
    return _unblock(codes.to(torch.uint8), M, K).contiguous(), stored, zp


def dequant(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, bm: int, bk: int, mode: str,
            out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quant`: codes ``[M, K]`` + per-block scale (and zero point) -> ``[M, K]`` floats."""
    M, K = q.shape
    qb = _blocks(q.view(torch.uint8), bm, bk).to(torch.uint8)
    if mode == "mx":
        exp = scale.to(torch.int32) - 127
        multiplier = torch.where(scale == 255, float("nan"), _pow2(exp))
        y = decode_e4m3(qb) * _per_block(multiplier)
    elif mode in ("fp32", "ue8m0"):
        y = decode_e4m3(qb) * _per_block(scale.to(torch.float32))
    else:
        offset = torch.full_like(scale, 8, dtype=torch.int32) if zp is None else zp.to(torch.int32)
        y = (qb.to(torch.int32) - _per_block(offset)).to(torch.float32) * _per_block(scale.to(torch.float32))
    return _unblock(y, M, K).to(out_dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` uint8 codes -> ``[R, ceil(K/2)]`` bytes: element 2j in the low nibble, 2j+1 high."""
    R, K = codes.shape
    even = F.pad(codes, (0, K % 2))
    return even[:, 0::2] | (even[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of `pack_int4`: ``[R, ceil(K/2)]`` bytes -> ``[R, K]`` uint8 codes."""
    R, KP = packed.shape
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(R, 2 * KP)[:, :K].contiguous()
