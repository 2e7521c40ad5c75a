"""Issue 23, correctness: numbers that were silently wrong (value clip fraction, sequence-level IS weights)."""

from __future__ import annotations

import math

import torch

from tandem.core.losses import ValueLossConfig, build_value_loss_fn, loss_scale_from_masks
from tandem.core.offpolicy import OffPolicyConfig, compute_offpolicy_weights, offpolicy_weights
from tandem.core.protocols import LogProbOutput
from tests.core.batches import make_batch


def _value_loss_metrics(pred: float, old: float, ret: float, clip: float) -> dict[str, float]:
    batch = make_batch(torch.ones(1, 1), dtype=torch.float32, values=[[old]], returns=[[ret]])
    fn = build_value_loss_fn(ValueLossConfig(clip=clip))
    out = LogProbOutput(log_probs=torch.zeros(1, 1), values=torch.tensor([[pred]], dtype=torch.float32))
    return fn(out, batch, loss_scale_from_masks([batch.loss_mask]))[1]


def test_value_clip_frac_counts_no_unclipped_token():
    # pred - old = 0.4 is inside the band of 0.5, but old + (pred - old) is one ulp off pred in float32,
    # so the old formula saw a "clipped" error larger than the unclipped one: clip_frac 1.0
    assert (torch.tensor(-0.64) + (torch.tensor(-0.24) - torch.tensor(-0.64))).item() != torch.tensor(-0.24).item()
    assert _value_loss_metrics(pred=-0.24, old=-0.64, ret=0.0, clip=0.5)["value/clip_frac"] == 0.0
    # a prediction outside the band whose clipped error is larger is still counted
    assert _value_loss_metrics(pred=2.0, old=0.0, ret=3.0, clip=0.5)["value/clip_frac"] == 1.0


def _seq(log_ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = torch.full((1, len(log_ratios)), -30.0, dtype=torch.float64)
    return rollout + torch.tensor([log_ratios], dtype=torch.float64), rollout, torch.ones_like(rollout)


def test_sequence_level_tis_clamps_the_sum_not_the_terms():
    # log ratios [25, -23]: the sequence ratio is exp(2) = 7.4, capped at 2; clamping each term to +-20
    # first gave exp(0) = 1
    train, rollout, mask = _seq([25.0, -23.0])
    out = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", level="sequence", tis_cap=2.0))
    assert torch.allclose(out.unit_ratio, torch.tensor([[math.exp(2.0)]], dtype=torch.float64))
    assert torch.equal(out.weights, torch.full((1, 2), 2.0, dtype=torch.float64))
    assert out.truncated.all()
    geo = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", level="geometric", tis_cap=2.0))
    assert torch.allclose(geo.unit_ratio, torch.tensor([[math.exp(1.0)]], dtype=torch.float64))


def test_sequence_level_mis_drops_a_sequence_outside_the_band():
    train, rollout, mask = _seq([25.0, -23.0])  # ratio 7.4 > 5
    cfg = OffPolicyConfig(mode="mis", level="sequence", band_low=0.5, band_high=5.0)
    out, metrics = compute_offpolicy_weights(train, rollout, mask, cfg)
    assert not out.keep.any() and torch.all(out.weights == 0)
    assert metrics["offpolicy/truncated_frac"] == 1.0


def test_the_sum_is_still_clamped_and_padding_never_leaks_in():
    train, rollout, mask = _seq([15.0, 15.0, 15.0])  # sum 45: clamped to 20 before exp()
    out = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="mis", level="sequence", band_high=1e30))
    assert torch.allclose(out.unit_ratio, torch.tensor([[math.exp(20.0)]], dtype=torch.float64))
    train[0, 2], mask[0, 2] = float("-inf"), 0.0  # padding with any log-prob stays out of the sum
    out = offpolicy_weights(train, rollout, mask, OffPolicyConfig(mode="tis", level="sequence", tis_cap=1e30))
    assert torch.allclose(out.unit_ratio, torch.tensor([[math.exp(20.0)]], dtype=torch.float64))
    assert torch.isfinite(out.weights).all() and out.weights[0, 2] == 0


def test_veto_sees_log_ratios_below_the_clamp():
    # veto_threshold 1e-10 is log -23.0: a token at -25 must veto even though the clamp is 20
    train, rollout, mask = _seq([0.0, -25.0])
    out = offpolicy_weights(train, rollout, mask, OffPolicyConfig(veto_threshold=1e-10))
    assert out.vetoed.tolist() == [True]
