"""MXFP8 (OCP MX v1.0): the spec's scale rule by hand, Triton == reference, policies and bounds."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8
from tests.kernels.conftest import needs_triton
from tests.kernels.helpers import assert_same_bits, spread, with_specials


def _block(first: float, rest: float = 0.25) -> list[float]:
    return [first] + [rest] * 31


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_scale_rule_by_hand(device, backend):
    rows = torch.tensor(
        [
            _block(1.0, 0.5),  # floor(log2 1) - 8 = -8 -> byte 119; 1 * 2**8 = 256 -> 0x78, 128 -> 0x70
            _block(448.0),  # floor(log2 448) = 8 -> shared 0 -> byte 127; values unchanged
            _block(500.0),  # still shared 0: 500 > 448 clips to 448 (the spec's floor rule)
            _block(1000.0, 2.0),  # floor(log2 1000) = 9 -> byte 128; 1000 / 2 = 500 -> clips
            _block(0.0, 0.0),  # all zero -> shared clamps to -127 -> byte 0
            _block(3e38, 1.0),  # floor(log2 3e38) = 127 -> shared 119 -> byte 246; 1 * 2**-119 -> 0
            _block(2.0**-120, 0.0),  # shared -128 clamps to -127; 2**-120 * 2**127 = 128 -> 0x70
            _block(1e-39, -3e-40),  # fp32 subnormals: byte 0; they dequantize to fp32 subnormals
        ],
        device=device,
    )
    q, s = quantize_mxfp8(rows, backend=backend)
    assert s.cpu().flatten().tolist() == [119, 127, 127, 128, 0, 246, 0, 0]
    assert q[0, :2].tolist() == [0x78, 0x70]
    assert q[1, 0] == 0x7E and q[2, 0] == 0x7E and q[3, 0] == 0x7E and q[3, 1] == 0x38  # 2/2 = 1.0
    assert int(q[4].max()) == 0 and int(q[5, 1]) == 0 and q[6, 0] == 0x70
    deq = dequantize_mxfp8(q, s, torch.float32, backend=backend)
    assert deq[0, 0] == 1.0 and deq[2, 0] == 448.0 and deq[3, 0] == 896.0 and deq[6, 0] == 2.0**-120
    assert deq[4].abs().max() == 0
    # e4m3(1e-39 * 2**127) * 2**-127 is exact in fp32 (a subnormal): a flush-to-zero device would give 0
    for value in (1e-39, -3e-40):
        element = torch.tensor(value * 2.0**127).to(torch.float8_e4m3fn).float().item()
        assert deq[7, 0 if value > 0 else 1].item() == element * 2.0**-127 != 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(device, dtype):
    for i, shape in enumerate([(1, 1), (5, 31), (64, 256), (3, 7, 100)]):
        x = with_specials(spread(shape, dtype, device, seed=i))
        q_ref, s_ref = quantize_mxfp8(x, backend="torch")
        q_tri, s_tri = quantize_mxfp8(x, backend="triton")
        assert q_ref.shape == x.shape and s_ref.shape == (*x.shape[:-1], -(-x.shape[-1] // 32))
        assert_same_bits(q_ref, q_tri)
        assert_same_bits(s_ref, s_tri)
        deq = dequantize_mxfp8(q_ref, s_ref, dtype, backend="torch")
        assert_same_bits(deq, dequantize_mxfp8(q_ref, s_ref, dtype, backend="triton"))
        assert_same_bits(deq, fake_quantize_mxfp8(x, backend="torch"))
        assert_same_bits(deq, fake_quantize_mxfp8(x, backend="triton"))


def test_round_trip_within_the_mx_bound(device):
    x = spread((64, 320), torch.float32, device, seed=11)
    q, s = quantize_mxfp8(x)
    deq = dequantize_mxfp8(q, s, torch.float32)
    scale = torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    err = (deq - x).abs()
    inside = x.abs() <= 448 * scale
    bound = torch.where(inside, 2.0**-4 * x.abs() + 2.0**-10 * scale, x.abs() - 448 * scale)
    assert (err <= bound * (1 + 2.0**-20)).all()
    assert (~inside).any() and (err[~inside] > 0).all()  # clipping happens on real data
    assert (err[~inside] < x.abs()[~inside] / 7).all()


def test_nan_inf_and_ragged_blocks(device):
    x = spread((2, 40), torch.float32, device, seed=12)  # 40 = one full block + a ragged one of 8
    x_bad = x.clone()
    x_bad[0, 3], x_bad[1, 35] = float("nan"), -float("inf")
    q, s = quantize_mxfp8(x)
    q_bad, s_bad = quantize_mxfp8(x_bad)
    assert s.shape == (2, 2) and torch.equal(s, s_bad)
    assert sorted((q != q_bad).nonzero().tolist()) == [[0, 3], [1, 35]]
    assert q_bad[0, 3] == 0x7F and q_bad[1, 35] == 0xFE
    padded = torch.nn.functional.pad(x, (0, 24))
    q_pad, s_pad = quantize_mxfp8(padded)
    assert torch.equal(q, q_pad[:, :40]) and torch.equal(s, s_pad)


def test_nan_scale_byte_dequantizes_to_nan(device):
    q = torch.full((1, 32), 0x38, dtype=torch.uint8, device=device)  # 1.0
    s = torch.tensor([[255]], dtype=torch.uint8, device=device)
    assert torch.isnan(dequantize_mxfp8(q, s, torch.float32)).all()
    one = torch.tensor([[127]], dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)  # 2**0
    assert torch.equal(dequantize_mxfp8(q, one, torch.float32), torch.ones(1, 32, device=device))


def test_bad_inputs(device):
    q, s = quantize_mxfp8(torch.randn(4, 64, device=device))
    with pytest.raises(ValueError, match="scales has shape \\(4, 1\\)"):
        dequantize_mxfp8(q, s[:, :1])
    with pytest.raises(ValueError, match="scales has dtype torch.float32"):
        dequantize_mxfp8(q, s.float())
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        dequantize_mxfp8(q, s, torch.int8)
