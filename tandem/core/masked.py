"""Shared helpers of the RL math: masked reductions, group statistics and input checks.

Shapes: ``B`` samples, ``R`` response tokens. Per-token tensors are ``[B, R]`` in response space with a
float mask ``[B, R]`` (1 = a trained token); per-sample tensors are ``[B]``. Groups are given by an int64
``group_index`` ``[B]`` whose values need not be contiguous, sorted or equally sized: every group
statistic goes through ``torch.unique`` + ``index_add_``, never a Python loop over samples or groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "GroupLayout",
    "NonFiniteError",
    "check_finite",
    "check_same_shape",
    "group_layout",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "metrics_to_floats",
    "raise_first_nonfinite",
]


class NonFiniteError(ValueError):
    """A NaN or Inf in an input tensor; the message names the tensor, the first index and the value."""


# -- input checks ---------------------------------------------------------------------------------


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming both tensors and shapes unless all given tensors share one shape.

    ``None`` entries are skipped, so optional batch fields can be passed as they are.
    """
    items = [(name, t) for name, t in tensors.items() if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {name} has shape {tuple(t.shape)} but {first_name} has shape "
                f"{tuple(first.shape)}"
            )


def _first_nonfinite(name: str, t: torch.Tensor) -> NonFiniteError | None:
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0].tolist())
    value = float(t[index].item()) if index else float(t.item())
    where = f"index {index[0] if len(index) == 1 else index}" if index else "its only element"
    return NonFiniteError(
        f"{name} holds a non-finite value ({value}) at {where} (shape {tuple(t.shape)}); "
        f"{int(bad.sum())} non-finite entries in total"
    )


def check_finite(tensors: Mapping[str, torch.Tensor | None]) -> None:
    """Raise `NonFiniteError` naming the first tensor (and its first index) that holds NaN or Inf.

    Fast path: one reduction per tensor and a single device sync. A NaN or Inf anywhere makes the sum
    non-finite; only then (or on an overflowing sum) is the exact, slower element check run.
    """
    items = [(n, t) for n, t in tensors.items() if t is not None and t.is_floating_point() and t.numel()]
    if not items:
        return
    sums = torch.stack([t.detach().sum().float().to(items[0][1].device) for _, t in items])
    if bool(torch.isfinite(sums).all()):
        return
    raise_first_nonfinite(dict(items))


def raise_first_nonfinite(tensors: Mapping[str, torch.Tensor | None]) -> None:
    """The exact (slow) check behind `check_finite`: raise for the first non-finite element, if any."""
    for name, t in tensors.items():
        if t is None or not t.is_floating_point():
            continue
        err = _first_nonfinite(name, t.detach())
        if err is not None:
            raise err


# -- masked reductions ----------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when ``None``). ``x``, ``mask``: ``[B, R]``."""
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the mask; 0 where the mask is empty (never NaN). ``x``, ``mask``: ``[B, R]``."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked elements (scalar). Bessel-corrected when ``unbiased``."""
    count = mask.sum()
    mean = masked_sum(x, mask) / count.clamp(min=1)
    sq = masked_sum((x - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked elements of the whole batch, zero off the mask.

    The statistics are taken over every masked token of ``[B, R]`` (batch-level whitening, as in
    verl's ``masked_whiten``: unbiased variance, ``eps = 1e-8``). ``shift_mean=False`` keeps the mean.
    """
    count = mask.sum()
    mean = masked_sum(x, mask) / count.clamp(min=1)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


# -- groups ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Dense group ids of a batch. ``dense`` ``[B]`` int64 in ``[0, G)``; ``counts`` ``[G]`` int64."""

    dense: torch.Tensor
    counts: torch.Tensor
    ids: torch.Tensor  # [G] the original group_index value of each dense id

    @property
    def num_groups(self) -> int:
        return int(self.counts.numel())

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group sum of ``x`` ``[B]`` -> ``[G]``."""
        out = torch.zeros(self.num_groups, dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.dense, x)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group mean of ``x`` ``[B]`` -> ``[G]``."""
        return self.sum(x) / self.counts.to(x.dtype)

    def std(self, x: torch.Tensor, *, unbiased: bool) -> torch.Tensor:
        """Per-group standard deviation ``[G]``; 0 for a group too small to have one (1 sample, Bessel)."""
        centered = x - self.mean(x)[self.dense]
        ss = self.sum(centered * centered)
        denom = (self.counts - 1 if unbiased else self.counts).to(x.dtype)
        var = torch.where(denom > 0, ss / denom.clamp(min=1), torch.zeros_like(ss))
        return var.sqrt()

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group ``max - min`` of ``x`` ``[B]`` -> ``[G]`` (exactly 0 when all members are equal)."""
        hi = torch.full((self.num_groups,), -torch.inf, dtype=x.dtype, device=x.device)
        lo = torch.full((self.num_groups,), torch.inf, dtype=x.dtype, device=x.device)
        hi = hi.scatter_reduce(0, self.dense, x, reduce="amax")
        lo = lo.scatter_reduce(0, self.dense, x, reduce="amin")
        return hi - lo


def group_layout(group_index: torch.Tensor | None, *, name: str = "group_index") -> GroupLayout:
    """Map an arbitrary int64 ``group_index`` ``[B]`` to dense ids (vectorized, via ``torch.unique``).

    Raises ``ValueError`` when it is missing, not 1-D, empty (an empty group has no statistics) or holds
    a negative id (``Sample.group_index`` defaults to -1: the sample was never assigned to a group).
    """
    if group_index is None:
        raise ValueError(f"{name} is None: group-based estimators need the group of every sample")
    if group_index.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(group_index.shape)}")
    if group_index.numel() == 0:
        raise ValueError(f"{name} is empty: a batch must hold at least one sample (an empty group)")
    if group_index.is_floating_point():
        raise ValueError(f"{name} must hold integers, got dtype {group_index.dtype}")
    if bool((group_index < 0).any()):
        first = int((group_index < 0).nonzero()[0, 0])
        raise ValueError(
            f"{name}[{first}] = {int(group_index[first])} is negative: every sample needs a group id >= 0"
        )
    ids, dense, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    return GroupLayout(dense=dense, counts=counts, ids=ids)


def metrics_to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert a dict of scalar tensors / floats to plain floats with one device sync."""
    keys = list(metrics)
    tensors = [metrics[k] for k in keys if isinstance(metrics[k], torch.Tensor)]
    values = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist() if tensors else [])
    return {k: (next(values) if isinstance(metrics[k], torch.Tensor) else float(metrics[k])) for k in keys}
