"""KL divergence estimators between the policy and a reference, as a loss term or folded into the reward.

With samples drawn from the policy ``pi`` and ``log_ratio = log pi(x) - log ref(x)`` per token, the
estimators of ``KL(pi || ref)`` from J. Schulman, "Approximating KL Divergence" (2020) are:

* ``k1 = log_ratio``                                 unbiased, high variance, can be negative
* ``k2 = 0.5 * log_ratio ** 2``                      biased, low variance, >= 0
* ``k3 = exp(-log_ratio) - 1 + log_ratio``           unbiased, low variance, >= 0 (GRPO, DeepSeekMath eq. 4)
* ``abs = |log_ratio|``

``k3`` is computed as verl's ``low_var_kl``: the log ratio is clamped to ``[-log_ratio_clamp,
log_ratio_clamp]`` before the ``exp`` and the result to ``[-clamp, clamp]``, so one token with a
vanishing reference probability cannot blow the loss up. All functions work on ``[B, R]`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from tandem.core.masked import check_same_shape, masked_mean
from tandem.core.schedulers import KLScheduleConfig

__all__ = ["KL_ESTIMATORS", "KLConfig", "KLEstimatorName", "apply_kl_penalty", "compute_kl", "kl_estimate"]

KLEstimatorName = Literal["k1", "k2", "k3", "abs"]


@dataclass(kw_only=True, slots=True)
class KLConfig:
    """KL to the reference policy. ``coef == 0`` (and a schedule that stays at 0) disables it."""

    estimator: KLEstimatorName = "k3"
    placement: Literal["loss", "reward"] = "loss"  # GRPO / TRL: in the loss; PPO / REINFORCE++: reward
    coef: float = 0.0  # the (initial) coefficient beta
    clamp: float | None = 10.0  # k3 value clamp (verl low_var_kl); None disables
    log_ratio_clamp: float = 20.0  # clamp of log pi - log ref before exp()
    schedule: KLScheduleConfig = field(default_factory=KLScheduleConfig)

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"coef={self.coef} must be >= 0")
        if self.clamp is not None and self.clamp <= 0:
            raise ValueError(f"clamp={self.clamp} must be > 0 (or null to disable)")
        if self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp} must be > 0")

    @property
    def enabled(self) -> bool:
        """Whether a reference model is needed at all."""
        return self.coef > 0 or (self.schedule.kind in ("linear", "cosine") and self.schedule.final_coef > 0)


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # exp(-x) - 1 + x >= 0 for every x, with equality only at x = 0; expm1 keeps it accurate near 0.
    return torch.expm1(-log_ratio) + log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3, "abs": _abs}


def kl_estimate(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: KLEstimatorName = "k3",
    *,
    clamp: float | None = 10.0,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, R]`` of ``KL(pi || ref)``; differentiable in ``log_probs``.

    ``log_probs``, ``ref_log_probs``: ``[B, R]``. Padding is not masked here (use the loss mask).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r} (choose one of: {', '.join(KL_ESTIMATORS)})")
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    log_ratio = log_probs - ref_log_probs
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        kl = _k3(log_ratio)
        return kl if clamp is None else kl.clamp(-clamp, clamp)
    return KL_ESTIMATORS[estimator](log_ratio)


def compute_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, cfg: KLConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token KL ``[B, R]`` (zero off the mask) and metrics ``kl/<estimator>_mean`` and ``kl/k3_mean``.

    ``k3_mean`` is always reported so runs with different estimators can be compared on one scale.
    """
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, loss_mask=mask)
    kl = kl_estimate(
        log_probs, ref_log_probs, cfg.estimator, clamp=cfg.clamp, log_ratio_clamp=cfg.log_ratio_clamp
    )
    kl = kl * mask
    with torch.no_grad():
        metrics = {f"kl/{cfg.estimator}_mean": float(masked_mean(kl, mask))}
        if cfg.estimator != "k3":
            k3 = kl_estimate(log_probs.detach(), ref_log_probs, "k3", clamp=cfg.clamp)
            metrics["kl/k3_mean"] = float(masked_mean(k3, mask))
    return kl, metrics


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cfg: KLConfig,
    coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Fold the KL into token rewards: ``r_t - coef * kl_t`` on masked tokens (InstructGPT / verl style).

    ``token_rewards``, ``log_probs`` (the policy that sampled: old or rollout log-probs),
    ``ref_log_probs``, ``mask``: ``[B, R]``. Returns the penalised rewards ``[B, R]`` and metrics
    ``kl/reward_<estimator>_mean`` (mean per-token KL) and ``kl/reward_coef``.
    """
    check_same_shape(
        token_rewards=token_rewards, log_probs=log_probs, ref_log_probs=ref_log_probs, loss_mask=mask
    )
    with torch.no_grad():
        kl = kl_estimate(
            log_probs, ref_log_probs, cfg.estimator, clamp=cfg.clamp, log_ratio_clamp=cfg.log_ratio_clamp
        )
        kl = kl * mask
        metrics = {
            f"kl/reward_{cfg.estimator}_mean": float(masked_mean(kl, mask)),
            "kl/reward_coef": float(coef),
        }
        return token_rewards - coef * kl, metrics
