"""Policy / value losses: hand cases, clip edges, micro-batch exactness, the oracle, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.advantages import AdvantageConfig, compute_advantages
from tandem.core.entropy import compute_entropy, entropy_from_logits, token_log_probs_from_logits
from tandem.core.kl import KLConfig
from tandem.core.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossConfig,
    ValueLossConfig,
    aggregate,
    build_loss_fn,
    build_value_loss_fn,
    loss_scale_from_masks,
    reduce_micro_batch_metrics,
)
from tandem.core.masked import NonFiniteError
from tandem.core.offpolicy import OffPolicyConfig
from tandem.core.protocols import LogProbOutput, LossScale
from tests.core import oracle
from tests.core.batches import make_batch, right_padded_mask

F64 = torch.float64
SETTINGS = settings(max_examples=30, deadline=None)


def _run(cfg, batch, log_probs, *, scale=None, entropy=None, **kw):
    """Loss, metrics and d loss / d log_probs of one call of the policy LossFn."""
    lp = torch.as_tensor(log_probs, dtype=batch.loss_mask.dtype).clone().requires_grad_()
    ent = None if entropy is None else torch.as_tensor(entropy, dtype=lp.dtype).clone().requires_grad_()
    scale = scale or loss_scale_from_masks([batch.loss_mask])
    loss, metrics = build_loss_fn(cfg, **kw)(LogProbOutput(log_probs=lp, entropy=ent), batch, scale)
    loss.backward()
    return loss, metrics, lp.grad, (None if ent is None else ent.grad)


# -- aggregation ----------------------------------------------------------------------------------


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row fully masked
    scale = loss_scale_from_masks([mask], max_response_length=4)
    assert (scale.num_tokens, scale.num_sequences, scale.max_response_length) == (4.0, 2.0, 4)
    assert aggregate(values, mask, "token-mean", scale) == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean", scale) == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum", scale) == pytest.approx(10 / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", scale) == pytest.approx(10 / (2 * 4))
    assert aggregate(values, mask, "seq-mean-token-sum-norm", scale, norm_length=10) == pytest.approx(0.5)
    empty = LossScale(num_tokens=0, num_sequences=0, max_response_length=3)
    assert aggregate(values, torch.zeros_like(mask), "token-mean", empty).item() == 0.0


def test_reduce_micro_batch_metrics_sums_shares_and_maxes_maxima():
    out = reduce_micro_batch_metrics(
        [{"loss/pg": 0.25, "x/max": 3.0, "y/min": 1.0}, {"loss/pg": 0.5, "x/max": 2.0, "y/min": 0.5}]
    )
    assert out == {"loss/pg": 0.75, "x/max": 3.0, "y/min": 0.5}


# -- PPO clip ---------------------------------------------------------------------------------------


def _one_token_rows(ratios, advs, dtype=F64):
    """A batch with one token per row whose ratio exp(logp - old) is as given."""
    old = torch.full((len(ratios), 1), -1.0, dtype=dtype)
    log_probs = old + torch.log(torch.tensor(ratios, dtype=dtype))[:, None]
    batch = make_batch(
        torch.ones(len(ratios), 1), dtype=dtype, advantages=torch.tensor(advs)[:, None], old_log_probs=old
    )
    return batch, log_probs


def test_ppo_clip_by_hand_values_gradients_and_clip_fractions():
    # (ratio, A): clipped above with A > 0; inside; clipped below with A < 0; unclipped big ratio with A < 0
    batch, lp = _one_token_rows([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, metrics, grad, _ = _run(PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2), batch, lp)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4)
    # d/dlogp of -A r is -A r; clipped tokens get 0; token-mean divides by 4
    assert torch.allclose(grad.flatten(), torch.tensor([0.0, -0.5, 0.0, 1.5], dtype=F64) / 4)
    assert metrics["loss/clip_frac"] == 0.5
    assert metrics["loss/clip_frac_high"] == 0.25 and metrics["loss/clip_frac_low"] == 0.25
    assert metrics["loss/pg"] == pytest.approx(loss.item()) and metrics["loss/total"] == metrics["loss/pg"]


def test_ratio_exactly_at_the_clip_edge_is_not_clipped_and_keeps_its_gradient():
    ratio = torch.exp(torch.log(torch.tensor(1.25, dtype=F64))).item()
    low_ratio = torch.exp(torch.log(torch.tensor(0.75, dtype=F64))).item()
    batch, lp = _one_token_rows([ratio, low_ratio], [1.0, -1.0])
    cfg = PolicyLossConfig(clip_eps_low=1 - low_ratio, clip_eps_high=ratio - 1)
    assert 1 + cfg.clip_eps_high == ratio and 1 - cfg.clip_eps_low == low_ratio
    loss, metrics, grad, _ = _run(cfg, batch, lp)
    assert metrics["loss/clip_frac"] == 0.0
    assert torch.allclose(grad.flatten(), torch.tensor([-ratio, low_ratio], dtype=F64) / 2)
    assert loss.item() == pytest.approx((-ratio + low_ratio) / 2)


def test_asymmetric_clip_higher():
    batch, lp = _one_token_rows([1.25], [1.0])
    _, m_sym, g_sym, _ = _run(PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2), batch, lp)
    _, m_dapo, g_dapo, _ = _run(PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28), batch, lp)
    assert g_sym.item() == 0.0 and m_sym["loss/clip_frac"] == 1.0
    assert g_dapo.item() == pytest.approx(-1.25) and m_dapo["loss/clip_frac"] == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    batch, lp = _one_token_rows([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, metrics, grad, _ = _run(PolicyLossConfig(dual_clip_c=3.0), batch, lp)
    # A<0, r=5: min(max(5, 1.2), 3) = 3 (zero grad); A<0, r=2: 2 (grad 2); A>0, r=5: clipped at -1.2
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert torch.allclose(grad.flatten(), torch.tensor([0.0, 2.0, 0.0], dtype=F64) / 3)
    assert metrics["loss/dual_clip_frac"] == pytest.approx(1 / 3)


@SETTINGS
@given(
    st.lists(st.tuples(st.floats(-1.5, 1.5), st.floats(-2, 2)), min_size=1, max_size=24),
    st.floats(0.05, 0.5),
    st.floats(0.05, 0.5),
    st.sampled_from([None, 2.0, 3.0]),
)
def test_gradients_are_zero_exactly_where_clipped(pairs, eps_low, eps_high, dual):
    log_ratio = torch.tensor([p[0] for p in pairs], dtype=F64)
    adv = torch.tensor([p[1] for p in pairs], dtype=F64)
    batch = make_batch(
        torch.ones(1, len(pairs)), dtype=F64, advantages=adv[None], old_log_probs=torch.zeros(1, len(pairs))
    )
    cfg = PolicyLossConfig(clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual)
    _, _, grad, _ = _run(cfg, batch, log_ratio[None])
    ratio = log_ratio.exp()
    clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    if dual is not None:
        clipped |= (adv < 0) & (ratio > dual)
    n = len(pairs)
    assert torch.all(grad[0][clipped] == 0)
    assert torch.allclose(grad[0][~clipped], (-adv * ratio / n)[~clipped])


def test_on_policy_without_old_log_probs_uses_the_detached_current_ones():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]], dtype=F64)
    batch = make_batch(mask, dtype=F64, advantages=adv)
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.0]], dtype=F64)
    loss, metrics, grad, _ = _run(PolicyLossConfig(), batch, lp)
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3)  # ratio is exactly 1
    assert torch.allclose(grad, -adv * mask / 3)
    assert metrics["loss/clip_frac"] == 0.0 and metrics["loss/ppo_kl"] == 0.0


# -- GSPO and CISPO ---------------------------------------------------------------------------------


def test_gspo_gradient_equals_the_sequence_level_objective():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=F64)
    old = torch.randn(2, 4, generator=g, dtype=F64) * 0.01 - 1
    lp = old + torch.randn(2, 4, generator=g, dtype=F64) * 0.01
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    batch = make_batch(mask, dtype=F64, advantages=adv[:, None] * mask, old_log_probs=old)
    cfg = PolicyLossConfig(
        loss="gspo", clip_eps_low=0.5, clip_eps_high=0.5, aggregation="seq-mean-token-mean"
    )
    loss, _, grad, _ = _run(cfg, batch, lp)
    # GSPO: -(1/G) sum_i A_i s_i with s_i = exp(mean_t log r_it) (no clipping active here)
    ref_lp = lp.clone().requires_grad_()
    s = torch.exp(((ref_lp - old) * mask).sum(-1) / mask.sum(-1))
    ref_loss = -(adv * s).mean()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item())
    assert torch.allclose(grad, ref_lp.grad)


def test_gspo_clips_whole_sequences():
    mask = torch.ones(2, 2, dtype=F64)
    old = torch.zeros(2, 2, dtype=F64)
    # row 0: log ratios (0.4, 0.0), geometric mean ratio exp(0.2) > 1.1 -> clipped; row 1: inside
    lp = torch.tensor([[0.4, 0.0], [0.05, -0.05]], dtype=F64)
    batch = make_batch(mask, dtype=F64, advantages=torch.ones(2, 2), old_log_probs=old)
    _, metrics, grad, _ = _run(PolicyLossConfig(loss="gspo", clip_eps_low=0.1, clip_eps_high=0.1), batch, lp)
    assert torch.all(grad[0] == 0) and torch.all(grad[1] != 0)
    assert metrics["loss/clip_frac"] == 0.5


def test_cispo_keeps_gradients_of_clipped_tokens():
    batch, lp = _one_token_rows([2.0, 0.5, 1.1], [1.0, -1.0, 1.0])
    cfg = PolicyLossConfig(loss="cispo", clip_eps_low=0.2, clip_eps_high=0.28)
    loss, metrics, grad, _ = _run(cfg, batch, lp)
    weights = torch.tensor([1.28, 0.8, 1.1], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    assert torch.allclose(grad.flatten(), -adv * weights / 3)  # d/dlogp of -sg(w) A logp
    assert loss.item() == pytest.approx(float((-adv * weights * lp.flatten()).mean()))
    assert metrics["loss/clip_frac"] == pytest.approx(2 / 3)


# -- KL, entropy and off-policy terms in the loss -----------------------------------------------------


def test_kl_loss_term_and_its_placement():
    batch, lp = _one_token_rows([1.0, 1.0], [0.0, 0.0])
    batch = batch.replace(ref_log_probs=lp + torch.tensor([[0.5], [-0.5]], dtype=F64))
    kl = KLConfig(estimator="k3", coef=0.1)
    loss, metrics, grad, _ = _run(PolicyLossConfig(), batch, lp, kl=kl)
    k3 = [math.exp(0.5) - 0.5 - 1, math.exp(-0.5) + 0.5 - 1]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert metrics["loss/kl"] == pytest.approx(sum(k3) / 2) and metrics["kl/k3_mean"] == pytest.approx(
        sum(k3) / 2
    )
    # d k3 / d logp = 1 - exp(ref - logp)
    assert torch.allclose(
        grad.flatten(), 0.1 * torch.tensor([1 - math.exp(0.5), 1 - math.exp(-0.5)], dtype=F64) / 2
    )
    reward_kl, _, _, _ = _run(PolicyLossConfig(), batch, lp, kl=KLConfig(placement="reward", coef=0.1))
    assert reward_kl.item() == 0.0  # a KL placed in the reward is not in the loss
    assert _run(PolicyLossConfig(), batch, lp, kl=kl, kl_coef=0.0)[0].item() == 0.0


def test_entropy_bonus_and_metric():
    batch, lp = _one_token_rows([1.0, 1.0], [0.0, 0.0])
    entropy = [[2.0], [4.0]]
    loss, metrics, _, ent_grad = _run(PolicyLossConfig(entropy_coef=0.01), batch, lp, entropy=entropy)
    assert loss.item() == pytest.approx(-0.01 * 3.0) and metrics["loss/entropy"] == pytest.approx(3.0)
    assert torch.allclose(ent_grad, torch.full((2, 1), -0.01 / 2, dtype=F64))
    no_bonus, metrics, _, _ = _run(PolicyLossConfig(), batch, lp, entropy=entropy)
    assert no_bonus.item() == 0.0 and metrics["loss/entropy"] == pytest.approx(3.0)  # metric only


def test_tis_weights_multiply_the_policy_gradient_term():
    batch, lp = _one_token_rows([1.0, 1.0], [1.0, 1.0])
    # rollout probabilities: ratio pi_old / pi_rollout = e^1 (capped at 2) and e^-1
    batch = batch.replace(rollout_log_probs=batch.old_log_probs - torch.tensor([[1.0], [-1.0]], dtype=F64))
    loss, metrics, grad, _ = _run(
        PolicyLossConfig(), batch, lp, off_policy=OffPolicyConfig(mode="tis", tis_cap=2.0)
    )
    w = torch.tensor([2.0, math.exp(-1)], dtype=F64)
    assert loss.item() == pytest.approx(float(-w.sum() / 2))
    assert torch.allclose(grad.flatten(), -w / 2)
    assert metrics["offpolicy/truncated_frac"] == 0.5
    assert metrics["train_rollout_logprob_abs_diff/max"] == pytest.approx(1.0)


# -- micro-batch exactness ---------------------------------------------------------------------------


def _random_batch(seed: int, rows: int, width: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask = right_padded_mask(lengths, width, F64)
    old = -torch.rand(rows, width, generator=g, dtype=F64) * 2
    noise = lambda s: s * torch.randn(rows, width, generator=g, dtype=F64)  # noqa: E731
    batch = make_batch(
        mask, dtype=F64, advantages=torch.randn(rows, 1, generator=g, dtype=F64) * mask, old_log_probs=old,
        ref_log_probs=old + noise(0.2), rollout_log_probs=old + noise(0.3),
    )  # fmt: skip
    return batch, (old + noise(0.3)) * mask, (torch.rand(rows, width, generator=g, dtype=F64) * 3)


@SETTINGS
@given(
    st.integers(0, 10_000),
    st.integers(1, 9),
    st.sampled_from(AGGREGATIONS),
    st.sampled_from(POLICY_LOSSES.names()),
    st.booleans(),
    st.sampled_from(["none", "tis", "mis"]),
    st.data(),
)
def test_micro_batches_with_the_global_scale_sum_to_the_full_batch(
    seed, rows, agg, loss, with_kl, mode, data
):
    batch, log_probs, entropy = _random_batch(seed, rows, 7)
    cuts = sorted(data.draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1)) if rows > 1 else [])
    cfg = PolicyLossConfig(loss=loss, aggregation=agg, entropy_coef=0.01, clip_eps_high=0.28)
    kw = {
        "kl": KLConfig(coef=0.05) if with_kl else None,
        "off_policy": OffPolicyConfig(mode=mode, band_high=1.5),
    }
    scale = loss_scale_from_masks([batch.loss_mask], max_response_length=9)
    full, full_metrics, full_grad, _ = _run(cfg, batch, log_probs, scale=scale, entropy=entropy, **kw)
    parts, grads, metrics = [], [], []
    for idx in zip([0, *cuts], [*cuts, rows], strict=True):
        rows_idx = list(range(*idx))
        part = batch.replace(**{
            f: getattr(batch, f)[rows_idx] for f in ("loss_mask", "advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs")
        })  # fmt: skip
        value, m, grad, _ = _run(cfg, part, log_probs[rows_idx], scale=scale, entropy=entropy[rows_idx], **kw)
        parts.append(value.item())
        grads.append(grad)
        metrics.append(m)
    assert sum(parts) == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-15)
    reduced = reduce_micro_batch_metrics(metrics)
    for key, value in full_metrics.items():
        assert reduced[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


# -- the oracle ------------------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(0, 10_000), st.sampled_from(AGGREGATIONS), st.sampled_from([None, 3.0]))
def test_grpo_plus_ppo_clip_matches_the_pure_python_oracle(seed, agg, dual):
    g = torch.Generator().manual_seed(seed)
    rows, width = 8, 5
    mask = right_padded_mask(torch.randint(1, width + 1, (rows,), generator=g), width, F64)
    rewards = torch.randint(0, 3, (rows,), generator=g).double()
    groups = torch.randperm(rows, generator=g) % 3
    old = -torch.rand(rows, width, generator=g, dtype=F64) * 2
    lp = old + 0.3 * torch.randn(rows, width, generator=g, dtype=F64)
    ref = old + 0.2 * torch.randn(rows, width, generator=g, dtype=F64)
    batch = make_batch(
        mask, dtype=F64, rewards=rewards, group_index=groups, old_log_probs=old, ref_log_probs=ref
    )
    batch, _ = compute_advantages(batch, AdvantageConfig(estimator="grpo", std_eps=1e-6))
    batch = batch.replace(advantages=batch.advantages.double())
    cfg = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=dual, aggregation=agg)
    scale = loss_scale_from_masks([mask], max_response_length=6)
    loss, _, _, _ = _run(cfg, batch, lp, scale=scale, kl=KLConfig(estimator="k3", coef=0.04, clamp=None))
    advs = oracle.grpo_advantages(rewards.tolist(), groups.tolist(), eps=1e-6)
    oracle_rows = [
        {
            "logp": lp[i].tolist(),
            "old": old[i].tolist(),
            "ref": ref[i].tolist(),
            "mask": mask[i].tolist(),
            "adv": advs[i],
        }
        for i in range(rows)
    ]
    expected = oracle.policy_loss(
        oracle_rows,
        aggregation=agg,
        eps_low=0.2,
        eps_high=0.28,
        dual_clip_c=dual,
        kl_coef=0.04,
        norm_length=6,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)  # advantages pass through float32


# -- bad input ---------------------------------------------------------------------------------------


def test_nonfinite_inputs_name_the_tensor_and_first_index():
    batch, lp = _one_token_rows([1.0, 1.0], [1.0, 1.0])
    lp[1, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"log_probs holds a non-finite value \(nan\) at index \(1, 0\)"):
        _run(PolicyLossConfig(), batch, lp)
    batch, lp = _one_token_rows([1.0, 1.0], [1.0, 1.0])
    batch = batch.replace(ref_log_probs=torch.tensor([[0.0], [-float("inf")]], dtype=F64))
    with pytest.raises(NonFiniteError, match=r"ref_log_probs .*\(-inf\) at index \(1, 0\)"):
        _run(PolicyLossConfig(), batch, lp, kl=KLConfig(coef=0.1))


@pytest.mark.parametrize(
    ("change", "kw", "message"),
    [
        (
            {"old_log_probs": torch.zeros(2, 3, dtype=F64)},
            {},
            r"old_log_probs has shape \(2, 3\) but log_probs has shape \(2, 1\)",
        ),
        ({"advantages": None}, {}, "batch.advantages is None"),
        ({}, {"kl": KLConfig(coef=0.1)}, "batch.ref_log_probs is None"),
        ({}, {"off_policy": OffPolicyConfig(mode="tis")}, "batch.rollout_log_probs is None"),
    ],
)
def test_missing_or_mismatched_fields_raise(change, kw, message):
    batch, lp = _one_token_rows([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=message):
        _run(PolicyLossConfig(), batch.replace(**change), lp, **kw)


def test_entropy_bonus_without_entropy_raises():
    batch, lp = _one_token_rows([1.0], [1.0])
    with pytest.raises(ValueError, match="with_entropy=True"):
        _run(PolicyLossConfig(entropy_coef=0.1), batch, lp)


def test_no_loss_tokens_anywhere_gives_zero_loss_and_zero_gradient():
    batch = make_batch(
        torch.zeros(2, 3), dtype=F64, advantages=torch.ones(2, 3), old_log_probs=torch.zeros(2, 3)
    )
    loss, metrics, grad, _ = _run(PolicyLossConfig(), batch, torch.zeros(2, 3, dtype=F64))
    assert loss.item() == 0.0 and torch.all(grad == 0) and metrics["loss/clip_frac"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_eps_low": 1.5}, "clip_eps_low"),
        ({"clip_eps_high": -0.1}, "clip_eps_high"),
        ({"dual_clip_c": 1.0}, "dual_clip_c=1.0 must be > 1"),
        ({"loss": "cispo", "dual_clip_c": 3.0}, "cispo"),
        ({"norm_length": 0}, "norm_length"),
        ({"entropy_coef": -1.0}, "entropy_coef"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_policy_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


def test_registry_holds_the_built_in_losses():
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip"]
    assert [n for n in POLICY_LOSSES.names() if POLICY_LOSSES.resolve(n).dual_clip] == ["gspo", "ppo_clip"]


# -- value loss ---------------------------------------------------------------------------------------


def test_value_loss_by_hand_with_clipping():
    # (pred, old value, return): outside the clip band but closer -> the clipped error wins (zero grad)
    pred = torch.tensor([[2.0], [0.2], [3.0]], dtype=F64, requires_grad=True)
    batch = make_batch(
        torch.ones(3, 1), dtype=F64, values=[[1.0], [1.0], [1.0]], returns=[[0.0], [2.0], [2.5]]
    )
    scale = loss_scale_from_masks([batch.loss_mask])
    fn = build_value_loss_fn(ValueLossConfig(clip=0.5, coef=0.5))
    loss, metrics = fn(LogProbOutput(log_probs=torch.zeros(3, 1, dtype=F64), values=pred), batch, scale)
    loss.backward()
    # errors: max(4, 2.25) = 4; max(3.24, 2.25) = 3.24; max(0.25, 1.0) = 1.0 (clipped)
    assert loss.item() == pytest.approx(0.5 * (4 + 3.24 + 1.0) / 3)
    assert torch.allclose(pred.grad.flatten(), torch.tensor([2.0, -1.8, 0.0], dtype=F64) / 3)
    assert metrics["value/clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="output.values is None"):
        fn(LogProbOutput(log_probs=torch.zeros(3, 1)), batch, scale)


# -- entropy from logits ----------------------------------------------------------------------------------


def test_entropy_and_log_probs_from_logits_chunked_equal_direct():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    direct = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    chunked = entropy_from_logits(logits, chunk_size=4)
    assert torch.allclose(chunked.double(), direct, atol=1e-5)
    (g_direct,) = torch.autograd.grad(direct.sum(), logits)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.allclose(g_chunked.double(), g_direct, atol=1e-5)
    lp = token_log_probs_from_logits(logits, labels, chunk_size=2)
    assert torch.allclose(
        lp.double(), logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1), atol=1e-5
    )
    entropy, metrics = compute_entropy(logits.detach(), torch.ones(3, 5), chunk_size=7)
    assert metrics["entropy/mean"] == pytest.approx(float(direct.detach().mean()), rel=1e-5)
    uniform = entropy_from_logits(torch.zeros(2, 8))
    assert torch.allclose(uniform, torch.full((2,), math.log(8)))
    with pytest.raises(ValueError, match="labels has shape"):
        token_log_probs_from_logits(logits, labels[:, :2])


# -- compiled path -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ci
def test_compiled_loss_equals_eager():
    batch, log_probs, entropy = _random_batch(7, 6, 9)
    batch = batch.replace(**{f: getattr(batch, f).float() for f in ("loss_mask", "advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs")})  # fmt: skip
    kw = {"kl": KLConfig(coef=0.05), "off_policy": OffPolicyConfig(mode="tis")}
    for agg in ("token-mean", "seq-mean-token-mean"):
        eager = _run(PolicyLossConfig(aggregation=agg), batch, log_probs.float(), **kw)
        compiled = _run(PolicyLossConfig(aggregation=agg, compile=True), batch, log_probs.float(), **kw)
        assert compiled[0].item() == pytest.approx(eager[0].item(), rel=1e-5)
        assert torch.allclose(compiled[2], eager[2], rtol=1e-5, atol=1e-7)
        assert compiled[1].keys() == eager[1].keys()
