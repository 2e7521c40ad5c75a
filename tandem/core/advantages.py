"""Advantage estimators, vectorized over samples and groups (no Python loop over either).

Inputs: scalar rewards ``[B]``, ``group_index`` ``[B]`` (samples of one prompt share it), the loss mask
``[B, R]``, and where needed values / log-probs ``[B, R]``. Outputs are per-token ``[B, R]``, zero off
the mask. Estimators (formulas and peer defaults in docs/algorithms.md):

* ``grpo`` / ``gspo``: ``(r - mean_g) / (std_g + eps)`` (DeepSeekMath; GSPO uses the same advantage)
* ``dr_grpo``: ``r - mean_g`` (Dr.GRPO, Liu et al. 2025)
* ``rloo``: ``r - mean of the other members`` (Ahmadian et al. 2024)
* ``reinforce_pp``: discounted token returns, batch-whitened (REINFORCE++, Hu 2025)
* ``reinforce_pp_baseline``: ``r - mean_g`` broadcast to tokens, batch-whitened
* ``gae``: GAE(gamma, lambda) on a critic's values (Schulman et al. 2016); returns = A + V
* ``distill``: zero base advantage; with ``distill_coef`` > 0 every estimator adds the on-policy
  distillation term ``-coef * (log pi_student - log pi_teacher)`` per token

Estimators are registered in ``ADVANTAGE_ESTIMATORS`` as `AdvantageEstimatorSpec`s; a user adds one by
import path (``advantage.estimator: my.module:MY_SPEC``, its settings under ``advantage.options``).

Token-level estimators place the scalar reward on the last trained token of each row. Tokens with mask
0 inside a response (tool output in a multi-turn trajectory) are skipped by the recurrences: they get
no reward, no discount and no value, as in verl's GAE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tandem.core.batch import TrainBatch
from tandem.core.kl import KLConfig, apply_kl_penalty
from tandem.core.masked import (
    NonFiniteError,
    check_finite,
    check_same_shape,
    group_layout,
    masked_mean,
    masked_whiten,
    metrics_to_floats,
)
from tandem.core.registry import SpecRegistry, build_options

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageEstimatorSpec",
    "AdvantageInputs",
    "EstimatorFn",
    "compute_advantages",
    "discounted_returns",
    "gae_advantages",
    "grpo_advantages",
    "outcome_token_rewards",
    "reverse_discounted_cumsum",
    "rloo_advantages",
]


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """How advantages (and returns) are computed from rewards. Defaults match verl's GRPO.

    ``estimator`` is a name registered in ``ADVANTAGE_ESTIMATORS`` or an import path
    ``module.path:NAME`` of an `AdvantageEstimatorSpec`. ``options`` holds that estimator's own settings:
    a mapping in a recipe, checked against the spec's ``config`` dataclass and replaced by an instance of
    it on construction (None for an estimator without settings, as every built-in: their settings are
    the fields below).
    """

    estimator: str = "grpo"
    options: Any = None  # the estimator's own settings (see the class docstring)
    std_normalization: Literal["group", "batch", "none"] = "group"  # grpo / gspo (TRL's scale_rewards)
    std_unbiased: bool = True  # Bessel's correction, as torch.std in verl and TRL's nanstd
    std_eps: float = 1e-6  # verl; TRL uses 1e-4
    gamma: float = 1.0  # discount (reinforce_pp, gae)
    lam: float = 1.0  # GAE lambda (verl default 1.0; the PPO paper used 0.95)
    whiten: bool | None = None  # batch whitening over the mask; None = estimator default
    distill_coef: float = 0.0  # on-policy distillation coefficient

    def __post_init__(self) -> None:
        spec = self.spec  # an unknown name or a bad import path fails here, naming the value
        self.options = build_options(
            spec.config, self.options, owner=f"advantage estimator {self.estimator!r}"
        )
        if self.std_eps < 0:
            raise ValueError(f"std_eps={self.std_eps} must be >= 0")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma={self.gamma} must be in [0, 1]")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam={self.lam} must be in [0, 1]")
        if self.distill_coef < 0:
            raise ValueError(f"distill_coef={self.distill_coef} must be >= 0")
        if spec.needs_teacher and self.distill_coef == 0:
            raise ValueError(
                f"estimator={self.estimator!r} needs distill_coef > 0 (the advantage would be all zero)"
            )

    @property
    def spec(self) -> AdvantageEstimatorSpec:
        """The registered (or imported) estimator named by ``estimator``."""
        return ADVANTAGE_ESTIMATORS.resolve(self.estimator)

    @property
    def whitens(self) -> bool:
        return self.whiten if self.whiten is not None else self.spec.whiten_by_default

    @property
    def uses_groups(self) -> bool:
        return self.spec.uses_groups


# -- building blocks (tensor in, tensor out) ------------------------------------------------------


def grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    *,
    std_normalization: Literal["group", "batch", "none"] = "group",
    unbiased: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantage per sample ``[B]`` from scores ``[B]`` and ``group_index`` ``[B]``.

    A single-sample group gets advantage 0 (its own mean is its baseline); all-equal scores give 0.
    """
    groups = group_layout(group_index)
    x = scores.double()
    centered = x - groups.mean(x)[groups.dense]
    if std_normalization == "group":
        centered = centered / (groups.std(x, unbiased=unbiased)[groups.dense] + eps)
    elif std_normalization == "batch":
        std = x.std(correction=1 if unbiased and x.numel() > 1 else 0)
        centered = centered / (std + eps)
    return centered.to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO advantage ``[B]``: ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean)``; 0 for n = 1."""
    groups = group_layout(group_index)
    x = scores.double()
    n = groups.counts.to(x.dtype)[groups.dense]
    centered = x - groups.mean(x)[groups.dense]
    return torch.where(n > 1, centered * n / (n - 1).clamp(min=1), torch.zeros_like(x)).to(scores.dtype)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards ``[B, R]``: each scalar reward ``[B]`` on its row's last masked token, 0 elsewhere.

    A row without any masked token gets no reward (it is not trained on).
    """
    width = mask.shape[-1]
    positions = torch.arange(1, width + 1, device=mask.device, dtype=torch.long)
    last = ((mask > 0).long() * positions).argmax(-1)  # index of the last masked token
    has_token = mask.sum(-1) > 0
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    out.scatter_(1, last[:, None], (rewards * has_token)[:, None])
    return out


def reverse_discounted_cumsum(x: torch.Tensor, decay: torch.Tensor | float) -> torch.Tensor:
    """``y_t = x_t + decay_t * y_{t+1}`` (``y_R = 0``) along the last axis of ``[B, R]``.

    A linear recurrence: one vectorized step per token (over all samples at once); a plain reverse
    cumsum when the decay is exactly 1.
    """
    if isinstance(decay, float | int):
        if decay == 1:
            return x.flip(-1).cumsum(-1).flip(-1)
        decay = torch.full_like(x, float(decay))
    xt = x.t().contiguous()  # time-major, so each step reads contiguous memory
    dt = decay.to(x.dtype).t().contiguous()
    out = torch.empty_like(xt)
    acc = torch.zeros_like(xt[0])
    for t in range(xt.shape[0] - 1, -1, -1):
        acc = torch.addcmul(xt[t], dt[t], acc)
        out[t] = acc
    return out.t()


def _skip_decay(mask: torch.Tensor, discount: float) -> torch.Tensor | float:
    """Per-token decay: ``discount`` on trained tokens, 1 (pass through) on skipped ones."""
    if discount == 1.0:
        return 1.0
    return torch.where(mask > 0, torch.full_like(mask, discount), torch.ones_like(mask))


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_{t' >= t} gamma^(k) r_t'`` over trained tokens (``k`` counts trained tokens), ``[B, R]``."""
    return reverse_discounted_cumsum(token_rewards * mask, _skip_decay(mask, gamma)) * mask


def _next_trained_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``V`` at the next trained token after each position ``[B, R]`` (0 after the last one)."""
    b, width = mask.shape
    positions = torch.arange(width, device=mask.device).expand(b, width)
    trained_pos = torch.where(mask > 0, positions, torch.full_like(positions, width))
    following = torch.cat([trained_pos[:, 1:], torch.full_like(trained_pos[:, :1], width)], dim=1)
    next_idx = following.flip(-1).cummin(-1).values.flip(-1)
    padded = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)
    return padded.gather(1, next_idx)


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``. Returns ``(A, A + V)``.

    All ``[B, R]``; ``next`` is the next trained token (skipping mask-0 tokens), 0 past the last one.
    """
    delta = (token_rewards + gamma * _next_trained_values(values, mask) - values) * mask
    adv = reverse_discounted_cumsum(delta, _skip_decay(mask, gamma * lam)) * mask
    return adv, (adv + values) * mask


# -- the registry of estimators -------------------------------------------------------------------


@dataclass(slots=True)
class AdvantageInputs:
    """What an estimator reads: ``B`` samples, ``R`` response tokens; the tensors below are float32."""

    scores: torch.Tensor  # [B] rewards minus each sample's summed KL penalty (= rewards without one)
    rewards: torch.Tensor  # [B] scalar rewards (zeros when the spec has needs_rewards=False and none came)
    mask: torch.Tensor  # [B, R] float loss mask (1 = trained token)
    batch: TrainBatch  # the whole batch: values, log-probs, teacher log-probs, ...
    kl_penalty: torch.Tensor | None = None  # [B, R] -coef * KL per token, when the KL is in the reward

    @property
    def group_index(self) -> torch.Tensor | None:
        """``[B]`` int64: samples of one prompt share a value (None when the rollout gave none)."""
        return self.batch.group_index

    def token_rewards(self) -> torch.Tensor:
        """``[B, R]``: the outcome reward on the last trained token, plus the per-token KL penalty."""
        out = outcome_token_rewards(self.rewards, self.mask)
        return out if self.kl_penalty is None else out + self.kl_penalty


# (inputs, cfg) -> (advantages, returns): advantages [B] (one value per sample, broadcast over its
# tokens at the end, which keeps outcome estimators O(B)) or [B, R]; returns [B, R] or None.
EstimatorFn = Callable[[AdvantageInputs, AdvantageConfig], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageEstimatorSpec:
    """An advantage estimator: its function, its own settings class, and what the loop must know of it.

    ``fn(inputs, cfg)`` gets an `AdvantageInputs` and the `AdvantageConfig` (``cfg.options`` is an
    instance of ``config``, built from the recipe's ``advantage.options``; the shared fields ``gamma``,
    ``lam``, ``std_eps`` ... are there too) and returns ``(advantages, returns)``: advantages ``[B]`` (one
    per sample, broadcast over its trained tokens) or ``[B, R]`` (zero off the mask), returns ``[B, R]``
    or None. `compute_advantages` then whitens, adds the distillation term and logs metrics.
    """

    fn: EstimatorFn
    config: type | None = None  # dataclass of the estimator's settings (advantage.options); None: none
    uses_groups: bool = False  # compares samples of a group: needs group_index, allows the zero-std filter
    needs_critic: bool = False  # reads batch.values and returns the critic's targets: the loop runs a critic
    whiten_by_default: bool = False  # batch whitening when advantage.whiten is null
    needs_rewards: bool = True  # False: batch.rewards may be None (read as zeros)
    needs_teacher: bool = False  # the advantage is the distillation term alone: distill_coef must be > 0


ADVANTAGE_ESTIMATORS: SpecRegistry[AdvantageEstimatorSpec] = SpecRegistry(
    "advantage estimator", AdvantageEstimatorSpec, required_params=2
)


def _grpo(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    adv = grpo_advantages(
        x.scores, x.group_index, std_normalization=cfg.std_normalization, unbiased=cfg.std_unbiased,
        eps=cfg.std_eps,
    )  # fmt: skip
    return adv, None


def _dr_grpo(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    return grpo_advantages(x.scores, x.group_index, std_normalization="none"), None


def _rloo(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    return rloo_advantages(x.scores, x.group_index), None


def _reinforce_pp(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    returns = discounted_returns(x.token_rewards(), x.mask, cfg.gamma)
    return returns, returns


def _reinforce_pp_baseline(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    return grpo_advantages(x.scores, x.group_index, std_normalization="none"), None


def _gae(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    values = x.batch.values
    if values is None:
        raise ValueError("estimator 'gae' needs batch.values (the critic's values at rollout time), got None")
    check_same_shape(values=values, loss_mask=x.mask)
    check_finite({"values": values})
    return gae_advantages(x.token_rewards(), values.to(x.mask.dtype), x.mask, gamma=cfg.gamma, lam=cfg.lam)


def _distill(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    return torch.zeros_like(x.scores), None


ADVANTAGE_ESTIMATORS.add("grpo", AdvantageEstimatorSpec(fn=_grpo, uses_groups=True))
ADVANTAGE_ESTIMATORS.add("dr_grpo", AdvantageEstimatorSpec(fn=_dr_grpo, uses_groups=True))
ADVANTAGE_ESTIMATORS.add("gspo", AdvantageEstimatorSpec(fn=_grpo, uses_groups=True))
ADVANTAGE_ESTIMATORS.add("rloo", AdvantageEstimatorSpec(fn=_rloo, uses_groups=True))
ADVANTAGE_ESTIMATORS.add("reinforce_pp", AdvantageEstimatorSpec(fn=_reinforce_pp, whiten_by_default=True))
ADVANTAGE_ESTIMATORS.add(
    "reinforce_pp_baseline",
    AdvantageEstimatorSpec(fn=_reinforce_pp_baseline, uses_groups=True, whiten_by_default=True),
)
ADVANTAGE_ESTIMATORS.add("gae", AdvantageEstimatorSpec(fn=_gae, needs_critic=True, whiten_by_default=True))
ADVANTAGE_ESTIMATORS.add(
    "distill", AdvantageEstimatorSpec(fn=_distill, needs_rewards=False, needs_teacher=True)
)


def _sampling_log_probs(batch: TrainBatch, why: str) -> torch.Tensor:
    """The log-probs of the policy that generated the batch: the trainer's old pass, else the rollout's."""
    lp = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs
    if lp is None:
        raise ValueError(f"{why} needs batch.old_log_probs or batch.rollout_log_probs; both are None")
    return lp


def _check_rewards(batch: TrainBatch, cfg: AdvantageConfig, spec: AdvantageEstimatorSpec) -> torch.Tensor:
    b = batch.loss_mask.shape[0]
    rewards = batch.rewards
    if rewards is None:
        if not spec.needs_rewards:
            return torch.zeros(b, dtype=torch.float32, device=batch.loss_mask.device)
        raise ValueError(
            f"batch.rewards is None: estimator {cfg.estimator!r} needs a scalar reward per sample"
        )
    if rewards.shape != (b,):
        raise ValueError(
            f"shape mismatch: rewards has shape {tuple(rewards.shape)} but loss_mask has shape "
            f"{tuple(batch.loss_mask.shape)} (expected rewards [{b}])"
        )
    try:
        check_finite({"rewards": rewards})
    except NonFiniteError as e:
        raise NonFiniteError(
            f"{e}; mark such samples FAILED and drop them first (filters.nonfinite_reward_rows)"
        ) from None
    return rewards


def _check_batch(batch: TrainBatch) -> torch.Tensor:
    mask = batch.loss_mask
    if mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, R], got shape {tuple(mask.shape)}")
    if batch.group_index is not None and batch.group_index.shape != mask.shape[:1]:
        raise ValueError(
            f"shape mismatch: group_index has shape {tuple(batch.group_index.shape)} but loss_mask has "
            f"shape {tuple(mask.shape)}"
        )
    return mask.float()


def compute_advantages(
    batch: TrainBatch, cfg: AdvantageConfig, *, kl: KLConfig | None = None, kl_coef: float | None = None
) -> tuple[TrainBatch, dict[str, float]]:
    """Fill ``advantages`` ``[B, R]`` (and ``returns`` for ``gae`` / ``reinforce_pp``) of a whole batch.

    Uses ``batch.rewards`` ``[B]``, ``group_index`` ``[B]``, ``loss_mask`` ``[B, R]``, ``values`` (gae),
    ``ref_log_probs`` + ``old_log_probs`` / ``rollout_log_probs`` when ``kl.placement == "reward"``, and
    ``teacher_log_probs`` when ``distill_coef > 0``. ``kl_coef`` overrides ``kl.coef`` (the current value
    of a KL controller). Returns the new batch (tensors shared, fields replaced) and metrics.
    """
    spec = cfg.spec
    mask = _check_batch(batch)
    rewards = _check_rewards(batch, cfg, spec).float()
    inputs = AdvantageInputs(scores=rewards, rewards=rewards, mask=mask, batch=batch)
    metrics: dict[str, float] = {}
    coef = float(kl_coef if kl_coef is not None else (kl.coef if kl is not None else 0.0))
    if kl is not None and kl.placement == "reward" and coef > 0:
        policy_lp = _sampling_log_probs(batch, "a KL penalty in the reward")
        if batch.ref_log_probs is None:
            raise ValueError("a KL penalty in the reward needs batch.ref_log_probs, which is None")
        check_finite({"ref_log_probs": batch.ref_log_probs, "log_probs": policy_lp})
        zero = torch.zeros_like(mask)
        penalty, kl_metrics = apply_kl_penalty(
            zero, policy_lp.float(), batch.ref_log_probs.float(), mask, kl, coef
        )
        inputs.kl_penalty = penalty
        inputs.scores = rewards + penalty.sum(-1)
        metrics |= kl_metrics
    adv, returns = spec.fn(inputs, cfg)
    _check_estimate(adv, returns, mask, cfg.estimator, spec)
    tokens_per_row = mask.sum(-1)
    whiten = cfg.whiten if cfg.whiten is not None else spec.whiten_by_default
    if whiten:
        adv = _whiten_per_sample(adv, tokens_per_row) if adv.dim() == 1 else masked_whiten(adv, mask)
    metrics |= _advantage_metrics(adv, tokens_per_row, returns, rewards, mask, batch, spec.uses_groups)
    adv = adv[:, None] * mask if adv.dim() == 1 else adv
    if cfg.distill_coef > 0:
        adv = adv + _distill_term(batch, mask, cfg.distill_coef)
    changes = {"advantages": adv}
    if returns is not None:
        changes["returns"] = returns
    return batch.replace(**changes), metrics


def _check_estimate(
    adv: torch.Tensor,
    returns: torch.Tensor | None,
    mask: torch.Tensor,
    name: str,
    spec: AdvantageEstimatorSpec,
) -> None:
    """An estimator's output has the documented shapes (a plug-in's mistake is named, not broadcast)."""
    b, width = mask.shape
    if not isinstance(adv, torch.Tensor) or tuple(adv.shape) not in ((b,), (b, width)):
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(
            f"advantage estimator {name!r} returned advantages {got}; expected [{b}] or [{b}, {width}]"
        )
    if returns is not None and tuple(returns.shape) != (b, width):
        raise ValueError(
            f"advantage estimator {name!r} returned returns {tuple(returns.shape)}; expected [{b}, {width}]"
        )
    if spec.needs_critic and returns is None:
        raise ValueError(f"advantage estimator {name!r} has needs_critic=True but returned no returns")


def _whiten_per_sample(adv: torch.Tensor, tokens_per_row: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`masked_whiten` of ``adv[:, None] * mask`` computed on ``[B]``: each sample weighs by its tokens."""
    a, n = adv.double(), tokens_per_row.double()
    total = n.sum()
    mean = (a * n).sum() / total.clamp(min=1)
    var = (n * (a - mean) ** 2).sum() / (total - 1).clamp(min=1)
    return ((a - mean) * torch.rsqrt(var + eps)).to(adv.dtype)


def _distill_term(batch: TrainBatch, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """``-coef * (log pi_student - log pi_teacher)`` per token ``[B, R]`` (reverse-KL reward of OPD)."""
    student = _sampling_log_probs(batch, "on-policy distillation")
    teacher = batch.teacher_log_probs
    if teacher is None:
        raise ValueError(
            "on-policy distillation (distill_coef > 0) needs batch.teacher_log_probs, which is None"
        )
    check_same_shape(student_log_probs=student, teacher_log_probs=teacher, loss_mask=mask)
    check_finite({"student_log_probs": student, "teacher_log_probs": teacher})
    return -coef * (student.float() - teacher.float()) * mask


def _advantage_metrics(
    adv, tokens_per_row, returns, rewards, mask, batch: TrainBatch, uses_groups: bool
) -> dict[str, float]:
    """Token-weighted advantage statistics (before the distillation term) and reward statistics."""
    if adv.dim() == 1:  # one value per sample: weigh each by its token count, O(B)
        values, weights = adv.double(), tokens_per_row.double()
    else:
        values, weights = adv.double().flatten(), mask.double().flatten()
    total = weights.sum().clamp(min=1)
    mean = (values * weights).sum() / total
    present = weights > 0
    any_present = bool(present.any())
    big = torch.finfo(values.dtype).max
    m = {
        "adv/mean": mean,
        "adv/std": ((values - mean).square() * weights).sum().div(total).sqrt(),
        "adv/max": torch.where(present, values, -big).max() if any_present else mean * 0,
        "adv/min": torch.where(present, values, big).min() if any_present else mean * 0,
        "adv/reward_mean": rewards.mean(),  # the trained batch's, after filters (``reward/mean``: every sample)
        "adv/reward_std": rewards.std(correction=0),
    }
    if returns is not None:
        m["returns/mean"] = masked_mean(returns, mask)
    if uses_groups:
        groups = group_layout(batch.group_index)
        # the trained batch's groups (``reward/num_groups`` and ``reward/zero_std_group_frac``: every scored group)
        m["adv/zero_std_group_frac"] = (groups.spread(rewards.double()) == 0).double().mean()
        m["adv/num_groups"] = float(groups.num_groups)
    return metrics_to_floats(m)
