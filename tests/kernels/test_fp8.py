"""FP8 e4m3 block and per-token-group quantization: Triton == reference bit for bit, and the policies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import (
    dequantize_fp8_activation,
    dequantize_fp8_block,
    fake_quantize_fp8_activation,
    fake_quantize_fp8_block,
    quantize_fp8_activation,
    quantize_fp8_block,
)
from tests.kernels.conftest import needs_triton
from tests.kernels.helpers import assert_same_bits, spread, with_specials

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCKS = [(128, 128), (32, 64), (1, 128)]
# (shape, block): exact multiples, ragged in one or both dims, smaller than one block, 1 x 1
CASES = [
    ((1, 1), (128, 128)),
    ((7, 33), (32, 64)),
    ((128, 128), (128, 128)),
    ((200, 300), (128, 128)),
    ((257, 129), (1, 128)),
    ((96, 200), (32, 64)),
]
FLOOR_SCALE = torch.tensor(2.0**-33) / torch.tensor(448.0)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


@needs_triton
@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_quant_triton_matches_reference(device, dtype, scale):
    for i, (shape, block) in enumerate(CASES):
        w = with_specials(spread(shape, dtype, device, seed=i))
        q_ref, s_ref = quantize_fp8_block(w, block, scale, backend="torch")
        q_tri, s_tri = quantize_fp8_block(w, block, scale, backend="triton")
        assert_same_bits(q_ref, q_tri)
        assert_same_bits(s_ref, s_tri)
        deq = dequantize_fp8_block(q_ref, s_ref, block, dtype, backend="torch")
        assert_same_bits(deq, dequantize_fp8_block(q_ref, s_ref, block, dtype, backend="triton"))
        assert_same_bits(deq, fake_quantize_fp8_block(w, block, scale, backend="torch"))
        assert_same_bits(deq, fake_quantize_fp8_block(w, block, scale, backend="triton"))


def _tie_probes() -> torch.Tensor:
    """Every finite e4m3 magnitude, every midpoint between neighbours, and the floats either side."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    probes = torch.cat([values, mids, up, down])
    return torch.cat([probes, -probes])


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_e4m3_rounding_matches_torch_cast_on_every_tie(device, backend):
    probes = _tie_probes()
    cols = 127  # + one anchor column of 448 per row: amax 448 makes the scale exactly 1
    padded = F.pad(probes, (0, -len(probes) % cols)).view(-1, cols)
    rows = torch.cat([torch.full((padded.shape[0], 1), 448.0), padded], dim=1).to(device)
    q, s = quantize_fp8_block(rows, (1, 128), "ue8m0", backend=backend)
    assert torch.equal(s.cpu(), torch.ones_like(s.cpu()))
    expected = rows.cpu().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.cpu(), expected)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hand_computed_codes(device, backend):
    row = [448.0, 1.9375, 2.0**-10, 1.5 * 2.0**-9, -0.0, float("inf"), -float("inf"), float("nan"), 0.3]
    q, s = quantize_fp8_block(torch.tensor([row], device=device), (1, 16), "fp32", backend=backend)
    assert s.item() == 1.0
    # 448 -> 0x7E; 1.9375 rounds up to 2.0 = 0x40 (the mantissa carry); 2**-10 is the tie between 0 and
    # the smallest subnormal -> even = 0; 1.5 * 2**-9 ties between codes 1 and 2 -> 2; -0 -> 0x80;
    # +-Inf saturate; NaN -> 0x7F; 0.3 -> 0.3125 = 0x2A (exponent 5, mantissa 2)
    assert q.cpu().tolist() == [[0x7E, 0x40, 0x00, 0x02, 0x80, 0x7E, 0xFE, 0x7F, 0x2A]]


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_all_zero_block_gets_a_finite_nonzero_scale(device, scale):
    w = torch.zeros(130, 256, device=device)
    w[129, 255] = 3.0  # one non-zero block elsewhere
    q, s = quantize_fp8_block(w, (128, 128), scale)
    floor = FLOOR_SCALE if scale == "fp32" else torch.tensor(2.0**-41)  # 2**-33/448 = 1.14 * 2**-42
    assert s[0, 0].item() == floor.item() and s[0, 1].item() == floor.item() and s[1, 0].item() == floor.item()
    assert s[1, 1].item() == ((torch.tensor(3.0) / 448).item() if scale == "fp32" else 2.0**-7)
    assert int(q[:128].max()) == 0
    deq = dequantize_fp8_block(q, s, (128, 128), torch.float32)
    assert torch.isfinite(deq).all() and deq[129, 255].item() == 3.0 and deq[:128].abs().max() == 0


def test_nan_and_inf_do_not_change_the_scale(device):
    w = spread((64, 64), torch.float32, device)
    w_bad = w.clone()
    w_bad[3, 5], w_bad[10, 20], w_bad[40, 1] = float("nan"), float("inf"), -float("inf")
    q, s = quantize_fp8_block(w, (32, 32))
    q_bad, s_bad = quantize_fp8_block(w_bad, (32, 32))
    assert torch.equal(s, s_bad)
    changed = (q != q_bad).nonzero().tolist()
    assert sorted(changed) == [[3, 5], [10, 20], [40, 1]]
    assert q_bad[3, 5] == 0x7F and q_bad[10, 20] == 0x7E and q_bad[40, 1] == 0xFE
    deq = dequantize_fp8_block(q_bad, s_bad, (32, 32), torch.float32)
    assert torch.isnan(deq[3, 5]) and deq[10, 20] == 448.0 * s_bad[0, 0]
    assert deq[40, 1] == -448.0 * s_bad[1, 0]


def test_subnormal_inputs(device):
    w = torch.full((4, 32), 1e-40, device=device)  # fp32 subnormals only: below the amax floor
    q, s = quantize_fp8_block(w, (4, 32))
    assert s.item() == FLOOR_SCALE.item() and int(q.max()) == 0
    mixed = torch.tensor([[1.0, 1e-40, -1e-40, 2.0**-126]], device=device)
    q, s = quantize_fp8_block(mixed, (1, 4))
    assert q.cpu().tolist() == [[0x7E, 0x00, 0x80, 0x00]]
    bf = torch.tensor([[1e-39, 1.0]], dtype=torch.bfloat16, device=device)  # a bf16 subnormal
    assert_same_bits(fake_quantize_fp8_block(bf, (1, 2), backend="torch"), torch.tensor([[0.0, 1.0]]).to(bf))


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_ragged_blocks_equal_zero_padding(device, scale):
    w = spread((200, 300), torch.float32, device, seed=3)
    q, s = quantize_fp8_block(w, (128, 128), scale)
    assert q.shape == (200, 300) and s.shape == (2, 3)
    q_pad, s_pad = quantize_fp8_block(F.pad(w, (0, 84, 0, 56)), (128, 128), scale)
    assert torch.equal(s, s_pad) and torch.equal(q, q_pad[:200, :300])


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
@pytest.mark.parametrize("block", BLOCKS)
def test_round_trip_within_the_e4m3_bound(device, scale, block):
    w = spread((256, 384), torch.float32, device, seed=5)
    q, s = quantize_fp8_block(w, block, scale)
    deq = dequantize_fp8_block(q, s, block, torch.float32)
    err = (deq - w).abs()
    bound = 2.0**-4 * w.abs() + 2.0**-10 * _expand(s, block, w.shape)
    assert (err <= bound * (1 + 2.0**-20)).all()
    assert err.max() > 0  # the bound is exercised, not vacuous
    rel = (err / w.abs()).nan_to_num()[w.abs() > 448 * 2.0**-6 * _expand(s, block, w.shape)]
    assert rel.max() <= 2.0**-4 * (1 + 2.0**-20) and rel.max() > 2.0**-6


def test_3d_weights_are_quantized_matrix_by_matrix(device):
    experts = spread((3, 200, 64), torch.float32, device, seed=7)  # 200 % 128 != 0: per-matrix path
    aligned = spread((4, 128, 64), torch.float32, device, seed=8)  # one launch over all matrices
    for w in (experts, aligned):
        q, s = quantize_fp8_block(w, (128, 32))
        assert s.shape == (w.shape[0], -(-w.shape[1] // 128), 2)
        for i in range(w.shape[0]):
            q_i, s_i = quantize_fp8_block(w[i], (128, 32))
            assert torch.equal(q[i], q_i) and torch.equal(s[i], s_i)
        deq = dequantize_fp8_block(q, s, (128, 32), torch.float32)
        assert torch.equal(deq, fake_quantize_fp8_block(w, (128, 32)))


@needs_triton
@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_activation_groups(device, scale):
    x = with_specials(spread((3, 5, 300), torch.bfloat16, device, seed=9))
    q, s = quantize_fp8_activation(x, 128, scale, backend="torch")
    assert q.shape == x.shape and s.shape == (3, 5, 3) and s.dtype == torch.float32
    q_rows, s_rows = quantize_fp8_block(x.reshape(15, 300), (1, 128), scale, backend="torch")
    assert torch.equal(q.reshape(15, 300), q_rows) and torch.equal(s.reshape(15, 3), s_rows)
    q_tri, s_tri = quantize_fp8_activation(x, 128, scale, backend="triton")
    assert_same_bits(q, q_tri)
    assert_same_bits(s, s_tri)
    deq = dequantize_fp8_activation(q, s, 128, torch.bfloat16, backend="torch")
    assert_same_bits(deq, dequantize_fp8_activation(q, s, 128, torch.bfloat16, backend="triton"))
    assert_same_bits(deq, fake_quantize_fp8_activation(x, 128, scale, backend="triton"))


def test_bad_inputs_raise_one_clear_error(device):
    w = torch.randn(64, 64, device=device)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        quantize_fp8_block(w.int())
    with pytest.raises(ValueError, match="block_size=\\(96, 128\\)"):
        quantize_fp8_block(w, (96, 128))
    with pytest.raises(ValueError, match="at least 2"):
        quantize_fp8_block(w[0])
    with pytest.raises(ValueError, match="scale='e4m3'"):
        quantize_fp8_block(w, scale="e4m3")
    q, s = quantize_fp8_block(w, (32, 32))
    with pytest.raises(ValueError, match="scale has shape \\(2, 2\\).*need \\(1, 1\\)"):
        dequantize_fp8_block(q, s, (64, 64))
    with pytest.raises(ValueError, match="backend='cuda'"):
        quantize_fp8_block(w, backend="cuda")
