"""Group / sample filters: each drop reason, their order, metrics, and the Sample-level wrapper."""

from __future__ import annotations

import pytest
import torch

from tandem.core.filters import (
    DROP_REASONS,
    FilterConfig,
    filter_groups,
    filter_samples,
    nonfinite_reward_rows,
)
from tandem.core.sample import Sample, SampleStatus


def test_nonfinite_reward_rows():
    rewards = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    assert nonfinite_reward_rows(rewards).tolist() == [False, True, True, True, False]
    with pytest.raises(ValueError, match="1-D"):
        nonfinite_reward_rows(torch.zeros(2, 2))


def test_zero_std_groups_are_dropped_with_non_contiguous_ids():
    groups = torch.tensor([9, 4, 9, 4, 7])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])  # group 9 all equal; the lone sample of 7 too
    result, metrics = filter_groups(groups, FilterConfig(drop_zero_std_groups=True), rewards=rewards)
    assert result.keep.tolist() == [False, True, False, True, False]
    assert result.reason_names() == ["zero_std_group", "kept", "zero_std_group", "kept", "zero_std_group"]
    assert metrics["filter/dropped_zero_std_group"] == 3.0 and metrics["filter/kept"] == 2.0
    assert metrics["filter/groups_in"] == 3.0 and metrics["filter/groups_kept"] == 1.0


def test_zero_std_tolerance():
    groups = torch.tensor([0, 0])
    rewards = torch.tensor([1.0, 1.0 + 1e-5])
    kept, _ = filter_groups(groups, FilterConfig(drop_zero_std_groups=True), rewards=rewards)
    dropped, _ = filter_groups(
        groups, FilterConfig(drop_zero_std_groups=True, zero_std_tol=1e-4), rewards=rewards
    )
    assert kept.keep.all() and not dropped.keep.any()


def test_aborted_sample_drops_its_whole_group_unless_disabled():
    groups = torch.tensor([0, 0, 1, 1])
    aborted = torch.tensor([False, True, False, False])
    result, metrics = filter_groups(groups, FilterConfig(), aborted=aborted)
    assert result.reason_names() == ["aborted_group", "aborted_group", "kept", "kept"]
    assert metrics["filter/dropped_aborted_group"] == 2.0
    result, _ = filter_groups(groups, FilterConfig(drop_aborted_groups=False), aborted=aborted)
    assert result.keep.all()


def test_reasons_are_counted_under_the_first_that_applies():
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 1.0, 3.0, 3.0])
    failed = torch.tensor([True, False, False, False, False, False, False])
    lengths = torch.tensor([5, 5, 5, 5, 50, 5, 5])
    cfg = FilterConfig(drop_zero_std_groups=True, max_response_length=10)
    result, metrics = filter_groups(groups, cfg, rewards=rewards, failed=failed, response_lengths=lengths)
    assert result.reason_names() == [
        "failed", "nonfinite_reward", "zero_std_group",  # group 0: only one sample left -> no spread
        "zero_std_group", "length",  # group 1: the long sample goes first, the rest has one reward
        "zero_std_group", "zero_std_group",
    ]  # fmt: skip
    assert sum(metrics[f"filter/dropped_{r}"] for r in DROP_REASONS[1:]) + metrics["filter/kept"] == 7


def test_length_filter_per_sample_and_per_group_and_truncation():
    groups = torch.tensor([0, 0, 1, 1])
    lengths = torch.tensor([3, 30, 4, 5])
    truncated = torch.tensor([False, False, False, True])
    sample_scope, _ = filter_groups(
        groups, FilterConfig(min_response_length=4, max_response_length=20), response_lengths=lengths
    )
    assert sample_scope.keep.tolist() == [False, False, True, True]
    group_scope, _ = filter_groups(
        groups, FilterConfig(max_response_length=20, length_scope="group"), response_lengths=lengths
    )
    assert group_scope.keep.tolist() == [False, False, True, True]
    overlong, _ = filter_groups(groups, FilterConfig(drop_truncated=True), truncated=truncated)
    assert overlong.keep.tolist() == [True, True, True, False]


def test_min_group_size_after_other_drops():
    groups = torch.tensor([0, 0, 1, 1, 1])
    failed = torch.tensor([True, False, False, False, False])
    result, metrics = filter_groups(groups, FilterConfig(min_group_size=2), failed=failed)
    assert result.reason_names() == ["failed", "small_group", "kept", "kept", "kept"]
    assert metrics["filter/groups_kept"] == 1.0


def test_missing_inputs_and_shape_errors():
    groups = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="needs rewards"):
        filter_groups(groups, FilterConfig(drop_zero_std_groups=True))
    with pytest.raises(ValueError, match="response_lengths"):
        filter_groups(groups, FilterConfig(max_response_length=4))
    with pytest.raises(ValueError, match="truncated"):
        filter_groups(groups, FilterConfig(drop_truncated=True))
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\)"):
        filter_groups(groups, FilterConfig(), rewards=torch.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        filter_groups(torch.zeros(0, dtype=torch.long), FilterConfig())


def _sample(index, group, reward, status=SampleStatus.COMPLETED, length=2):
    return Sample(tokens=[1] * (1 + length), response_length=length, reward=reward, status=status,
                  group_index=group, index=index)  # fmt: skip


def test_filter_samples_marks_nonfinite_rewards_failed_and_keeps_the_rest_of_the_group():
    samples = [
        _sample(0, 0, 1.0),
        _sample(1, 0, float("nan")),
        _sample(2, 0, 0.0),
        _sample(3, 1, None, status=SampleStatus.ABORTED),
        _sample(4, 1, 1.0),
        _sample(5, 2, {"score": 1.0, "format": 0.0}, status=SampleStatus.TRUNCATED),
    ]
    kept, dropped, metrics = filter_samples(samples, FilterConfig())
    assert [s.index for s in kept] == [0, 2, 5]
    assert [(s.index, reason) for s, reason in dropped] == [
        (1, "nonfinite_reward"),
        (3, "aborted_group"),
        (4, "aborted_group"),
    ]
    assert samples[1].status == SampleStatus.FAILED and samples[3].status == SampleStatus.ABORTED
    assert metrics["filter/kept"] == 3.0
    with pytest.raises(ValueError, match="reward is not set"):
        filter_samples([_sample(0, 0, None)], FilterConfig())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_std_tol": -1.0}, "zero_std_tol"),
        ({"min_response_length": -1}, "min_response_length"),
        ({"min_response_length": 5, "max_response_length": 4}, "max_response_length"),
        ({"min_group_size": 0}, "min_group_size"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FilterConfig(**kwargs)
