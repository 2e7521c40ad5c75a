"""Sample validation and the TrainBatch built from samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.core import (
    Sample,
    SampleValidationError,
    TrainBatch,
    partition_by_token_budget,
    partition_padded,
    response_index,
)


def _sample(prompt, response, **kw):
    return Sample(tokens=list(prompt) + list(response), response_length=len(response), **kw)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loss_mask=[1, 1]), r"len\(loss_mask\)=2 != response_length=3"),
        (dict(rollout_log_probs=[-0.1]), r"len\(rollout_log_probs\)=1 != response_length=3"),
        (
            dict(rollout_log_probs=[-0.1, float("nan"), -1.0]),
            r"rollout_log_probs\[1\]=nan is not a log-probability",
        ),
        (dict(loss_mask=[1, 2, 0]), "loss_mask holds 2"),
        (dict(rollout_routed_experts=np.zeros((3, 2, 2), np.int32)), r"shape \(3, 2, 2\); expected \[T-1=4"),
    ],
)
def test_sample_validation_names_the_field(kwargs, message):
    s = _sample([5, 6], [7, 8, 9], index=3, **kwargs)
    with pytest.raises(SampleValidationError, match=message):
        s.validate()


def test_sample_response_length_bound():
    with pytest.raises(SampleValidationError, match=r"response_length=5 must be in \[0, len\(tokens\)=3\]"):
        Sample(tokens=[1, 2, 3], response_length=5).validate()


def test_trainbatch_layout():
    s0 = _sample([10, 11, 12], [20, 21], rollout_log_probs=[-0.5, -0.25], reward=1.0, index=0, group_index=0)
    s1 = _sample(
        [13],
        [22, 23, 24, 25],
        loss_mask=[1, 0, 1, 1],
        rollout_log_probs=[-1.0] * 4,
        reward=0.0,
        index=1,
        group_index=0,
    )
    b = TrainBatch.from_samples([s0, s1], pad_token_id=2)
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21], [13, 22, 23, 24, 25]]
    assert b.loss_mask.tolist() == [[1, 1, 0, 0], [1, 0, 1, 1]]
    assert b.rollout_log_probs.tolist() == [[-0.5, -0.25, 0, 0], [-1, -1, -1, -1]]
    assert b.response_lengths.tolist() == [2, 4] and b.num_loss_tokens == 5
    # logits position predicting each response token
    idx = response_index(b.prompt_lengths, 4)
    assert idx.tolist() == [[2, 3, 4, 5], [0, 1, 2, 3]]
    tok = torch.gather(b.input_ids, 1, (idx + 1).clamp(max=4))
    assert tok[0, :2].tolist() == [20, 21] and tok[1].tolist() == [22, 23, 24, 25]
    sub = b.select([0])
    assert sub.input_ids.shape == (1, 5) and sub.loss_mask.shape == (1, 2)
    assert sub.rewards.tolist() == [1.0]


def test_trainbatch_rejects_empty_prompt_and_empty_list():
    with pytest.raises(SampleValidationError, match="at least one token"):
        TrainBatch.from_samples([_sample([], [1, 2])])
    with pytest.raises(SampleValidationError, match="empty list"):
        TrainBatch.from_samples([])


def test_partition_by_token_budget():
    lengths = [5, 9, 3, 7, 2, 8]
    parts = partition_by_token_budget(lengths, 10)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert all(sum(lengths[i] for i in p) <= 10 for p in parts)
    assert len(parts) == 4  # 34 tokens need at least 4 bins of 10
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the micro-batch token budget 8"):
        partition_by_token_budget(lengths, 8)


def test_partition_padded_bounds_rows_times_the_longest():
    lengths = [5, 9, 3, 7, 2, 8, 9]
    parts = partition_padded(lengths, 20)
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert all(len(p) * max(lengths[i] for i in p) <= 20 for p in parts)
    assert parts == [[1, 6], [3, 5], [0, 2, 4]]  # 9+9; 8+7 (a third row would pad to 3 x 8); 5+3+2
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, more than the micro-batch token budget 8"):
        partition_padded(lengths, 8)
