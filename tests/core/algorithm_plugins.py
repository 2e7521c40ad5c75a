"""A user's advantage estimators and policy loss, outside `tandem`, selected in a recipe by import path.

This is what docs/algorithms.md ("Adding an estimator or a loss") shows: a function, its own settings
dataclass, and a spec naming both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.advantages import (
    AdvantageConfig,
    AdvantageEstimatorSpec,
    AdvantageInputs,
    discounted_returns,
    grpo_advantages,
)
from tandem.core.losses import PolicyLossConfig, PolicyLossSpec

# -- an outcome estimator with settings: clipped, scaled group-mean baseline ----------------------


@dataclass(kw_only=True, slots=True)
class ClippedBaselineConfig:
    scale: float = 1.0  # multiplies r - mean_G
    clip: float | None = None  # |A| cap; None: no cap

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError(f"scale={self.scale} must be > 0")


def clipped_baseline(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    """``clamp(scale * (r_i - mean_G), +-clip)`` per sample ``[B]``."""
    opts: ClippedBaselineConfig = cfg.options
    adv = opts.scale * grpo_advantages(x.scores, x.group_index, std_normalization="none")
    return (adv if opts.clip is None else adv.clamp(-opts.clip, opts.clip)), None


CLIPPED_BASELINE = AdvantageEstimatorSpec(fn=clipped_baseline, config=ClippedBaselineConfig, uses_groups=True)

# -- a token-level estimator without settings that needs a critic: A_t = G_t - V_t ----------------


def value_baseline(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo return minus the critic's value, ``[B, R]``; the returns are the critic's targets."""
    returns = discounted_returns(x.token_rewards(), x.mask, cfg.gamma)
    return (returns - x.batch.values) * x.mask, returns


VALUE_BASELINE = AdvantageEstimatorSpec(fn=value_baseline, needs_critic=True)

# -- a policy loss with settings: importance-weighted PG plus a quadratic trust-region penalty ------


@dataclass(kw_only=True, slots=True)
class SquaredPenaltyConfig:
    beta: float = 0.1  # weight of (log pi - log pi_old)^2 / 2
    flag_above: float = 0.5  # the stat "far": |log pi - log pi_old| above this


def squared_penalty_per_token(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-A exp(log r) + beta / 2 (log r)^2`` per token ``[b, R]``; stat ``far`` is logged as ``loss/far_frac``."""
    opts: SquaredPenaltyConfig = cfg.options
    log_ratio = log_probs - old_log_probs
    loss = -advantages * torch.exp(log_ratio) + 0.5 * opts.beta * log_ratio.square()
    return loss, {"far": log_ratio.detach().abs() > opts.flag_above}


SQUARED_PENALTY = PolicyLossSpec(fn=squared_penalty_per_token, config=SquaredPenaltyConfig)

# -- mistakes the config layer must name --------------------------------------------------------


def plain_estimator(x: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, None]:
    return x.scores, None  # a bare function, not a spec


BAD_ARITY = AdvantageEstimatorSpec(fn=lambda x: (x.scores, None))  # type: ignore[arg-type]
BAD_CONFIG = PolicyLossSpec(fn=squared_penalty_per_token, config=dict)  # not a dataclass
WRONG_SHAPE = AdvantageEstimatorSpec(fn=lambda x, cfg: (x.scores[:, None], None))
