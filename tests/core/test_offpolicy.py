"""Off-policy corrections: TIS / MIS / IcePop at token, sequence and geometric level; veto; metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.masked import NonFiniteError
from tandem.core.offpolicy import (
    OffPolicyConfig,
    apply_offpolicy_rejection,
    compute_offpolicy_weights,
    offpolicy_weights,
)
from tests.core.batches import make_batch

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None)
log_ratios = st.lists(st.lists(st.floats(-4, 4), min_size=3, max_size=3), min_size=1, max_size=6)


def _inputs(rows, mask=None):
    log_ratio = torch.tensor(rows, dtype=F64)
    rollout = -torch.ones_like(log_ratio)
    mask = torch.ones_like(log_ratio) if mask is None else torch.as_tensor(mask, dtype=F64)
    return rollout + log_ratio, rollout, mask


@SETTINGS
@given(log_ratios, st.floats(1.0, 5.0), st.sampled_from(["token", "sequence", "geometric"]))
def test_tis_weights_never_exceed_the_cap(rows, cap, level):
    train, rollout, mask = _inputs(rows)
    w = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", tis_cap=cap, level=level)).weights
    assert torch.all(w <= cap) and torch.all(w >= 0)


@SETTINGS
@given(log_ratios, st.floats(0.1, 0.9), st.floats(1.1, 5.0))
def test_mis_masks_exactly_the_tokens_outside_the_band(rows, low, high):
    train, rollout, mask = _inputs(rows)
    out = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="mis", band_low=low, band_high=high))
    ratio = (train - rollout).exp()
    outside = (ratio < low) | (ratio > high)
    assert torch.equal(out.keep, ~outside)
    assert torch.all(out.weights[outside] == 0)
    assert torch.allclose(out.weights[~outside], ratio[~outside])


@SETTINGS
@given(log_ratios, st.floats(0.3, 0.9), st.floats(1.1, 3.0))
def test_sequence_level_mis_drops_whole_samples(rows, low, high):
    train, rollout, mask = _inputs(rows)
    out = offpolicy_weights(
        train, rollout, mask, OffPolicyConfig(mode="mis", level="sequence", band_low=low, band_high=high)
    )
    seq_ratio = (train - rollout).sum(-1).exp()
    inside = (seq_ratio >= low) & (seq_ratio <= high)
    assert torch.equal(out.keep, inside[:, None].expand_as(mask))
    assert torch.allclose(out.weights, seq_ratio[:, None] * inside[:, None] * mask)


def test_levels_by_hand_and_mask_handling():
    train, rollout, mask = _inputs([[0.2, 0.4, 3.0]], mask=[[1.0, 1.0, 0.0]])  # third token is padding
    token = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", tis_cap=10.0)).weights
    seq = offpolicy_weights(
        train, rollout, mask, OffPolicyConfig(mode="tis", level="sequence", tis_cap=10.0)
    ).weights
    geo = offpolicy_weights(
        train, rollout, mask, OffPolicyConfig(mode="tis", level="geometric", tis_cap=10.0)
    ).weights
    assert torch.allclose(token, torch.tensor([[math.exp(0.2), math.exp(0.4), 0.0]], dtype=F64))
    assert torch.allclose(seq, torch.tensor([[math.exp(0.6)] * 2 + [0.0]], dtype=F64))
    assert torch.allclose(geo, torch.tensor([[math.exp(0.3)] * 2 + [0.0]], dtype=F64))


def test_icepop_is_token_level_mis_with_its_band():
    train, rollout, mask = _inputs([[math.log(0.4), 0.0, math.log(6.0)]])
    icepop = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="icepop"))
    assert torch.allclose(icepop.weights, torch.tensor([[0.0, 1.0, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="icepop"):
        OffPolicyConfig(mode="icepop", level="sequence")


def test_veto_rejects_a_sample_with_one_catastrophic_token():
    train, rollout, mask = _inputs([[0.0, math.log(1e-6), 0.0], [0.1, 0.1, 0.1]])
    cfg = OffPolicyConfig(mode="tis", veto_threshold=1e-4)
    out, metrics = compute_offpolicy_weights(train, rollout, mask, cfg)
    assert out.vetoed.tolist() == [True, False]
    assert torch.all(out.weights[0] == 0) and torch.all(out.weights[1] > 0)
    assert metrics["offpolicy/veto_frac"] == 0.5
    # the veto alone (mode none) still enables the correction
    assert OffPolicyConfig(veto_threshold=1e-4).enabled and not OffPolicyConfig().enabled


def test_metrics_by_hand():
    train, rollout, mask = _inputs([[0.0, 0.0, math.log(2.0)]], mask=[[1.0, 1.0, 1.0]])
    _, metrics = compute_offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", tis_cap=5.0))
    # weights 1, 1, 2 -> ESS = 4^2 / (3 * 6)
    assert metrics["offpolicy/ess"] == pytest.approx(16 / 18)
    assert metrics["train_rollout_logprob_abs_diff/mean"] == pytest.approx(math.log(2) / 3)
    assert metrics["train_rollout_logprob_abs_diff/max"] == pytest.approx(math.log(2))
    assert metrics["offpolicy/k3_kl"] == pytest.approx((2 - 1 - math.log(2)) / 3)
    assert metrics["offpolicy/weight_mean"] == pytest.approx(4 / 3) and metrics["offpolicy/weight_max"] == 2.0
    assert metrics["offpolicy/truncated_frac"] == 0.0
    _, capped = compute_offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", tis_cap=1.5))
    assert (
        capped["offpolicy/truncated_frac"] == pytest.approx(1 / 3) and capped["offpolicy/weight_max"] == 1.5
    )


def test_sequence_level_ess_counts_samples():
    train, rollout, mask = _inputs([[0.0, 0.0], [math.log(3.0), 0.0]], mask=[[1.0, 1.0], [1.0, 1.0]])
    _, metrics = compute_offpolicy_weights(
        train, rollout, mask, OffPolicyConfig(mode="tis", level="sequence", tis_cap=5.0)
    )
    assert metrics["offpolicy/ess"] == pytest.approx(16 / (2 * 10))  # weights 1 and 3


def test_apply_offpolicy_rejection_zeroes_the_loss_mask():
    mask = torch.ones(2, 2)
    batch = make_batch(
        mask, old_log_probs=[[0.0, 0.0], [0.0, 0.0]], rollout_log_probs=[[0.0, -3.0], [0.0, 0.0]]
    )
    out, metrics = apply_offpolicy_rejection(batch, OffPolicyConfig(mode="mis", band_low=0.5, band_high=2.0))
    assert out.loss_mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert metrics["offpolicy/rejected_tokens"] == 1.0 and batch.loss_mask.sum() == 4
    with pytest.raises(ValueError, match="old_log_probs"):
        apply_offpolicy_rejection(batch.replace(old_log_probs=None), OffPolicyConfig(mode="mis"))


def test_nonfinite_and_shape_errors():
    train, rollout, mask = _inputs([[0.0, 0.0]])
    rollout[0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"rollout_log_probs .* at index \(0, 1\)"):
        compute_offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis"))
    with pytest.raises(ValueError, match="rollout_log_probs has shape"):
        compute_offpolicy_weights(train, rollout[:, :1], mask, OffPolicyConfig(mode="tis"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"tis_floor": 3.0}, "tis_floor"),
        ({"band_low": 2.0, "band_high": 1.0}, "band_low"),
        ({"veto_threshold": 1.5}, "veto_threshold"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffPolicyConfig(**kwargs)
