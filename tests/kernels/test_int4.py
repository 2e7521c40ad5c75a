"""INT4 per-group quantization and packing: hand-computed cases, Triton == reference, bounds."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import dequantize_int4, fake_quantize_int4, pack_int4, quantize_int4, unpack_int4
from tests.kernels.conftest import needs_triton
from tests.kernels.helpers import assert_same_bits, spread, with_specials

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_symmetric_by_hand(device, backend):
    w = torch.tensor([[7.0, -3.5, 1.0, 0.5], [float("inf"), 1.0, -2.0, 0.5]], device=device)
    codes, scales, zero_points = quantize_int4(w, group_size=4, symmetric=True, backend=backend)
    # row 0: scale 7/7 = 1; -3.5 and 0.5 are ties -> even (-4, 0); codes are q + 8
    # row 1: Inf is left out of amax (2 -> scale 2/7) and saturates to +7; 1 / fl(2/7) = 3.4999998 -> 3
    assert zero_points is None
    assert codes.tolist() == [[15, 4, 9, 8], [15, 11, 1, 10]]
    two_sevenths = (torch.tensor(2.0) / torch.tensor(7.0)).item()
    assert scales.cpu().tolist() == [[1.0], [two_sevenths]]
    fake = fake_quantize_int4(w, 4, True, backend=backend)
    assert fake[0].tolist() == [7.0, -4.0, 1.0, 0.0]
    assert torch.equal(fake[1].cpu(), torch.tensor([7.0, 3.0, -7.0, 2.0]) * torch.tensor(two_sevenths))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_zero(device, backend, symmetric):
    w = torch.tensor([[7.0, -0.2, 0.0, -0.0]], device=device)  # -0.2 rounds to level 0
    fake = fake_quantize_int4(w, 4, symmetric, backend=backend)
    assert fake[0, 0] > 6.9 and fake[0, 1:].view(torch.int32).tolist() == [0, 0, 0]  # +0.0, never -0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_asymmetric_by_hand(device, backend):
    w = torch.tensor([[-1.0, 0.0, 2.0, 3.5], [1.0, 2.0, 3.0, 4.0]], device=device)
    codes, scales, zero_points = quantize_int4(w, group_size=4, symmetric=False, backend=backend)
    s0 = torch.tensor(4.5) / torch.tensor(15.0)  # (hi - lo) / 15 = 0.3
    s1 = torch.tensor(4.0) / torch.tensor(15.0)  # lo = min(1, 0) = 0 keeps zero exact
    assert scales.cpu().flatten().tolist() == [s0.item(), s1.item()]
    # row 0: zero point round(1 / 0.3) = 3; codes round(w / 0.3) + 3 = -3+3, 0+3, 7+3, 12+3
    # row 1: 2 / fl(4/15) = 7.4999995 -> 7 (fl(4/15) is just above 4/15, so no tie)
    assert zero_points.cpu().flatten().tolist() == [3, 0]
    assert codes.tolist() == [[0, 3, 10, 15], [4, 7, 11, 15]]
    deq = dequantize_int4(codes, scales, zero_points, 4, torch.float32, backend=backend)
    assert torch.equal(deq[0].cpu(), torch.tensor([-3.0, 0.0, 7.0, 12.0]) * s0)
    assert torch.equal(deq[1].cpu(), torch.tensor([4.0, 7.0, 11.0, 15.0]) * s1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_group_and_nan_policy(device, symmetric):
    w = torch.zeros(2, 64, device=device)
    w[1, :32] = torch.linspace(-1, 1, 32)
    codes, scales, zero_points = quantize_int4(w, 32, symmetric)
    floor = torch.tensor(2.0**-33) / torch.tensor(7.0 if symmetric else 15.0)
    assert scales[0, 0] == floor.item() and scales[1, 1] == floor.item()
    assert (codes[0] == (8 if symmetric else 0)).all()
    assert torch.equal(dequantize_int4(codes, scales, zero_points, 32, torch.float32)[0], torch.zeros(64))
    w[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_int4(w, 32, symmetric)
    fake = fake_quantize_int4(w, 32, symmetric)
    clean = fake_quantize_int4(torch.where(torch.isnan(w), 0.0, w), 32, symmetric)
    assert torch.isnan(fake[1, 5]) and torch.isnan(fake).sum() == 1
    assert torch.equal(fake[~torch.isnan(w)], clean[~torch.isnan(w)])


@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(device, dtype, symmetric):
    cases = [((1, 1), 32), ((7, 33), 32), ((64, 256), 128), ((3, 5, 100), 64)]
    for i, (shape, group) in enumerate(cases):
        x = with_specials(spread(shape, dtype, device, seed=i))
        finite_or_inf = torch.where(torch.isnan(x), 1.5, x)
        ref = quantize_int4(finite_or_inf, group, symmetric, backend="torch")
        tri = quantize_int4(finite_or_inf, group, symmetric, backend="triton")
        for a, b in zip(ref, tri, strict=True):
            assert_same_bits(a, b)
        deq = dequantize_int4(*ref, group, dtype, backend="torch")
        assert_same_bits(deq, dequantize_int4(*ref, group, dtype, backend="triton"))
        assert_same_bits(deq, fake_quantize_int4(finite_or_inf, group, symmetric, backend="triton"))
        assert_same_bits(
            fake_quantize_int4(x, group, symmetric, backend="torch"),
            fake_quantize_int4(x, group, symmetric, backend="triton"),
        )


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_round_trip_within_half_a_step(device, symmetric, group):
    w = torch.randn(64, 300, device=device) * torch.rand(64, 1, device=device) + 0.3 * (not symmetric)
    codes, scales, zero_points = quantize_int4(w, group, symmetric)
    deq = dequantize_int4(codes, scales, zero_points, group, torch.float32)
    step = scales.repeat_interleave(group, dim=1)[:, :300]
    err = (deq - w).abs()
    assert (err <= step / 2 * (1 + 2.0**-20)).all()
    assert (err / step).max() > 0.45  # the bound is nearly reached, so it is the right one


def test_pack_nibble_order_by_hand(device):
    codes = torch.tensor([[1, 2, 3], [15, 0, 9]], dtype=torch.uint8, device=device)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x03], [0x0F, 0x09]]  # element 2j low nibble, 2j+1 high
    assert torch.equal(unpack_int4(packed, 3), codes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_round_trip(device, backend):
    gen = torch.Generator().manual_seed(4)
    for shape in [(1, 1), (5, 8), (3, 129), (2, 3, 64), (300, 301)]:
        codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8).to(device)
        packed = pack_int4(codes, backend=backend)
        assert packed.shape == (*shape[:-1], -(-shape[-1] // 2))
        assert torch.equal(packed, pack_int4(codes, backend="torch"))
        assert torch.equal(unpack_int4(packed, shape[-1], backend=backend), codes)


def test_bad_inputs(device):
    with pytest.raises(ValueError, match="codes hold 16"):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="k=5 needs 3 packed bytes per row, got 2"):
        unpack_int4(torch.zeros(1, 2, dtype=torch.uint8, device=device), 5)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_int4(torch.randn(4, 96, device=device), 48)
    codes, scales, _ = quantize_int4(torch.randn(4, 96, device=device), 32)
    with pytest.raises(ValueError, match="scale has shape \\(4, 3\\).*need \\(4, 2\\)"):
        dequantize_int4(codes, scales, None, 64)
