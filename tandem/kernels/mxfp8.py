"""MXFP8 (OCP Microscaling Formats v1.0): e4m3 elements sharing one E8M0 scale per 32 elements.

Blocks run along the last dimension (``K``, the reduction dimension of a GEMM), as MX GEMMs need.
Scale rule, OCP MX spec v1.0 section 6.3 ("Conversion from vector of FP32 to MX"):

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem        (emax_elem = 8 for e4m3: 448 = 1.75 * 2**8)
    X = 2**shared_exp, stored as the E8M0 byte shared_exp + 127 (clamped to [-127, 127])
    P_i = e4m3(V_i / X), normal values beyond 448 clamped to +-448 (the spec's saturating conversion)

``floor(log2(amax))`` is read from the fp32 exponent bits, so it is exact. Because the floor leaves
``amax / X`` in ``[256, 512)``, elements above ``448 X`` clip; that is the spec's behaviour.

Policy (the same in the reference and the Triton kernel):

* All-zero block: ``shared_exp = -127`` (byte 0, ``X = 2**-127``), every element +-0. Blocks of fp32
  subnormals also get byte 0, and dequantize to fp32 subnormals (a GPU that flushes subnormals to
  zero would differ there; `bench/gpu/kernels_gpu.py` runs that edge case on the device).
* NaN/Inf do not enter ``amax``; NaN encodes as 0x7F, +-Inf saturates to +-448 X. (The spec also
  allows a NaN scale, byte 0xFF; we never write it, and dequantize a read 0xFF as NaN.)
* A last dimension that is not a multiple of 32: the last block is ragged.

Round-trip bound per element: ``|v - deq| <= 2**-4 |v| + 2**-10 X`` when ``|v| <= 448 X``; above it the
error is ``|v| - 448 X < |v| / 7`` (the clipping above).
"""

from __future__ import annotations

import torch

from tandem.kernels._backend import Backend, as_rows, ceil_div, check_codes, check_float, check_out_dtype
from tandem.kernels.config import MX_BLOCK
from tandem.kernels.fp8 import impl_for

__all__ = ["dequantize_mxfp8", "fake_quantize_mxfp8", "quantize_mxfp8"]


@torch.no_grad()
def quantize_mxfp8(x: torch.Tensor, *, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` float -> (e4m3 bytes ``[..., K]`` uint8, E8M0 scale bytes ``[..., ceil(K/32)]`` uint8).

    View the scales as ``torch.float8_e8m0fnu`` if a consumer wants that dtype."""
    check_float(x, "x")
    codes, scales, _ = impl_for(x, backend).quant(as_rows(x), 1, MX_BLOCK, "mx", False)
    return codes.view(x.shape), scales.view(*x.shape[:-1], -1)


@torch.no_grad()
def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     *, backend: Backend = "auto") -> torch.Tensor:
    """Inverse of `quantize_mxfp8`: ``e4m3(q) * 2**(scale - 127)`` in ``dtype``."""
    check_codes(q, "q")
    check_out_dtype(dtype)
    expected = (*q.shape[:-1], ceil_div(q.shape[-1], MX_BLOCK))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales has shape {tuple(scales.shape)}; codes {tuple(q.shape)} need {expected}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"scales has dtype {scales.dtype}; expected uint8 (E8M0 bytes) or float8_e8m0fnu")
    codes = as_rows(q.view(torch.uint8))
    scale_rows = scales.view(torch.uint8).reshape(codes.shape[0], -1).contiguous()
    return impl_for(q, backend).dequant(codes, scale_rows, None, 1, MX_BLOCK, "mx", dtype).view(q.shape)


@torch.no_grad()
def fake_quantize_mxfp8(x: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``dequantize_mxfp8(*quantize_mxfp8(x))`` in ``x.dtype``, fused; the same bits."""
    check_float(x, "x")
    return impl_for(x, backend).quant(as_rows(x), 1, MX_BLOCK, "mx", True).view(x.shape)
