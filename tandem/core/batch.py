"""`TrainBatch`: samples turned into tensors for a training engine.

Two index spaces are used throughout Tandem:

* **sequence space** ``[B, L]``: prompt + response token ids, right-padded (``L`` = longest sequence).
* **response space** ``[B, R]``: one column per response token (``R`` = longest response). Every
  per-token quantity of the RL math (log-probs, advantages, loss mask, values) lives here, so the
  losses never need to know prompt lengths or packing.

Response token ``j`` of sample ``i`` is ``input_ids[i, P_i + j]``; its log-prob comes from the logits
at sequence position ``P_i + j - 1``. A prompt therefore holds at least one token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.sample import Sample, SampleValidationError

__all__ = ["TrainBatch", "partition_by_token_budget", "partition_padded", "response_index"]

# Response-space fields: [B, R] float tensors, padded with zeros.
_RESPONSE_FIELDS = (
    "loss_mask",
    "advantages",
    "returns",
    "values",
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_probs",
    "teacher_log_probs",
)


@dataclass(kw_only=True)
class TrainBatch:
    """A batch of trajectories as padded tensors. Shapes: ``B`` samples, ``L`` sequence, ``R`` response.

    Optional fields are ``None`` until a stage fills them (the loop computes advantages, the trainer
    old/ref log-probs, a critic values).
    """

    input_ids: torch.Tensor  # [B, L] int64, right-padded with pad_token_id
    seq_lengths: torch.Tensor  # [B] int64, prompt + response length
    prompt_lengths: torch.Tensor  # [B] int64
    loss_mask: torch.Tensor  # [B, R] float32, 1 on trained response tokens, 0 on padding/env tokens
    advantages: torch.Tensor | None = None  # [B, R] float32
    returns: torch.Tensor | None = None  # [B, R] float32 (PPO critic targets)
    values: torch.Tensor | None = None  # [B, R] float32 (critic values at rollout time)
    rollout_log_probs: torch.Tensor | None = None  # [B, R] float32, from the inference engine
    old_log_probs: torch.Tensor | None = None  # [B, R] float32, trainer's pass before the update
    ref_log_probs: torch.Tensor | None = None  # [B, R] float32, frozen reference model
    teacher_log_probs: torch.Tensor | None = None  # [B, R] float32, distillation teacher
    rewards: torch.Tensor | None = None  # [B] float32, scalar reward per sample
    routed_experts: torch.Tensor | None = None  # [B, L-1, layers, topk] int32 (MoE routing replay)
    group_index: torch.Tensor | None = None  # [B] int64
    sample_index: torch.Tensor | None = None  # [B] int64
    pad_token_id: int = 0

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], *, pad_token_id: int = 0) -> TrainBatch:
        """Build a batch from validated samples (prompt >= 1 token). Rewards must be scalar or absent."""
        if not samples:
            raise SampleValidationError("TrainBatch.from_samples: got an empty list of samples")
        for s in samples:
            s.validate()
            if s.prompt_length < 1:
                raise SampleValidationError(f"sample {s.index}: the prompt must hold at least one token")
        b = len(samples)
        seq_len = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long)
        resp_len = torch.tensor([s.response_length for s in samples], dtype=torch.long)
        max_l, max_r = int(seq_len.max()), int(resp_len.max())
        input_ids = torch.full((b, max_l), pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(b, max_r, dtype=torch.float32)
        has_lp = all(s.rollout_log_probs is not None for s in samples)
        rollout_lp = torch.zeros(b, max_r, dtype=torch.float32) if has_lp else None
        for i, s in enumerate(samples):
            input_ids[i, : len(s.tokens)] = torch.as_tensor(s.tokens, dtype=torch.long)
            r = s.response_length
            if r:
                loss_mask[i, :r] = torch.as_tensor(s.effective_loss_mask(), dtype=torch.float32)
                if rollout_lp is not None:
                    rollout_lp[i, :r] = torch.as_tensor(s.rollout_log_probs, dtype=torch.float32)
        rewards = None
        if all(s.reward is not None for s in samples):
            rewards = torch.tensor([s.scalar_reward() for s in samples], dtype=torch.float32)
        routed = None
        if all(s.rollout_routed_experts is not None for s in samples):
            first = samples[0].rollout_routed_experts
            routed = torch.zeros((b, max(max_l - 1, 0), *first.shape[1:]), dtype=torch.int32)
            for i, s in enumerate(samples):
                e = np.asarray(s.rollout_routed_experts)
                if e.shape[1:] != first.shape[1:]:
                    raise SampleValidationError(
                        f"sample {s.index}: rollout_routed_experts shape {e.shape} differs from "
                        f"sample {samples[0].index}'s {first.shape} beyond the token axis"
                    )
                routed[i, : e.shape[0]] = torch.from_numpy(e.astype(np.int32, copy=False))
        return cls(
            input_ids=input_ids,
            seq_lengths=seq_len,
            prompt_lengths=seq_len - resp_len,
            loss_mask=loss_mask,
            rollout_log_probs=rollout_lp,
            rewards=rewards,
            routed_experts=routed,
            group_index=torch.tensor([s.group_index for s in samples], dtype=torch.long),
            sample_index=torch.tensor([s.index for s in samples], dtype=torch.long),
            pad_token_id=pad_token_id,
        )

    # -- views ------------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] int64."""
        return self.seq_lengths - self.prompt_lengths

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that count in a token-mean loss (sum of the loss mask)."""
        return int(self.loss_mask.sum().item())

    def select(self, index: Sequence[int] | torch.Tensor) -> TrainBatch:
        """The rows ``index`` as a new batch, trimmed to their own longest sequence and response."""
        idx = torch.as_tensor(index, dtype=torch.long)
        if idx.numel() == 0:
            raise ValueError("TrainBatch.select: empty index")
        seq_len = self.seq_lengths[idx]
        resp = seq_len - self.prompt_lengths[idx]
        max_l, max_r = int(seq_len.max()), int(resp.max())
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor):
                out[f.name] = v
                continue
            v = v[idx]
            if f.name == "input_ids":
                v = v[:, :max_l]
            elif f.name == "routed_experts":
                v = v[:, : max(max_l - 1, 0)]
            elif f.name in _RESPONSE_FIELDS:
                v = v[:, :max_r]
            out[f.name] = v
        return TrainBatch(**out)

    def replace(self, **changes) -> TrainBatch:
        """A shallow copy with some fields replaced (tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> TrainBatch:
        return self.replace(
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            }
        )


def response_index(prompt_lengths: torch.Tensor, response_width: int) -> torch.Tensor:
    """Sequence positions of the logits that predict each response token, ``[B, R]`` int64.

    Response token ``j`` of row ``i`` sits at sequence position ``P_i + j``; it is predicted by the
    logits at ``P_i + j - 1``. Gather per-position log-probs with this index to reach response space.
    Positions past a row's end point into its padding; mask them with the loss mask.
    """
    j = torch.arange(response_width, device=prompt_lengths.device)
    return prompt_lengths[:, None] - 1 + j[None, :]


def _check_fits(lengths: Sequence[int], max_tokens: int) -> None:
    """Raise unless ``max_tokens`` is positive and every row fits it alone."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be > 0")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch token budget {max_tokens}; "
                f"raise the budget to at least {n}"
            )


def partition_padded(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split rows into micro-batches whose padded size, rows x longest row, stays within ``max_tokens`` (for
    engines that right-pad a micro-batch to ``[rows, longest]``): rows in decreasing length, each micro-batch
    filled with as many as its first (longest) row allows. Row indices per micro-batch, each sorted ascending;
    a row longer than the budget raises."""
    _check_fits(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * max(lengths[bins[-1][0]], 1) <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def partition_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split rows into micro-batches whose summed length stays within ``max_tokens``.

    First-fit decreasing over the lengths (a packing heuristic that gets within ~11/9 of the optimal
    number of bins), returning row indices per micro-batch, each sorted ascending. A row longer than
    the budget raises: it can never fit.
    """
    _check_fits(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for k, free in enumerate(room):
            if lengths[i] <= free:
                bins[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]
