"""Micro-batch layouts, normalisers, data-parallel split and buckets (hand-computed small cases)."""

from __future__ import annotations

import pytest
import torch

from tandem.core.batch import TrainBatch
from tandem.core.sample import Sample
from tandem.engines.training.common import (
    bucket_by_bytes,
    check_batch,
    dummy_micro_batch,
    local_loss_scale,
    make_micro_batch,
    split_for_data_parallel,
)


def _batch() -> TrainBatch:
    # row 0: prompt [10, 11], response [12, 13, 14]; row 1: prompt [20], response [21];
    # row 2: prompt [30, 31] and no response
    samples = [
        Sample(tokens=[10, 11, 12, 13, 14], response_length=3, loss_mask=[1, 0, 1], index=0),
        Sample(tokens=[20, 21], response_length=1, index=1),
        Sample(tokens=[30, 31], response_length=0, index=2),
    ]
    return TrainBatch.from_samples(samples, pad_token_id=0)


def test_packed_layout():
    mb = make_micro_batch(_batch(), packed=True)
    # fed tokens: row 0 without its last token, row 1 without its last, row 2 without its last
    assert mb.input_ids.tolist() == [10, 11, 12, 13, 20, 30]
    assert mb.positions.tolist() == [0, 1, 2, 3, 0, 0]
    assert mb.cu_seqlens.tolist() == [0, 4, 5, 6]
    # response tokens 12, 13, 14 are predicted at flat 1, 2, 3; token 21 at flat 4
    assert mb.select.tolist() == [1, 2, 3, 4]
    assert mb.targets.tolist() == [12, 13, 14, 21]
    assert mb.response_shape == (3, 3)
    assert mb.scatter.tolist() == [0, 1, 2, 3]
    out = mb.to_response(torch.tensor([-1.0, -2.0, -3.0, -4.0]))
    assert out.tolist() == [[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_padded_layout():
    mb = make_micro_batch(_batch(), packed=False)
    # columns past a row's fed tokens are masked out (right padding: no real query attends to them)
    assert mb.input_ids.tolist() == [[10, 11, 12, 13], [20, 21, 0, 0], [30, 31, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    # flattened [b * L] hidden index: row 0 positions 1..3, row 1 position 0
    assert mb.select.tolist() == [1, 2, 3, 4]
    assert mb.targets.tolist() == [12, 13, 14, 21]


def test_single_token_rows_are_left_out_of_the_pack():
    only = TrainBatch.from_samples([Sample(tokens=[5], response_length=0)])
    assert make_micro_batch(only, packed=True).num_tokens == 0
    dummy = dummy_micro_batch(packed=True, pad_token_id=7)
    assert dummy.input_ids.tolist() == [7] and dummy.cu_seqlens.tolist() == [0, 1] and dummy.is_dummy


def test_routing_follows_the_packed_tokens():
    batch = _batch()
    batch.routed_experts = torch.arange(3 * 4 * 1 * 2, dtype=torch.int32).view(3, 4, 1, 2)
    mb = make_micro_batch(batch, packed=True, with_routing=True)
    want = torch.cat([batch.routed_experts[0, :4], batch.routed_experts[1, :1], batch.routed_experts[2, :1]])
    assert torch.equal(mb.routed_experts, want)


def test_local_loss_scale_and_checks():
    assert local_loss_scale(_batch()).tolist() == [3.0, 2.0, 3.0]  # tokens, sequences, width
    with pytest.raises(ValueError, match="row 0 has 5 tokens, more than micro_batch_tokens=4"):
        check_batch(_batch(), max_context=100, micro_batch_tokens=4)
    with pytest.raises(ValueError, match=r"row 0 has 5 tokens, more than the model context \(max_position_embeddings=4\)"):
        check_batch(_batch(), max_context=4, micro_batch_tokens=100)


def test_split_for_data_parallel_balances_tokens():
    lengths = [9, 2, 5, 5, 4, 3]
    samples = [Sample(tokens=list(range(1, n + 1)), response_length=1, index=i) for i, n in enumerate(lengths)]
    shards = split_for_data_parallel(TrainBatch.from_samples(samples), 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert loads == [15, 13]  # longest-first onto the lighter rank: 9+4+2 and 5+5+3
    with pytest.raises(ValueError, match="cannot feed 8 data-parallel ranks"):
        split_for_data_parallel(TrainBatch.from_samples(samples), 8)


def test_bucket_by_bytes():
    tensors = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(10)), ("d", torch.zeros(1))]
    buckets = [[n for n, _ in b] for b in bucket_by_bytes(tensors, 32)]
    assert buckets == [["a", "b"], ["c"], ["d"]]  # 16 + 16 bytes fit; c (40 bytes) goes alone
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        list(bucket_by_bytes(tensors, 0))
