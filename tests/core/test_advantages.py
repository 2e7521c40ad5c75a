"""Advantage estimators: hand-computed cases, boundary cases, properties, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    outcome_token_rewards,
    reverse_discounted_cumsum,
    rloo_advantages,
)
from tandem.core.kl import KLConfig
from tandem.core.masked import NonFiniteError, masked_whiten
from tests.core import oracle
from tests.core.batches import make_batch, right_padded_mask

SETTINGS = settings(max_examples=40, deadline=None)


def _adv(batch, **cfg):
    out, metrics = compute_advantages(batch, AdvantageConfig(**cfg))
    return out.advantages, out, metrics


# -- GRPO family ----------------------------------------------------------------------------------


def test_grpo_hand_computed_unbiased_and_biased_std():
    rewards = torch.tensor([1.0, 2.0, 3.0])
    groups = torch.tensor([0, 0, 0])
    # mean 2, Bessel std 1 -> (-1, 0, 1)
    assert grpo_advantages(rewards, groups, eps=0.0).tolist() == [-1.0, 0.0, 1.0]
    # population std sqrt(2/3)
    biased = grpo_advantages(rewards, groups, eps=0.0, unbiased=False)
    assert torch.allclose(biased, torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2 / 3))
    # eps enters the denominator: (r - mean) / (std + eps)
    assert grpo_advantages(rewards, groups, eps=1.0).tolist() == [-0.5, 0.0, 0.5]


def test_grpo_all_equal_rewards_and_single_sample_groups_give_zero():
    rewards = torch.tensor([0.7, 0.7, 0.7, 5.0, -2.0])
    groups = torch.tensor([1, 1, 1, 2, 3])  # a group of equal rewards, then two lone samples
    adv = grpo_advantages(rewards, groups)
    assert adv.tolist() == [0.0] * 5


def test_grpo_groups_need_not_be_contiguous_sorted_or_equal():
    rewards = torch.tensor([1.0, 10.0, 3.0, 20.0, 2.0])
    groups = torch.tensor([42, 7, 42, 7, 42])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    expected = oracle.grpo_advantages(rewards.tolist(), groups.tolist(), eps=0.0)
    assert torch.allclose(adv, torch.tensor(expected))
    assert adv[1] == pytest.approx(-1 / math.sqrt(2)) and adv[3] == pytest.approx(1 / math.sqrt(2))


def test_grpo_batch_std_normalisation_uses_the_std_of_all_rewards():
    rewards = torch.tensor([0.0, 2.0, 4.0, 10.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = grpo_advantages(rewards, groups, std_normalization="batch", eps=0.0)
    std = torch.tensor([0.0, 2.0, 4.0, 10.0]).std()
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -3.0, 3.0]) / std)


def test_dr_grpo_only_subtracts_the_group_mean():
    batch = make_batch(torch.ones(3, 2), rewards=[1.0, 2.0, 6.0], group_index=[0, 0, 0])
    adv, _, _ = _adv(batch, estimator="dr_grpo", std_normalization="group")
    assert adv.tolist() == [[-2.0, -2.0], [-1.0, -1.0], [3.0, 3.0]]


def test_gspo_uses_the_grpo_advantage():
    batch = make_batch(torch.ones(4, 3), rewards=[1.0, 0.0, 1.0, 1.0], group_index=[0, 0, 1, 1])
    a_grpo, _, _ = _adv(batch, estimator="grpo")
    a_gspo, _, _ = _adv(batch, estimator="gspo")
    assert torch.equal(a_grpo, a_gspo)


def test_rloo_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 9.0])
    adv = rloo_advantages(rewards, torch.tensor([0, 0, 0, 1]))
    # 1 - mean(2, 3), 2 - mean(1, 3), 3 - mean(1, 2); the lone sample gets 0
    assert torch.allclose(adv, torch.tensor([-1.5, 0.0, 1.5, 0.0]))


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 5), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=40),
    st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]),
)
def test_group_advantages_have_zero_mean_per_group(pairs, estimator):
    groups = torch.tensor([g for g, _ in pairs])
    rewards = torch.tensor([r for _, r in pairs], dtype=torch.float64)
    if estimator == "rloo":
        adv = rloo_advantages(rewards, groups)
    else:
        norm = "group" if estimator == "grpo" else "none"
        adv = grpo_advantages(rewards, groups, std_normalization=norm)
    for g in groups.unique():
        members = adv[groups == g]
        assert abs(float(members.sum())) <= 1e-9 * max(1.0, float(members.abs().max())) * len(members) + 1e-9


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0, 2.0])), min_size=1, max_size=30))
def test_grpo_matches_the_pure_python_oracle(pairs):
    groups = [g for g, _ in pairs]
    rewards = [r for _, r in pairs]
    adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), eps=1e-6)
    assert torch.allclose(
        adv, torch.tensor(oracle.grpo_advantages(rewards, groups, eps=1e-6), dtype=torch.float64)
    )


def test_compute_advantages_broadcasts_over_the_mask_and_keeps_fully_masked_rows_in_the_group():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    batch = make_batch(mask, rewards=[1.0, 2.0, 3.0], group_index=[0, 0, 0])
    adv, new, metrics = _adv(batch, std_eps=0.0)
    # the fully masked third row still counts in the group statistics (mean 2, std 1)
    assert adv.tolist() == [[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert batch.advantages is None and new.returns is None  # input untouched
    assert metrics["adv/mean"] == pytest.approx(-2 / 3) and metrics["adv/max"] == 0.0
    assert metrics["adv/min"] == -1.0 and metrics["adv/num_groups"] == 1.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_zero_std_group_fraction_metric():
    batch = make_batch(torch.ones(4, 2), rewards=[1.0, 1.0, 0.0, 1.0], group_index=[0, 0, 1, 1])
    _, _, metrics = _adv(batch)
    assert metrics["adv/zero_std_group_frac"] == 0.5


# -- token-level estimators -----------------------------------------------------------------------


def test_outcome_reward_sits_on_the_last_trained_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_reverse_discounted_cumsum_by_hand():
    x = torch.tensor([[1.0, 2.0, 4.0]])
    assert reverse_discounted_cumsum(x, 0.5).tolist() == [[1 + 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4, 4.0]]
    assert reverse_discounted_cumsum(x, 1.0).tolist() == [[7.0, 6.0, 4.0]]
    decay = torch.tensor([[0.0, 1.0, 0.5]])
    assert reverse_discounted_cumsum(x, decay).tolist() == [[1.0, 6.0, 4.0]]


def test_reinforce_pp_discounted_returns_skip_masked_tokens():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    rewards = outcome_token_rewards(torch.tensor([1.0]), mask)
    # the env token at t=1 passes through: G_0 = 0 + 0.5 * G_2, G_2 = 1
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0.5, 0.0, 1.0, 0.0]]


def test_reinforce_pp_whitens_returns_over_the_batch():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = make_batch(mask, rewards=[1.0, -1.0], group_index=[0, 1])
    adv, new, metrics = _adv(batch, estimator="reinforce_pp", gamma=0.5)
    returns = torch.tensor([[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]])
    assert torch.allclose(new.returns, returns)
    vals = torch.tensor([0.25, 0.5, 1.0, -0.5, -1.0])
    expected = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)  # unbiased variance, as verl
    assert torch.allclose(adv[mask > 0], expected, atol=1e-6)
    assert adv[1, 2] == 0.0 and metrics["returns/mean"] == pytest.approx(float(vals.mean()))


def test_reinforce_pp_folds_the_kl_into_token_rewards():
    mask = torch.ones(1, 2)
    batch = make_batch(
        mask, rewards=[1.0], group_index=[0], old_log_probs=[[-1.0, -2.0]], ref_log_probs=[[-1.5, -1.0]]
    )
    kl = KLConfig(estimator="k1", placement="reward", coef=0.1)
    out, metrics = compute_advantages(batch, AdvantageConfig(estimator="reinforce_pp", whiten=False), kl=kl)
    # k1 = logp - ref = (0.5, -1.0); token rewards = (-0.05, 1 + 0.1)
    assert torch.allclose(out.returns, torch.tensor([[-0.05 + 1.1, 1.1]]))
    assert metrics["kl/reward_k1_mean"] == pytest.approx(-0.25) and metrics["kl/reward_coef"] == 0.1
    # kl_coef overrides the config's coef (a KL controller's current value)
    out0, _ = compute_advantages(
        batch, AdvantageConfig(estimator="reinforce_pp", whiten=False), kl=kl, kl_coef=0.0
    )
    assert out0.returns.tolist() == [[1.0, 1.0]]


def test_kl_in_reward_also_reaches_outcome_estimators_through_the_score():
    batch = make_batch(
        torch.ones(2, 1), rewards=[1.0, 1.0], group_index=[0, 0], old_log_probs=[[-1.0], [-1.0]],
        ref_log_probs=[[-1.0], [-3.0]],
    )  # fmt: skip
    kl = KLConfig(estimator="k1", placement="reward", coef=0.5)
    out, _ = compute_advantages(batch, AdvantageConfig(estimator="dr_grpo"), kl=kl)
    # scores: 1 - 0 and 1 - 0.5 * 2 = 0 -> centered +-0.5
    assert out.advantages.flatten().tolist() == [0.5, -0.5]


def test_reinforce_pp_baseline_by_hand():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    batch = make_batch(mask, rewards=[1.0, 0.0, 5.0], group_index=[0, 0, 1])
    adv, _, _ = _adv(batch, estimator="reinforce_pp_baseline")
    per_token = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0])  # r - group mean, on each trained token
    expected = (per_token - per_token.mean()) / torch.sqrt(per_token.var() + 1e-8)
    assert torch.allclose(adv[mask > 0], expected, atol=1e-6) and adv[1, 1] == 0.0


def test_per_sample_whitening_equals_token_whitening():
    g = torch.Generator().manual_seed(1)
    mask = right_padded_mask(torch.randint(0, 7, (12,), generator=g), 6)
    batch = make_batch(mask, rewards=torch.randn(12, generator=g), group_index=torch.arange(12) // 3)
    adv, _, _ = _adv(batch, estimator="grpo", whiten=True)
    plain, _, _ = _adv(batch, estimator="grpo")
    assert torch.allclose(adv, masked_whiten(plain, mask), atol=1e-5)


def _gae_loop(rewards, values, mask, gamma, lam):
    """verl's reference recursion (skips mask-0 tokens), one token at a time."""
    b, width = rewards.shape
    adv = torch.zeros(b, width)
    for i in range(b):
        next_value, last = 0.0, 0.0
        for t in reversed(range(width)):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            new_last = delta + gamma * lam * last
            if mask[i, t]:
                next_value, last = float(values[i, t]), float(new_last)
            adv[i, t] = last
    return adv * mask


def test_gae_by_hand():
    values = torch.tensor([[0.5, 0.25, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 2.0]])
    adv, returns = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.5)
    d2 = 2.0 - 1.0
    d1 = 0.9 * 1.0 - 0.25
    d0 = 0.9 * 0.25 - 0.5
    a2, a1 = d2, d1 + 0.45 * d2
    a0 = d0 + 0.45 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(returns, adv + values)


def test_gae_matches_the_token_loop_with_env_tokens_inside():
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    values = torch.randn(6, 9, generator=g)
    rewards = outcome_token_rewards(torch.randn(6, generator=g), mask)
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    assert torch.allclose(adv, _gae_loop(rewards, values, mask, 0.95, 0.9), atol=1e-5)


def test_gae_through_compute_advantages_whitens_and_returns_unwhitened_targets():
    mask = torch.ones(2, 2)
    batch = make_batch(mask, rewards=[1.0, 0.0], group_index=[0, 1], values=[[0.1, 0.2], [0.3, 0.4]])
    out, metrics = compute_advantages(batch, AdvantageConfig(estimator="gae", gamma=1.0, lam=1.0))
    raw, returns = gae_advantages(
        outcome_token_rewards(batch.rewards, mask), batch.values, mask, gamma=1, lam=1
    )
    assert torch.allclose(out.returns, returns) and torch.allclose(out.advantages, masked_whiten(raw, mask))
    assert "returns/mean" in metrics


def test_distillation_advantage_is_the_reverse_kl_reward():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    batch = make_batch(
        mask, old_log_probs=[[-1.0, -2.0, -3.0]], teacher_log_probs=[[-1.5, -1.0, 0.0]], group_index=[0]
    )
    out, _ = compute_advantages(batch, AdvantageConfig(estimator="distill", distill_coef=2.0))
    assert out.advantages.tolist() == [[-1.0, 2.0, 0.0]]  # -2 * (student - teacher), masked


def test_distillation_term_adds_to_grpo():
    mask = torch.ones(2, 1)
    batch = make_batch(
        mask, rewards=[1.0, 0.0], group_index=[0, 0], rollout_log_probs=[[-1.0], [-1.0]],
        teacher_log_probs=[[-0.5], [-2.0]],
    )  # fmt: skip
    out, _ = compute_advantages(batch, AdvantageConfig(estimator="dr_grpo", distill_coef=1.0))
    assert out.advantages.flatten().tolist() == [0.5 + 0.5, -0.5 - 1.0]


def test_registry_declares_each_built_in():
    spec = ADVANTAGE_ESTIMATORS.resolve
    names = ADVANTAGE_ESTIMATORS.names()
    assert names == sorted(
        ["grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "distill"]
    )
    assert [n for n in names if spec(n).uses_groups] == [
        "dr_grpo", "grpo", "gspo", "reinforce_pp_baseline", "rloo"
    ]  # fmt: skip
    assert [n for n in names if spec(n).whiten_by_default] == ["gae", "reinforce_pp", "reinforce_pp_baseline"]
    assert [n for n in names if spec(n).needs_critic] == ["gae"]
    assert [n for n in names if spec(n).needs_teacher or not spec(n).needs_rewards] == ["distill"]


# -- bad input ------------------------------------------------------------------------------------


def test_nonfinite_reward_names_the_tensor_and_index():
    batch = make_batch(torch.ones(3, 2), rewards=[1.0, float("nan"), 0.0], group_index=[0, 0, 0])
    with pytest.raises(NonFiniteError, match=r"rewards holds a non-finite value \(nan\) at index 1"):
        compute_advantages(batch, AdvantageConfig())
    batch = make_batch(torch.ones(2, 2), rewards=[1.0, float("inf")], group_index=[0, 0])
    with pytest.raises(NonFiniteError, match="index 1.*FAILED"):
        compute_advantages(batch, AdvantageConfig())


@pytest.mark.parametrize(
    ("fields", "cfg", "message"),
    [
        ({"rewards": [1.0, 2.0, 3.0], "group_index": [0, 0]}, {}, "rewards has shape"),
        ({"rewards": [1.0, 2.0], "group_index": [0, 0, 0]}, {}, "group_index has shape"),
        ({"rewards": [1.0, 2.0], "group_index": [0, -1]}, {}, r"group_index\[1\] = -1 is negative"),
        ({"rewards": [1.0, 2.0]}, {}, "group_index is None"),
        ({"group_index": [0, 0]}, {}, "batch.rewards is None"),
        ({"rewards": [1.0, 2.0], "group_index": [0, 1]}, {"estimator": "gae"}, "needs batch.values"),
        ({"group_index": [0, 1]}, {"estimator": "distill", "distill_coef": 1.0}, "old_log_probs or"),
        (
            {"group_index": [0, 1], "old_log_probs": [[0.0, 0.0], [0.0, 0.0]]},
            {"estimator": "distill", "distill_coef": 1.0},
            "teacher_log_probs",
        ),
        (
            {"rewards": [1.0, 2.0], "group_index": [0, 1], "values": [[0.0, float("inf")], [0.0, 0.0]]},
            {"estimator": "gae"},
            r"values holds a non-finite value \(inf\) at index \(0, 1\)",
        ),
    ],
)
def test_bad_batches_raise_clear_errors(fields, cfg, message):
    batch = make_batch(torch.ones(2, 2), **fields)
    with pytest.raises(ValueError, match=message):
        compute_advantages(batch, AdvantageConfig(**cfg))


def test_empty_batch_raises():
    with pytest.raises(ValueError, match="empty"):
        grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))


def test_kl_in_reward_without_reference_raises():
    batch = make_batch(torch.ones(1, 1), rewards=[1.0], group_index=[0], old_log_probs=[[-1.0]])
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_advantages(batch, AdvantageConfig(), kl=KLConfig(placement="reward", coef=0.1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"std_eps": -1.0}, "std_eps"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"distill_coef": -1.0}, "distill_coef"),
        ({"estimator": "distill"}, "distill_coef > 0"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdvantageConfig(**kwargs)
