"""Off-policy corrections for the rollout-vs-trainer mismatch and for stale samples.

The rollout engine samples token ``x_t`` from ``pi_rollout`` (another kernel, precision or an older
weight version); the trainer's log-prob of the same token under the policy it optimizes is
``pi_train`` (the trainer's ``old_log_probs``, or the current log-probs when there is no separate old
pass). The importance ratio ``rho = pi_train / pi_rollout`` is formed at one of three levels:

* ``token``:      ``rho_t = exp(log pi_train(x_t) - log pi_rollout(x_t))``
* ``sequence``:   ``rho = exp(sum_t (...))``, one value per sample, shared by its tokens
* ``geometric``:  ``rho = exp(mean_t (...))``, the per-token geometric mean of the sequence ratio

and turned into a weight per token that multiplies the policy-gradient term of the loss:

* ``tis``    truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
             off-policy RL training"): ``w = clamp(rho, tis_floor, tis_cap)``
* ``mis``    masked IS: ``w = rho`` inside ``[band_low, band_high]``, ``0`` outside (the unit is dropped)
* ``icepop`` IcePop (Ling team, 2025): ``mis`` at token level, default band ``[0.5, 5]``

``veto_threshold`` rejects a whole sample when any of its tokens has ``rho_t`` below it (verl's
rollout-correction veto). All weights are detached: they re-weight gradients, never carry them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.core.batch import TrainBatch
from tandem.core.masked import check_finite, check_same_shape, metrics_to_floats

__all__ = [
    "OffPolicyConfig",
    "OffPolicyWeights",
    "apply_offpolicy_rejection",
    "compute_offpolicy_weights",
    "correction_tensors",
    "offpolicy_weights",
]


@dataclass(kw_only=True, slots=True)
class OffPolicyConfig:
    """Which correction to apply and where. ``mode: none`` still lets the loop log the mismatch metrics."""

    mode: Literal["none", "tis", "mis", "icepop"] = "none"
    level: Literal["token", "sequence", "geometric"] = "token"
    tis_cap: float = 2.0  # upper truncation of the TIS weight (C = 2 in Yao et al. 2025)
    tis_floor: float = 0.0  # lower truncation of the TIS weight
    band_low: float = 0.5  # mis / icepop: keep units with band_low <= rho <= band_high
    band_high: float = 5.0
    veto_threshold: float | None = None  # reject a sample if any token has rho_t < this (e.g. 1e-4)
    log_ratio_clamp: float = 20.0  # clamp of the log ratio before exp()

    def __post_init__(self) -> None:
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap={self.tis_cap} must be > 0")
        if not 0 <= self.tis_floor < self.tis_cap:
            raise ValueError(f"tis_floor={self.tis_floor} must be in [0, tis_cap={self.tis_cap})")
        if not 0 <= self.band_low < self.band_high:
            raise ValueError(f"band_low={self.band_low} must be >= 0 and below band_high={self.band_high}")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            raise ValueError(f"veto_threshold={self.veto_threshold} must be in (0, 1) (or null)")
        if self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp} must be > 0")
        if self.mode == "icepop" and self.level != "token":
            raise ValueError(f"mode='icepop' is token-level by definition; got level={self.level!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none" or self.veto_threshold is not None


@dataclass(frozen=True, slots=True)
class OffPolicyWeights:
    """``weights`` ``[B, R]`` (detached, 0 off the mask and on rejected units); ``keep`` ``[B, R]`` bool.

    ``unit_ratio`` / ``unit_weights`` are ``rho`` and the weight per unit: ``[B, R]`` at token level,
    ``[B, 1]`` at the sequence levels; ``truncated`` marks units whose weight differs from ``rho`` (TIS
    truncation, MIS rejection) in the same shape.
    """

    weights: torch.Tensor
    keep: torch.Tensor
    unit_ratio: torch.Tensor
    unit_weights: torch.Tensor
    truncated: torch.Tensor
    vetoed: torch.Tensor  # [B] bool


def offpolicy_weights(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig
) -> OffPolicyWeights:
    """The correction weights for ``[B, R]`` inputs, without metrics.

    Rows are self-contained (a sequence-level ratio only needs its own row), so a micro-batch of whole
    rows gets exactly the weights it would get inside the full batch.
    """
    return OffPolicyWeights(*correction_tensors(train_log_probs, rollout_log_probs, mask, cfg))


def correction_tensors(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig
) -> tuple[torch.Tensor, ...]:
    """`offpolicy_weights` as a plain tuple (the fields of `OffPolicyWeights`, in order), for compiled code."""
    with torch.no_grad():
        # off the mask the log-probs may be anything (padding): zeroed before they are summed
        log_ratio = torch.where(mask > 0, train_log_probs.detach() - rollout_log_probs, 0.0) * mask
        if cfg.level == "token":
            unit_log_ratio = log_ratio
        else:
            # the clamp applies to the unit's log ratio (the sum or mean), never to its terms: clamped
            # terms [25, -23] -> [20, -20] would sum to 0 (ratio 1) instead of 2 (ratio 7.4)
            unit_log_ratio = log_ratio.sum(-1, keepdim=True)
            if cfg.level == "geometric":
                unit_log_ratio = unit_log_ratio / mask.sum(-1, keepdim=True).clamp(min=1)
        ratio = torch.exp(unit_log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
        if cfg.mode == "tis":
            weight = ratio.clamp(cfg.tis_floor, cfg.tis_cap)
            truncated = (ratio > cfg.tis_cap) | (ratio < cfg.tis_floor)
            keep = torch.ones_like(ratio, dtype=torch.bool)
        elif cfg.mode in ("mis", "icepop"):
            keep = (ratio >= cfg.band_low) & (ratio <= cfg.band_high)
            weight = ratio * keep
            truncated = ~keep
        else:
            weight = torch.ones_like(ratio)
            keep = torch.ones_like(ratio, dtype=torch.bool)
            truncated = torch.zeros_like(ratio, dtype=torch.bool)
        if cfg.veto_threshold is not None:
            vetoed = ((log_ratio < math.log(cfg.veto_threshold)) & (mask > 0)).any(-1)
        else:
            vetoed = torch.zeros_like(mask[:, 0], dtype=torch.bool)
        keep = keep & ~vetoed[:, None]
        unit_weights = weight * keep
        return unit_weights * mask, keep.expand_as(mask), ratio, unit_weights, truncated, vetoed


def compute_offpolicy_weights(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig
) -> tuple[OffPolicyWeights, dict[str, float]]:
    """Correction weights plus the per-step mismatch metrics, over a whole batch.

    Inputs ``[B, R]``. Metrics (means over masked tokens unless noted):

    * ``train_rollout_logprob_abs_diff/mean`` and ``/max``: ``|log pi_train - log pi_rollout|``
    * ``offpolicy/k3_kl``: k3 estimate of ``KL(pi_rollout || pi_train)``, i.e. ``rho - 1 - log rho``
    * ``offpolicy/ess``: normalized effective sample size ``(sum w)^2 / (n sum w^2)`` of the final
      weights over the units (tokens, or samples at sequence levels); 1 = no loss of efficiency
    * ``offpolicy/weight_mean``, ``offpolicy/weight_max``, ``offpolicy/ratio_mean`` (per unit)
    * ``offpolicy/truncated_frac`` (TIS-truncated or MIS-rejected units), ``offpolicy/veto_frac``
      (vetoed samples among samples with loss tokens)
    """
    check_same_shape(train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs, loss_mask=mask)
    check_finite({"train_log_probs": train_log_probs, "rollout_log_probs": rollout_log_probs})
    out = offpolicy_weights(train_log_probs, rollout_log_probs, mask, cfg)
    with torch.no_grad():
        diff = (train_log_probs.detach() - rollout_log_probs) * mask
        num_tokens = mask.sum().clamp(min=1)
        rows = mask.sum(-1) > 0
        num_rows = rows.sum().clamp(min=1)
        log_ratio = diff.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        k3 = (torch.expm1(log_ratio) - log_ratio) * mask
        unit_mask = mask if cfg.level == "token" else rows[:, None].to(mask.dtype)
        unit_w = out.unit_weights
        num_units = unit_mask.sum().clamp(min=1)
        sum_w = (unit_w * unit_mask).sum()
        sum_w2 = (unit_w.square() * unit_mask).sum()
        metrics = {
            "train_rollout_logprob_abs_diff/mean": diff.abs().sum() / num_tokens,
            "train_rollout_logprob_abs_diff/max": diff.abs().max() if diff.numel() else diff.sum(),
            "offpolicy/k3_kl": k3.sum() / num_tokens,
            "offpolicy/ess": torch.where(
                sum_w2 > 0, sum_w.square() / (num_units * sum_w2).clamp(min=1e-30), 0.0
            ),
            "offpolicy/weight_mean": sum_w / num_units,
            "offpolicy/weight_max": (unit_w * unit_mask).max() if unit_w.numel() else sum_w,
            "offpolicy/ratio_mean": (out.unit_ratio * unit_mask).sum() / num_units,
            "offpolicy/truncated_frac": (out.truncated * unit_mask).sum() / num_units,
            "offpolicy/veto_frac": (out.vetoed & rows).sum() / num_rows,
        }
    return out, metrics_to_floats(metrics)


def apply_offpolicy_rejection(batch: TrainBatch, cfg: OffPolicyConfig) -> tuple[TrainBatch, dict[str, float]]:
    """Zero the loss mask of rejected units (MIS / IcePop band, veto) before a training step.

    Use it when rejected tokens should also leave the loss denominator (verl's behaviour); the loss
    function then recomputes the same weights per micro-batch, and the rejected tokens are already out
    of the ``LossScale`` the engine derives from ``loss_mask``. Needs ``old_log_probs`` and
    ``rollout_log_probs``. Returns the new batch and the metrics of `compute_offpolicy_weights`.
    """
    if batch.old_log_probs is None or batch.rollout_log_probs is None:
        missing = "old_log_probs" if batch.old_log_probs is None else "rollout_log_probs"
        raise ValueError(f"apply_offpolicy_rejection needs batch.{missing}, which is None")
    out, metrics = compute_offpolicy_weights(
        batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, cfg
    )
    new_mask = batch.loss_mask * out.keep.to(batch.loss_mask.dtype)
    metrics["offpolicy/rejected_tokens"] = float((batch.loss_mask - new_mask).sum())
    return batch.replace(loss_mask=new_mask), metrics
