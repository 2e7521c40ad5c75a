"""The native block-FP8 dequantization (tandem/ops/csrc/dequant.c) gives the torch reference's bits, and
`tandem.kernels` takes it only where it applies."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import fp8, reference
from tandem.ops import native

needs_native = pytest.mark.skipif(native.load("dequant") is None, reason="no C compiler: the torch reference runs")


def _reference(codes, scale, bm, bk):
    return reference.dequant(codes, scale, None, bm, bk, "fp32", torch.float32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@needs_native
@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((7, 5), (4, 2)),
                                         ((1, 1), (128, 128)), ((64, 96), (1, 32))])
def test_every_code_and_partial_blocks_give_the_reference_bits(shape, block):
    g = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)  # NaN (0x7f, 0xff) and subnormals too
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()), dtype=torch.uint8)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.rand(grid, generator=g) * 1e-2
    scale.view(-1)[0] = 2.0**-130  # a subnormal scale
    got = native.dequant_fp8_block(native.load("dequant"), codes, scale, *block)
    want = _reference(codes, scale, *block)
    assert torch.equal(_bits(got), _bits(want))


@needs_native
def test_the_kernel_module_takes_it_for_float32_and_keeps_the_reference_elsewhere(monkeypatch):
    w = torch.randn(3, 256, 192) * 0.05  # leading dims, rows a multiple of the block
    codes, scale_inv = fp8.quantize_fp8_block(w)
    calls = []
    kernel = native.dequant_fp8_block
    monkeypatch.setattr(native, "dequant_fp8_block", lambda *a: calls.append(1) or kernel(*a))
    got = fp8.dequantize_fp8_block(codes, scale_inv, dtype=torch.float32)
    assert calls == [1]
    monkeypatch.setattr(fp8, "_native_dequant", lambda *a: None)  # the torch reference alone
    want = fp8.dequantize_fp8_block(codes, scale_inv, dtype=torch.float32)
    assert torch.equal(_bits(got), _bits(want))
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(native, "dequant_fp8_block", lambda *a: calls.append(1) or kernel(*a))
    bf16 = fp8.dequantize_fp8_block(codes, scale_inv, dtype=torch.bfloat16)  # not float32: the reference
    ue8m0 = fp8.quantize_fp8_block(w, scale="ue8m0")
    fp8.dequantize_fp8_block(*ue8m0, dtype=torch.float32)  # power-of-two scales: still one multiply
    assert calls == [1] and bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), got, rtol=8e-3, atol=0)


@needs_native
def test_bad_operands_are_refused_with_the_shapes():
    lib = native.load("dequant")
    with pytest.raises(ValueError, match=r"need \(2, 1\)"):
        native.dequant_fp8_block(lib, torch.zeros(200, 100, dtype=torch.uint8), torch.ones(1, 1), 128, 128)
    with pytest.raises(ValueError, match="uint8"):
        native.dequant_fp8_block(lib, torch.zeros(4, 4), torch.ones(1, 1), 128, 128)
