"""Group and sample filters applied between reward and advantages. Each drop carries a counted reason.

Reasons, checked in this order (a sample is counted under the first that applies):

* ``failed``: the sample is FAILED (an error upstream)
* ``aborted_group``: its group holds an ABORTED sample (the group is incomplete), when enabled
* ``nonfinite_reward``: NaN / Inf reward; `filter_samples` marks such a sample FAILED (the policy of
  docs/algorithms.md: a sample whose reward cannot be trusted is excluded, its group keeps the rest)
* ``length``: response shorter than ``min_response_length``, longer than ``max_response_length``, or
  truncated when ``drop_truncated`` (DAPO's overlong filtering); per sample or per group
* ``zero_std_group``: all remaining rewards of the group are equal (DAPO dynamic sampling: no signal)
* ``small_group``: fewer than ``min_group_size`` samples of the group remain

Everything is vectorized over samples and groups (``group_index`` values need not be contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.core.masked import GroupLayout, group_layout
from tandem.core.sample import Sample, SampleStatus

__all__ = [
    "DROP_REASONS",
    "FilterConfig",
    "FilterResult",
    "filter_groups",
    "filter_samples",
    "nonfinite_reward_rows",
]

DROP_REASONS = (
    "kept",
    "failed",
    "aborted_group",
    "nonfinite_reward",
    "length",
    "zero_std_group",
    "small_group",
)
_CODE = {name: i for i, name in enumerate(DROP_REASONS)}


@dataclass(kw_only=True, slots=True)
class FilterConfig:
    """Which samples / groups to drop before computing advantages."""

    drop_zero_std_groups: bool = False  # DAPO dynamic sampling (verl filter_groups, slime dynamic filter)
    zero_std_tol: float = 0.0  # a group counts as zero-std when max - min of its rewards <= tol
    drop_aborted_groups: bool = True
    min_response_length: int = 0
    max_response_length: int | None = None
    drop_truncated: bool = False  # DAPO overlong filtering
    length_scope: Literal["sample", "group"] = "sample"
    min_group_size: int = 1

    def __post_init__(self) -> None:
        if self.zero_std_tol < 0:
            raise ValueError(f"zero_std_tol={self.zero_std_tol} must be >= 0")
        if self.min_response_length < 0:
            raise ValueError(f"min_response_length={self.min_response_length} must be >= 0")
        if self.max_response_length is not None and self.max_response_length < max(
            1, self.min_response_length
        ):
            raise ValueError(
                f"max_response_length={self.max_response_length} must be >= max(1, "
                f"min_response_length={self.min_response_length})"
            )
        if self.min_group_size < 1:
            raise ValueError(f"min_group_size={self.min_group_size} must be >= 1")


@dataclass(frozen=True, slots=True)
class FilterResult:
    """``keep`` ``[B]`` bool and ``reason`` ``[B]`` int64 (an index into `DROP_REASONS`, 0 = kept)."""

    keep: torch.Tensor
    reason: torch.Tensor

    def reason_names(self) -> list[str]:
        return [DROP_REASONS[i] for i in self.reason.tolist()]


def nonfinite_reward_rows(rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: True where the reward ``[B]`` is NaN or +-Inf (mark those samples FAILED, drop them)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    return ~torch.isfinite(rewards)


def _per_group_any(groups: GroupLayout, flags: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: whether any member of each sample's group has ``flags`` ``[B]`` set."""
    return (groups.sum(flags.long()) > 0)[groups.dense]


def _drop(reason: torch.Tensor, where: torch.Tensor, name: str) -> None:
    """Assign ``name`` to samples in ``where`` that are still kept (first reason wins)."""
    reason.masked_fill_(where & (reason == 0), _CODE[name])


def _zero_std(groups: GroupLayout, rewards: torch.Tensor, kept: torch.Tensor, tol: float) -> torch.Tensor:
    x = rewards.double()
    inf = torch.full_like(x, torch.inf)
    hi = torch.full((groups.num_groups,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, groups.dense, torch.where(kept, x, -inf), reduce="amax"
    )
    lo = torch.full((groups.num_groups,), torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, groups.dense, torch.where(kept, x, inf), reduce="amin"
    )
    has_kept = groups.sum(kept.long()) > 0
    return (has_kept & ((hi - lo) <= tol))[groups.dense]


def filter_groups(
    group_index: torch.Tensor,
    cfg: FilterConfig,
    *,
    rewards: torch.Tensor | None = None,
    failed: torch.Tensor | None = None,
    aborted: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    response_lengths: torch.Tensor | None = None,
) -> tuple[FilterResult, dict[str, float]]:
    """Decide per sample whether to keep it. All inputs ``[B]`` (bool flags, float rewards, int lengths).

    Metrics: ``filter/kept``, ``filter/dropped_<reason>`` (sample counts), ``filter/groups_in``,
    ``filter/groups_kept``.
    """
    groups = group_layout(group_index)
    b = group_index.shape[0]
    for name, t in (("rewards", rewards), ("failed", failed), ("aborted", aborted), ("truncated", truncated),
                    ("response_lengths", response_lengths)):  # fmt: skip
        if t is not None and t.shape != (b,):
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(t.shape)} but group_index has shape ({b},)"
            )
    reason = torch.zeros(b, dtype=torch.long, device=group_index.device)
    if failed is not None:
        _drop(reason, failed.bool(), "failed")
    if aborted is not None and cfg.drop_aborted_groups:
        _drop(reason, _per_group_any(groups, aborted.bool() & (reason == 0)), "aborted_group")
    if rewards is not None:
        _drop(reason, nonfinite_reward_rows(rewards), "nonfinite_reward")
    _apply_length_filter(reason, groups, cfg, truncated, response_lengths)
    if cfg.drop_zero_std_groups:
        if rewards is None:
            raise ValueError("drop_zero_std_groups needs rewards")
        _drop(reason, _zero_std(groups, rewards, reason == 0, cfg.zero_std_tol), "zero_std_group")
    if cfg.min_group_size > 1:
        remaining = groups.sum((reason == 0).long())[groups.dense]
        _drop(reason, remaining < cfg.min_group_size, "small_group")
    keep = reason == 0
    counts = torch.bincount(reason, minlength=len(DROP_REASONS)).tolist()
    metrics = {"filter/kept": float(counts[0])}
    metrics |= {f"filter/dropped_{name}": float(counts[i]) for i, name in enumerate(DROP_REASONS) if i}
    metrics["filter/groups_in"] = float(groups.num_groups)
    metrics["filter/groups_kept"] = float(int((groups.sum(keep.long()) > 0).sum()))
    return FilterResult(keep=keep, reason=reason), metrics


def _apply_length_filter(reason, groups: GroupLayout, cfg: FilterConfig, truncated, response_lengths) -> None:
    bad = torch.zeros_like(reason, dtype=torch.bool)
    if cfg.min_response_length > 0 or cfg.max_response_length is not None:
        if response_lengths is None:
            raise ValueError("min/max_response_length filters need response_lengths")
        bad |= response_lengths < cfg.min_response_length
        if cfg.max_response_length is not None:
            bad |= response_lengths > cfg.max_response_length
    if cfg.drop_truncated:
        if truncated is None:
            raise ValueError("drop_truncated needs the truncated flags")
        bad |= truncated.bool()
    if cfg.length_scope == "group":
        bad = _per_group_any(groups, bad & (reason == 0))
    _drop(reason, bad, "length")


def filter_samples(
    samples: Sequence[Sample], cfg: FilterConfig, *, reward_key: str | None = None
) -> tuple[list[Sample], list[tuple[Sample, str]], dict[str, float]]:
    """Apply `filter_groups` to samples. Returns ``(kept, [(dropped, reason)], metrics)``.

    A sample with a non-finite reward is marked ``SampleStatus.FAILED`` (in place) and dropped; a sample
    that is neither FAILED nor ABORTED must have a reward.
    """
    if not samples:
        raise ValueError("filter_samples: got an empty list of samples")
    rewards = []
    for s in samples:
        if s.reward is None and s.status not in (SampleStatus.FAILED, SampleStatus.ABORTED):
            raise ValueError(f"sample {s.index}: reward is not set (status {s.status.value})")
        rewards.append(float("nan") if s.reward is None else s.scalar_reward(reward_key))
    statuses = [s.status for s in samples]
    result, metrics = filter_groups(
        torch.tensor([s.group_index for s in samples], dtype=torch.long),
        cfg,
        rewards=torch.tensor(rewards, dtype=torch.float64),
        failed=torch.tensor([st == SampleStatus.FAILED for st in statuses]),
        aborted=torch.tensor([st == SampleStatus.ABORTED for st in statuses]),
        truncated=torch.tensor([st == SampleStatus.TRUNCATED for st in statuses]),
        response_lengths=torch.tensor([s.response_length for s in samples], dtype=torch.long),
    )
    kept, dropped = [], []
    for s, code in zip(samples, result.reason.tolist(), strict=True):
        if code == 0:
            kept.append(s)
            continue
        if DROP_REASONS[code] == "nonfinite_reward" and s.reward is not None:
            s.status = SampleStatus.FAILED
        dropped.append((s, DROP_REASONS[code]))
    return kept, dropped, metrics
