"""KL estimators (k1, k2, k3, abs), the reward penalty and their properties."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.kl import KL_ESTIMATORS, KLConfig, KLEstimatorName, apply_kl_penalty, compute_kl, kl_estimate


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", lambda x: x),
        ("k2", lambda x: 0.5 * x * x),
        ("k3", lambda x: math.exp(-x) - 1 + x),
        ("abs", abs),
    ],
)
def test_estimators_by_hand(estimator, expected):
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    out = kl_estimate(log_probs, ref, estimator)
    want = [expected(a - b) for a, b in zip(log_probs[0].tolist(), ref[0].tolist(), strict=True)]
    assert torch.allclose(out[0], torch.tensor(want, dtype=torch.float64))


@settings(max_examples=200, deadline=None)
@given(st.floats(-60, 60, allow_nan=False), st.floats(-60, 60, allow_nan=False))
def test_k3_and_k2_are_never_negative(a, b):
    lp = torch.tensor([a], dtype=torch.float64)
    ref = torch.tensor([b], dtype=torch.float64)
    assert kl_estimate(lp, ref, "k3").item() >= 0
    assert kl_estimate(lp, ref, "k3", clamp=None).item() >= 0
    assert kl_estimate(lp, ref, "k2").item() >= 0


def test_k3_is_clamped_like_verl_low_var_kl():
    lp, ref = torch.tensor([0.0]), torch.tensor([30.0])
    assert kl_estimate(lp, ref, "k3").item() == 10.0  # the value clamp
    assert kl_estimate(lp, ref, "k3", clamp=None).item() == pytest.approx(
        math.exp(20) - 21, rel=1e-5
    )  # log-ratio clamp


def test_k3_is_unbiased_for_the_true_kl():
    # KL(p || q) of two categoricals, estimated by k3 on samples of p
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    k3 = kl_estimate(p.log(), q.log(), "k3", clamp=None)
    assert float((p * k3).sum()) == pytest.approx(exact, rel=1e-12)  # expectation over p, exactly


def test_compute_kl_masks_and_reports():
    lp = torch.tensor([[-1.0, -1.0, 5.0]])
    ref = torch.tensor([[-1.5, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl, metrics = compute_kl(lp, ref, mask, KLConfig(estimator="k1"))
    assert kl.tolist() == [[0.5, -0.5, 0.0]]
    assert metrics["kl/k1_mean"] == 0.0 and metrics["kl/k3_mean"] > 0


def test_apply_kl_penalty_subtracts_coef_times_kl_on_masked_tokens():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-2.0, -2.0, -1.0]])
    out, metrics = apply_kl_penalty(
        rewards, lp, ref, torch.tensor([[1.0, 1.0, 0.0]]), KLConfig(estimator="k1"), 0.1
    )
    assert torch.allclose(out, torch.tensor([[-0.1, 1.0, 0.0]]))
    assert metrics["kl/reward_k1_mean"] == pytest.approx(0.5)


def test_shape_mismatch_and_unknown_estimator():
    with pytest.raises(
        ValueError, match=r"ref_log_probs has shape \(1, 2\) but log_probs has shape \(1, 3\)"
    ):
        kl_estimate(torch.zeros(1, 3), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k9")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"coef": -0.1}, "coef"), ({"clamp": 0.0}, "clamp"), ({"log_ratio_clamp": -1.0}, "log_ratio_clamp")],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KLConfig(**kwargs)


def test_registry_matches_the_config_choices_and_enabled_flag():
    assert set(KL_ESTIMATORS) == set(typing.get_args(KLEstimatorName))
    assert not KLConfig().enabled and KLConfig(coef=0.01).enabled
