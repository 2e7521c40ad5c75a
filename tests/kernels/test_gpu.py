"""GPU only: the CPU reference and the CUDA Triton kernel agree bit for bit (trainer and engine may run
on different devices), and ``backend="auto"`` picks Triton for CUDA tensors. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import (
    dequantize_fp8_block,
    fake_quantize_fp8_activation,
    fake_quantize_fp8_block,
    fake_quantize_int4,
    fake_quantize_mxfp8,
    pack_int4,
    quantize_fp8_block,
    quantize_int4,
    quantize_mxfp8,
)
from tandem.kernels._backend import use_triton
from tests.kernels.conftest import needs_triton
from tests.kernels.helpers import assert_same_bits, spread, with_specials

pytestmark = [pytest.mark.gpu, needs_triton]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_reference_equals_cuda_triton(dtype):
    for i, shape in enumerate([(7, 33), (300, 520), (1024, 4096)]):
        x = with_specials(spread(shape, dtype, "cpu", seed=i))
        xc = x.cuda()
        finite = torch.where(torch.isnan(x), 0.5, x)
        ops = [
            lambda t, b: quantize_fp8_block(t, (128, 128), "fp32", backend=b),
            lambda t, b: quantize_fp8_block(t, (128, 128), "ue8m0", backend=b),
            lambda t, b: fake_quantize_fp8_block(t, (128, 128), backend=b),
            lambda t, b: fake_quantize_fp8_activation(t, 128, backend=b),
            lambda t, b: quantize_mxfp8(t, backend=b),
            lambda t, b: fake_quantize_mxfp8(t, backend=b),
            lambda t, b: fake_quantize_int4(t, 128, True, backend=b),
            lambda t, b: fake_quantize_int4(t, 64, False, backend=b),
        ]
        for op in ops:
            ref, tri = op(x, "torch"), op(xc, "triton")
            for a, b in zip(ref if isinstance(ref, tuple) else (ref,), tri if isinstance(tri, tuple) else (tri,),
                            strict=True):
                assert_same_bits(a, b)
        for symmetric in (True, False):
            ref = quantize_int4(finite, 32, symmetric, backend="torch")
            tri = quantize_int4(finite.cuda(), 32, symmetric, backend="triton")
            for a, b in zip(ref, tri, strict=True):
                assert_same_bits(a, b)
            assert_same_bits(pack_int4(ref[0], backend="torch"), pack_int4(tri[0], backend="triton"))
        q, s = quantize_fp8_block(x, (128, 128), backend="torch")
        assert_same_bits(
            dequantize_fp8_block(q, s, (128, 128), dtype, backend="torch"),
            dequantize_fp8_block(q.cuda(), s.cuda(), (128, 128), dtype, backend="triton"),
        )


def test_auto_backend_uses_triton_on_cuda():
    assert use_triton(torch.zeros(1, device="cuda"), "auto")
    assert not use_triton(torch.zeros(1), "auto")
