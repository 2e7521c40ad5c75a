"""Triton kernels for every op in `tandem.kernels`; each produces the bits of its torch reference.

Imported lazily (through `tandem.kernels._backend.kernels`): this is the only module that imports
triton. On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported).

Bit-exactness with torch, on the GPU and in the interpreter, rests on a few rules:

* No float cast is trusted to round: fp32 -> e4m3 and fp32 -> bf16 are integer operations on the
  fp32 bits (round to nearest even), and bf16 inputs are widened from their bits. The interpreter's
  ``.to(tl.float8e4nv)`` and ``.to(tl.bfloat16)`` round wrongly, and it misreads bf16 subnormals.
* Division is ``tl.math.div_rn`` (IEEE round-to-nearest); Triton's ``/`` on fp32 is approximate on
  NVIDIA GPUs. Kernels launch with ``enable_fp_fusion=False`` so no multiply-add becomes an FMA.
* NaN never meets a min/max (their NaN handling differs by backend); it is masked explicitly.
* A program handles ``G`` blocks at once (a ``[G, BM*BK]`` tile): one block per program would make
  the interpreter spend minutes on a 4096 x 4096 weight.

Modes (``MODE``): 0 fp8 e4m3 with fp32 scale, 1 fp8 with UE8M0 (power-of-two) scale, 2 MXFP8
(E8M0 scale byte), 3 int4 symmetric, 4 int4 asymmetric. Input/output kinds: 0 fp32, 1 bf16
(passed as its int16 bits), 2 fp16.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tandem.kernels._backend import AMAX_FLOOR, ceil_div, interpreter_on

__all__ = ["dequant", "pack_int4", "quant", "unpack_int4"]

MODES = {"fp32": 0, "ue8m0": 1, "mx": 2, "int4_sym": 3, "int4_asym": 4}
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LAUNCH = {"enable_fp_fusion": False}


@triton.jit
def _rne(v):
    """Round half to even for |v| < 2**22, keeping the sign of zero (as torch.round does)."""
    r = (tl.abs(v) + 12582912.0) - 12582912.0
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _encode_e4m3(y):
    """fp32 -> e4m3fn code (int32 0..255): nearest even, saturating at +-448, NaN -> 0x7F."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag_c = tl.minimum(mag, 0x7F800000)
    # normal range (|y| >= 2**-6): drop 20 mantissa bits with round-half-even; a carry bumps the exponent
    rounded = (mag_c + 0x7FFFF + ((mag_c >> 20) & 1)) >> 20
    normal = tl.minimum(rounded - (120 << 3), 0x7E)
    # subnormal range: code = |y| / 2**-9 rounded; 8 is the smallest normal, 0x08, as it should be
    tiny = tl.minimum(mag_c, 121 << 23).to(tl.float32, bitcast=True)
    sub = _rne(tiny * 512.0).to(tl.int32)
    code = tl.where(mag_c >= (121 << 23), normal, sub) | sign
    return tl.where(is_nan, 0x7F, code)


@triton.jit
def _decode_e4m3(code):
    """e4m3fn code (int32 0..255) -> fp32, exactly."""
    exp = (code >> 3) & 0xF
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    val = tl.where((code & 0x7F) == 0x7F, float("nan"), val)
    # the sign as a bit: Triton lowers -x to 0 - x, which turns -0.0 into +0.0
    return (val.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):
    """2.0**e for integer e in [-127, 127] (2**-127 is an fp32 subnormal)."""
    bits = tl.where(e >= -126, (e + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_f32(ptrs, mask, IN_KIND: tl.constexpr):
    if IN_KIND == 1:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_float(ptrs, v, mask, OUT_KIND: tl.constexpr):
    if OUT_KIND == 1:
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r & 0xFFFF)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptrs, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def _tile(pid, M, K, n_kb, n_blocks, BM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    """Rows, columns and mask of the ``[G, BM*BK]`` tile of program ``pid`` (blocks in row-major order)."""
    blk = pid * G + tl.arange(0, G)
    e = tl.arange(0, BM * BK)
    rows = (blk // n_kb)[:, None] * BM + (e // BK)[None, :]
    cols = (blk % n_kb)[:, None] * BK + (e % BK)[None, :]
    mask = (blk < n_blocks)[:, None] & (rows < M) & (cols < K)
    return blk, rows.to(tl.int64), cols, mask


@triton.jit(do_not_specialize=["M", "K", "n_kb", "n_blocks"])
def _quant_kernel(
    x_ptr, out_ptr, scale_ptr, zp_ptr, M, K, stride_x, stride_o, n_kb, n_blocks,
    BM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, MODE: tl.constexpr, FAKE: tl.constexpr,
    IN_KIND: tl.constexpr, OUT_KIND: tl.constexpr, FLOOR: tl.constexpr,
):
    blk, rows, cols, mask = _tile(tl.program_id(0), M, K, n_kb, n_blocks, BM, BK, G)
    x = _load_f32(x_ptr + rows * stride_x + cols, mask, IN_KIND)
    finite = tl.abs(x) < float("inf")
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
    blk_ok = blk < n_blocks
    out_ptrs = out_ptr + rows * stride_o + cols
    if MODE <= 2:
        if MODE == 2:
            # OCP MX v1.0, 6.3: X = 2**(floor(log2(amax)) - emax_elem), emax_elem = 8 for e4m3
            shared = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 8
            shared = tl.minimum(tl.maximum(shared, -127), 127)
            code = _encode_e4m3(x * _pow2(-shared)[:, None])
            scale = _pow2(shared)
        else:
            scale = tl.math.div_rn(tl.maximum(amax, FLOOR), 448.0)
            if MODE == 1:  # round up to a power of two
                sb = scale.to(tl.int32, bitcast=True)
                sb = ((sb >> 23) + ((sb & 0x7FFFFF) != 0).to(tl.int32)) << 23
                scale = sb.to(tl.float32, bitcast=True)
            code = _encode_e4m3(tl.math.div_rn(x, scale[:, None]))
        if FAKE:
            _store_float(out_ptrs, _decode_e4m3(code) * scale[:, None], mask, OUT_KIND)
        else:
            tl.store(out_ptrs, code.to(tl.uint8), mask=mask)
            if MODE == 2:
                tl.store(scale_ptr + blk, (shared + 127).to(tl.uint8), mask=blk_ok)
            else:
                tl.store(scale_ptr + blk, scale, mask=blk_ok)
    else:
        if MODE == 3:
            scale = tl.math.div_rn(tl.maximum(amax, FLOOR), 7.0)
            q_lo = tl.zeros_like(scale) - 7.0
            q_hi = tl.zeros_like(scale) + 7.0
        else:
            lo = tl.minimum(tl.min(tl.where(finite, x, 0.0), axis=1), 0.0)
            hi = tl.maximum(tl.max(tl.where(finite, x, 0.0), axis=1), 0.0)
            scale = tl.math.div_rn(tl.maximum(hi - lo, FLOOR), 15.0)
            zp = _rne(tl.minimum(tl.math.div_rn(-lo, scale), 15.0))
            q_lo = -zp
            q_hi = 15.0 - zp
        v = tl.math.div_rn(x, scale[:, None])
        clamped = tl.minimum(tl.maximum(v, q_lo[:, None]), q_hi[:, None])
        r = _rne(tl.where(v != v, v, clamped))
        r = tl.where(r == 0, 0.0, r)  # one zero: -0.0 would differ in bits between backends
        if FAKE:
            _store_float(out_ptrs, r * scale[:, None], mask, OUT_KIND)
        else:
            code = (r - q_lo[:, None]).to(tl.int32)
            if MODE == 3:
                code = code + 1  # symmetric codes are offset binary: q + 8, so -7..7 -> 1..15
            tl.store(out_ptrs, code.to(tl.uint8), mask=mask)
            tl.store(scale_ptr + blk, scale, mask=blk_ok)
            if MODE == 4:
                tl.store(zp_ptr + blk, zp.to(tl.int32).to(tl.uint8), mask=blk_ok)


@triton.jit(do_not_specialize=["M", "K", "n_kb", "n_blocks"])
def _dequant_kernel(
    q_ptr, scale_ptr, zp_ptr, out_ptr, M, K, stride_q, stride_o, n_kb, n_blocks,
    BM: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, MODE: tl.constexpr, OUT_KIND: tl.constexpr,
):
    blk, rows, cols, mask = _tile(tl.program_id(0), M, K, n_kb, n_blocks, BM, BK, G)
    code = tl.load(q_ptr + rows * stride_q + cols, mask=mask, other=0).to(tl.int32)
    blk_ok = blk < n_blocks
    if MODE <= 1:
        y = _decode_e4m3(code) * tl.load(scale_ptr + blk, mask=blk_ok, other=1.0)[:, None]
    elif MODE == 2:
        byte = tl.load(scale_ptr + blk, mask=blk_ok, other=127).to(tl.int32)
        scale = tl.where(byte == 255, float("nan"), _pow2(byte - 127))
        y = _decode_e4m3(code) * scale[:, None]
    else:
        scale = tl.load(scale_ptr + blk, mask=blk_ok, other=1.0)
        if MODE == 3:
            zp = tl.zeros_like(blk) + 8
        else:
            zp = tl.load(zp_ptr + blk, mask=blk_ok, other=0).to(tl.int32)
        y = (code - zp[:, None]).to(tl.float32) * scale[:, None]
    _store_float(out_ptr + rows * stride_o + cols, y, mask, OUT_KIND)


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, R, K, KP, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = i // KP
    col = 2 * (i % KP)
    lo = tl.load(codes_ptr + row * K + col, mask=ok, other=0).to(tl.int32)
    hi = tl.load(codes_ptr + row * K + col + 1, mask=ok & (col + 1 < K), other=0).to(tl.int32)
    tl.store(out_ptr + i, (lo | (hi << 4)).to(tl.uint8), mask=ok)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, R, K, KP, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = i // K
    col = i % K
    byte = tl.load(packed_ptr + row * KP + col // 2, mask=ok, other=0).to(tl.int32)
    tl.store(out_ptr + i, ((byte >> (4 * (col % 2))) & 0xF).to(tl.uint8), mask=ok)


def _tiling(n_blocks: int, block_elems: int) -> tuple[int, int, int]:
    """(blocks per program, programs, warps). The interpreter wants big tiles (its cost is per
    program); a GPU wants ~8K-element tiles, and a ``G`` that depends only on the block shape, so
    that each block shape compiles once."""
    if interpreter_on():
        g = 1
        while g * block_elems < (1 << 20) and g < n_blocks:
            g *= 2
        return g, ceil_div(n_blocks, g), 4
    g = max(1, 8192 // block_elems)
    return g, ceil_div(n_blocks, g), 8 if g * block_elems >= 8192 else 4


def _on(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _float_arg(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def quant(x: torch.Tensor, bm: int, bk: int, mode: str, fake: bool, out_dtype: torch.dtype | None = None):
    """Block quantization of ``x`` ``[M, K]`` (unit last stride) with ``bm x bk`` blocks.

    fake: returns ``dequant(quant(x))`` ``[M, K]`` in ``out_dtype``. Otherwise returns
    ``(codes [M, K] uint8, scale [Mb, Kb], zero_point [Mb, Kb] uint8 or None)``; the scale is fp32,
    or uint8 E8M0 for mode ``mx``.
    """
    M, K = x.shape
    n_mb, n_kb = ceil_div(M, bm), ceil_div(K, bk)
    n_blocks = n_mb * n_kb
    code = MODES[mode]
    if fake:
        out = torch.empty(M, K, dtype=out_dtype or x.dtype, device=x.device)
        scale = zp = out
    else:
        out = torch.empty(M, K, dtype=torch.uint8, device=x.device)
        scale = torch.empty(n_mb, n_kb, dtype=torch.uint8 if mode == "mx" else torch.float32, device=x.device)
        zp = torch.empty(n_mb, n_kb, dtype=torch.uint8, device=x.device) if mode == "int4_asym" else scale
    g, programs, warps = _tiling(n_blocks, bm * bk)
    with _on(x):
        _quant_kernel[(programs,)](
            _float_arg(x), _float_arg(out), scale, zp, M, K, x.stride(0), out.stride(0), n_kb, n_blocks,
            BM=bm, BK=bk, G=g, MODE=code, FAKE=fake, IN_KIND=KINDS[x.dtype], OUT_KIND=KINDS.get(out.dtype, 0),
            FLOOR=AMAX_FLOOR, num_warps=warps, **LAUNCH,
        )
    if fake:
        return out
    return out, scale, (zp if mode == "int4_asym" else None)


def dequant(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, bm: int, bk: int, mode: str,
            out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quant`: codes ``[M, K]`` + per-block scale (and zero point) -> ``[M, K]`` floats."""
    M, K = q.shape
    n_mb, n_kb = ceil_div(M, bm), ceil_div(K, bk)
    out = torch.empty(M, K, dtype=out_dtype, device=q.device)
    g, programs, warps = _tiling(n_mb * n_kb, bm * bk)
    with _on(q):
        _dequant_kernel[(programs,)](
            q, scale.contiguous(), scale if zp is None else zp.contiguous(), _float_arg(out), M, K, q.stride(0),
            out.stride(0), n_kb, n_mb * n_kb, BM=bm, BK=bk, G=g, MODE=MODES[mode], OUT_KIND=KINDS[out_dtype],
            num_warps=warps, **LAUNCH,
        )
    return out


def _elementwise_block(n: int) -> int:
    return min(1 << 20 if interpreter_on() else 4096, triton.next_power_of_2(n))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` uint8 codes -> ``[R, ceil(K/2)]`` bytes (element 2j in the low nibble)."""
    R, K = codes.shape
    KP = ceil_div(K, 2)
    out = torch.empty(R, KP, dtype=torch.uint8, device=codes.device)
    block = _elementwise_block(R * KP)
    with _on(codes):
        _pack_kernel[(ceil_div(R * KP, block),)](codes, out, R, K, KP, R * KP, BLOCK=block, **LAUNCH)
    return out


def unpack_int4(packed: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of `pack_int4`: ``[R, ceil(K/2)]`` bytes -> ``[R, K]`` uint8 codes."""
    R, KP = packed.shape
    out = torch.empty(R, K, dtype=torch.uint8, device=packed.device)
    block = _elementwise_block(R * K)
    with _on(packed):
        _unpack_kernel[(ceil_div(R * K, block),)](packed, out, R, K, KP, R * K, BLOCK=block, **LAUNCH)
    return out
