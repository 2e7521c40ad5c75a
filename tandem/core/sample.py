"""The `Sample`: the one record that crosses every boundary of the RL loop.

A sample is one trajectory: a prompt and the model's response as token ids (never re-tokenized),
the per-token rollout log-probs, the loss mask (1 = a token the model produced and is trained on,
0 = a token the environment inserted, e.g. a tool result), the reward and bookkeeping.

Token layout (``P`` = prompt length, ``R`` = ``response_length``, ``T = P + R``)::

    tokens             [T]      prompt ids then response ids
    loss_mask          [R]      one entry per response token
    rollout_log_probs  [R]      log-prob of each response token under the rollout policy
    rollout_routed_experts [T-1, layers, topk] int32, MoE routing of each predicted position
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Sample", "SampleStatus", "SampleValidationError"]


class SampleValidationError(ValueError):
    """A sample whose fields disagree (lengths, values). The message names the field and the sizes."""


class SampleStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"  # generation ended on a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens or the context limit
    ABORTED = "aborted"  # aborted by the engine or a timeout; may be resumed or dropped
    FAILED = "failed"  # an error (bad request, reward raised, NaN reward); excluded from training


@dataclass(kw_only=True, slots=True)
class Sample:
    """One trajectory. See the module docstring for the token layout."""

    prompt: str | list[dict[str, Any]] = ""
    response: str = ""  # decoded response text (for rewards and logs; the tokens are the truth)
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: np.ndarray | None = None
    reward: float | dict[str, float] | None = None
    label: Any = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[int] = field(default_factory=list)
    group_index: int = -1
    index: int = -1
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def effective_loss_mask(self) -> list[int]:
        """The loss mask, defaulting to all ones over the response."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * self.response_length

    def scalar_reward(self, key: str | None = None) -> float:
        """The reward as one float; a dict reward needs ``key`` (or holds a ``"score"`` entry)."""
        r = self.reward
        if r is None:
            raise SampleValidationError(f"sample {self.index}: reward is not set")
        if isinstance(r, dict):
            k = key or "score"
            if k not in r:
                raise SampleValidationError(
                    f"sample {self.index}: reward dict has no key {k!r} (keys: {sorted(r)})"
                )
            return float(r[k])
        return float(r)

    def validate(self) -> Sample:
        """Check that the fields agree; raise `SampleValidationError` naming the field otherwise."""
        where = f"sample {self.index}"
        t, r = len(self.tokens), self.response_length
        if r < 0 or r > t:
            raise SampleValidationError(f"{where}: response_length={r} must be in [0, len(tokens)={t}]")
        if self.loss_mask is not None:
            if len(self.loss_mask) != r:
                raise SampleValidationError(
                    f"{where}: len(loss_mask)={len(self.loss_mask)} != response_length={r}"
                )
            bad = [v for v in self.loss_mask if v not in (0, 1)]
            if bad:
                raise SampleValidationError(f"{where}: loss_mask holds {bad[0]!r}; only 0 and 1 are allowed")
        if self.rollout_log_probs is not None:
            if len(self.rollout_log_probs) != r:
                raise SampleValidationError(
                    f"{where}: len(rollout_log_probs)={len(self.rollout_log_probs)} != response_length={r}"
                )
            for i, lp in enumerate(self.rollout_log_probs):
                if math.isnan(lp) or lp > 0:
                    raise SampleValidationError(
                        f"{where}: rollout_log_probs[{i}]={lp} is not a log-probability (must be <= 0, not NaN)"
                    )
        if self.rollout_routed_experts is not None:
            e = self.rollout_routed_experts
            if e.ndim != 3 or e.shape[0] != max(t - 1, 0):
                raise SampleValidationError(
                    f"{where}: rollout_routed_experts has shape {tuple(e.shape)}; expected [T-1={t - 1}, layers, topk]"
                )
        if any(not isinstance(x, int | np.integer) or x < 0 for x in self.tokens):
            raise SampleValidationError(f"{where}: tokens must be non-negative integers")
        return self
