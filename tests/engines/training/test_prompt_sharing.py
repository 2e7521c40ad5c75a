"""Prompt sharing: rows that share a prompt feed it once; the log-probs and gradients stay those of the rows.

Layouts and plans are checked on hand-computed cases; the attention contexts against per-sequence
references (values and gradients, GQA, bit for bit in batch-invariant mode); the FSDP engine with
sharing against the engine without it, on grouped batches (log-probs, entropy, loss, gradients, weights
after a step), and in deterministic mode bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.batch import TrainBatch
from tandem.core.sample import Sample
from tandem.engines.training.common import (
    make_micro_batch,
    plan_micro_batches,
    split_for_data_parallel,
)
from tandem.engines.training.common.prompts import prompt_units
from tandem.engines.training.fsdp import CriticConfig, FSDPConfig, FSDPEngine, LoRAConfig, OptimizerConfig
from tandem.models import ModelConfig
from tandem.models.attention import PrefixLayout, SharedPrefixAttention, VarlenAttention
from tandem.ops import InvariantSharedPrefixAttention, InvariantVarlenAttention, batch_invariant_mode

from .helpers import (
    TINY,
    EntropyBonusLoss,
    engine_grads,
    max_abs_diff,
    sync_weights,
    token_mean_pg,
    value_mse,
)

OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)


def _hand_batch() -> TrainBatch:
    # rows 0, 1, 3 share the prompt [10, 11, 12]; row 2 has its own; row 4 shares row 2's prompt tokens
    # but has no response (it stands alone)
    p = [10, 11, 12]
    samples = [
        Sample(tokens=[*p, 13, 14, 15], response_length=3, index=0, group_index=0),
        Sample(tokens=[*p, 16], response_length=1, index=1, group_index=0),
        Sample(tokens=[20, 21, 22, 23], response_length=2, index=2, group_index=1),
        Sample(tokens=[*p, 17, 18], response_length=2, index=3, group_index=0),
        Sample(tokens=[20, 21], response_length=0, index=4, group_index=1),
    ]
    return TrainBatch.from_samples(samples, pad_token_id=0)


def test_prompt_units_compare_tokens_not_group_indices():
    batch = _hand_batch()
    assert prompt_units(batch) == [[0, 1, 3], [2], [4]]
    batch.input_ids[3, 1] = 99  # same group index, another prompt
    assert prompt_units(batch) == [[0, 1], [2], [3], [4]]


def test_shared_layout_by_hand():
    batch = _hand_batch()
    mb = make_micro_batch(batch, packed=True, share_prompts=True)
    # block 1: prompt once, then row 0's fed response [13, 14], row 1 feeds nothing past the prompt,
    # row 3's [17]; block 2: row 2 as an ordinary sequence; block 3: row 4's one fed token
    assert mb.input_ids.tolist() == [10, 11, 12, 13, 14, 17, 20, 21, 22, 20]
    assert mb.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0]
    assert mb.cu_seqlens.tolist() == [0, 6, 9, 10]
    assert mb.layout.prefixes == ((0, 3), (6, 3), (9, 1))
    assert mb.layout.suffixes == ((3, 2, 0), (5, 1, 0))
    # targets in response order: row 0 (13, 14, 15), row 1 (16), row 2 (22, 23), row 3 (17, 18)
    assert mb.targets.tolist() == [13, 14, 15, 16, 22, 23, 17, 18]
    # the prompt's last position (2) predicts the first token of rows 0, 1 and 3
    assert mb.select.tolist() == [2, 3, 4, 2, 7, 8, 2, 5]
    plain = make_micro_batch(batch, packed=True)
    assert torch.equal(mb.targets, plain.targets) and torch.equal(mb.scatter, plain.scatter)
    assert mb.num_tokens == 10 < plain.num_tokens == 16


def test_no_shared_prompt_gives_the_plain_layout():
    samples = [Sample(tokens=[1, 2, 3], response_length=1, index=0), Sample(tokens=[4, 5], response_length=1, index=1)]
    batch = TrainBatch.from_samples(samples)
    mb = make_micro_batch(batch, packed=True, share_prompts=True)
    assert mb.layout is None and mb.input_ids.tolist() == [1, 2, 4]
    # routing replay records a prompt's routing per row: no sharing
    batch = _hand_batch()
    batch.routed_experts = torch.zeros(5, 5, 1, 2, dtype=torch.int32)
    assert make_micro_batch(batch, packed=True, with_routing=True, share_prompts=True).layout is None


def test_plan_keeps_shared_rows_together_and_costs_the_prompt_once():
    batch = _hand_batch()  # seq lengths 6, 4, 4, 5, 2; the shared unit costs 3 + 3 + 1 + 2 = 9
    assert plan_micro_batches(batch, 9, share_prompts=True) == [[0, 1, 3], [2, 4]]
    # plain first-fit decreasing splits the group across micro-batches
    assert plan_micro_batches(batch, 9) == [[0, 4], [1, 3], [2]]
    # a unit over the budget is cut into runs that fit, each with the prompt once: [0, 1] costs 7
    assert plan_micro_batches(batch, 7, share_prompts=True) == [[0, 1], [3, 4], [2]]
    with pytest.raises(ValueError, match="sequence 0 has 6 tokens, more than the micro-batch token budget 5"):
        plan_micro_batches(batch, 5, share_prompts=True)
    # padded (the Megatron engine: one row per unit, right-padded): the budget bounds rows x the longest row
    assert plan_micro_batches(batch, 9, share_prompts=True, padded=True) == [[0, 1, 3], [2, 4]]  # 9; 2 x 4
    assert plan_micro_batches(batch, 9, padded=True) == [[0], [3], [1, 2], [4]]  # 6; 5; 2 x 4; 2


def test_data_parallel_split_keeps_units_on_one_rank():
    batch = _hand_batch()
    assert split_for_data_parallel(batch, 2, share_prompts=True) == [[0, 1, 3], [2, 4]]
    assert split_for_data_parallel(batch, 2) == [[0, 2], [1, 3, 4]]
    # fewer units than ranks: rows are split one by one
    assert sorted(sum(split_for_data_parallel(batch, 5, share_prompts=True), [])) == [0, 1, 2, 3, 4]


def _random_layout(gen: torch.Generator):
    """A packed batch of three groups (prefix lengths 5, 1, 7), in shared and in per-sequence form."""
    prefixes, suffixes, seqs, cursor = [], [], [], 0
    for plen, slens in ((5, [3, 1, 6]), (1, [4]), (7, [])):
        prefixes.append((cursor, plen))
        start = cursor
        cursor += plen
        if not slens:
            seqs.append([(start, plen)])
        for s in slens:
            suffixes.append((cursor, s, len(prefixes) - 1))
            seqs.append([(start, plen), (cursor, s)])
            cursor += s
    return PrefixLayout(prefixes=tuple(prefixes), suffixes=tuple(suffixes), num_tokens=cursor), seqs


def _per_sequence(seqs, q, k, v, context_cls, scale):
    """Each sequence unpacked on its own through ``context_cls``: ``[N, H, D]`` in shared-layout order."""
    out = torch.zeros_like(q)
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for pieces in seqs:
        index = torch.cat([torch.arange(s, s + n) for s, n in pieces])
        ctx = context_cls.from_lengths([len(index)])
        o = ctx.attend(0, q[index], k[index], v[index], scale)
        keep = ~written[index]
        out = out.index_put((index[keep],), o[keep])
        written[index] = True
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_shared_prefix_attention_matches_each_sequence_alone(hq, hkv):
    gen = torch.Generator().manual_seed(0)
    layout, seqs = _random_layout(gen)
    n, d = layout.num_tokens, 8
    q = torch.randn(n, hq, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, hq, d, generator=gen, dtype=torch.float64)
    got = SharedPrefixAttention(layout).attend(0, q, k, v, 0.3)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    # per sequence: a prefix's rows are written by its first sequence; the prefix's key/value gradients
    # sum over every sequence that reads them, so the reference feeds them as one tensor
    ref = _per_sequence(seqs, q, k, v, VarlenAttention, 0.3)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_suffix_mask_made_once_gives_the_bits_of_sdpa_s_own_conversion(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    layout, _ = _random_layout(gen)
    n = layout.num_tokens
    qkv = [torch.randn(n, h, 8, generator=gen).to(dtype).requires_grad_() for h in (4, 2, 2)]
    w = torch.randn(n, 4, 8, generator=gen).to(dtype)
    ctx = SharedPrefixAttention(layout)
    got = ctx.attend(0, *qkv, 0.3)
    assert ctx._float_mask(0, qkv[0]) is ctx._float_mask(0, qkv[0])  # one tensor for every layer
    grads = torch.autograd.grad((got * w).sum(), qkv)
    monkeypatch.setattr(SharedPrefixAttention, "_float_mask", lambda self, i, q: self.suffix_calls[i][2])  # SDPA converts
    ref = SharedPrefixAttention(layout).attend(0, *qkv, 0.3)
    ref_grads = torch.autograd.grad((ref * w).sum(), qkv)
    assert torch.equal(got, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_length_buckets_partition_the_rows_and_pad_less():
    from tandem.models.attention import _length_buckets

    def area(q, k, calls):
        return sum(len(c) * (max(q[i] for i in c) + max(k[i] for i in c)) for c in calls)

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(1, 200, (64,), generator=gen).tolist()
    k = [x + 60 for x in q]
    calls = _length_buckets(q, k)
    assert sorted(sum(calls, [])) == list(range(64)) and 1 < len(calls) <= 4
    assert area(q, k, calls) < 0.75 * area(q, k, [list(range(64))])
    assert _length_buckets([10] * 8, [70] * 8) == [list(range(8))]  # equal lengths: one call
    assert _length_buckets([3], [5]) == [[0]] and len(_length_buckets(q, k, 1)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_suffixes_split_by_length_give_what_one_call_gives(dtype, monkeypatch):
    import tandem.models.attention as attention

    prefixes = ((0, 6), (6 + 2 + 40 + 3 + 35, 4))
    suffixes, cursor = [], 6
    for s in (2, 40, 3, 35):
        suffixes.append((cursor, s, 0))
        cursor += s
    cursor += 4
    for s in (1, 30):
        suffixes.append((cursor, s, 1))
        cursor += s
    layout = PrefixLayout(prefixes=prefixes, suffixes=tuple(suffixes), num_tokens=cursor)
    gen = torch.Generator().manual_seed(5)
    qkv = [torch.randn(cursor, h, 8, generator=gen, dtype=dtype, requires_grad=True) for h in (4, 2, 2)]
    w = torch.randn(cursor, 4, 8, generator=gen, dtype=dtype)
    results = []
    for calls in (1, 4):
        monkeypatch.setattr(attention, "MAX_PADDED_CALLS", calls)
        ctx = SharedPrefixAttention(layout)
        assert (len(ctx.suffix_calls) > 1) == (calls > 1)
        out = ctx.attend(0, *qkv, 0.3)
        results.append((out, *torch.autograd.grad((out * w).sum(), qkv)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)


def test_invariant_shared_prefix_attention_is_bit_identical_to_each_sequence():
    gen = torch.Generator().manual_seed(1)
    layout, seqs = _random_layout(gen)
    n = layout.num_tokens
    q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (6, 2, 2))
    with batch_invariant_mode():
        got = InvariantSharedPrefixAttention(layout).attend(0, q, k, v, 0.25)
        ref = _per_sequence(seqs, q, k, v, InvariantVarlenAttention, 0.25)
    assert torch.equal(got, ref)


def test_layout_rejects_pieces_that_do_not_cover_the_batch():
    with pytest.raises(ValueError, match="cover the 5 tokens exactly once"):
        PrefixLayout(prefixes=((0, 3),), suffixes=((2, 3, 0),), num_tokens=5)
    with pytest.raises(ValueError, match="empty piece or unknown prefix"):
        PrefixLayout(prefixes=((0, 3),), suffixes=((3, 2, 1),), num_tokens=5)
    with pytest.raises(ValueError, match="built for 5 tokens got 4"):
        layout = PrefixLayout(prefixes=((0, 3),), suffixes=((3, 2, 0),), num_tokens=5)
        SharedPrefixAttention(layout).attend(0, *(torch.zeros(4, 2, 4) for _ in range(3)), 1.0)


def _grouped_batch(seed: int = 0) -> TrainBatch:
    """Four GRPO-like groups (one of a single row) with random prompts and responses, some of one token."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for group, (plen, rlens) in enumerate([(6, [4, 1, 7, 3]), (9, [5, 2]), (3, [8]), (5, [2, 6, 1])]):
        prompt = torch.randint(3, 500, (plen,), generator=gen).tolist()
        for r in rlens:
            tokens = prompt + torch.randint(3, 500, (r,), generator=gen).tolist()
            samples.append(Sample(tokens=tokens, response_length=r, index=len(samples), group_index=group))
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    return batch


def _engine(share: bool, **kw) -> FSDPEngine:
    kw.setdefault("micro_batch_tokens", 40)
    return FSDPEngine(FSDPConfig(model=ModelConfig(name=TINY), optimizer=OPT, share_prompts=share, **kw))


def test_engine_with_shared_prompts_trains_like_without():
    batch = _grouped_batch()
    plain, shared = _engine(False), _engine(True)
    a = plain.forward_logprobs(batch, with_entropy=True)
    b = shared.forward_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=1e-5)
    ma = plain.train_step(batch, EntropyBonusLoss())
    mb = shared.train_step(batch, EntropyBonusLoss())
    assert mb["train/loss"] == pytest.approx(ma["train/loss"], rel=1e-5)
    assert mb["train/grad_norm"] == pytest.approx(ma["train/grad_norm"], rel=1e-5)
    assert mb["train/tokens"] < 0.7 * ma["train/tokens"]  # 89 fed tokens -> 52
    assert max_abs_diff(sync_weights(shared), sync_weights(plain)) < 1e-6
    grads = {}
    for name, engine in (("plain", plain), ("shared", shared)):
        engine._accumulate_gradients(batch, token_mean_pg)
        grads[name] = engine_grads(engine)
    assert grads["plain"] and max_abs_diff(grads["shared"], grads["plain"]) < 1e-5


@pytest.mark.parametrize("seed", [0, 3])
def test_deterministic_engine_with_shared_prompts_gives_the_same_bits(seed):
    # the exact contract compares the trainer's log-probs with the engine's at the same weights: sharing
    # must not move a bit of them (the gradients sum the prompt's terms in another order, so the weights
    # after a step agree to rounding, not to the bit)
    batch = _grouped_batch(seed=seed)
    plain, shared = _engine(False, deterministic=True), _engine(True, deterministic=True)
    a, b = plain.forward_logprobs(batch, with_entropy=True), shared.forward_logprobs(batch, with_entropy=True)
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)


def test_critic_and_lora_with_shared_prompts_match_without():
    # the critic reads the same hidden states; LoRA adapters sit in the same linears
    batch = _grouped_batch(seed=5)
    batch.returns = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(6)) * batch.loss_mask
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    critic = CriticConfig(optimizer=OptimizerConfig(lr=1e-2))
    plain, shared = _engine(False, lora=lora, critic=critic), _engine(True, lora=lora, critic=critic)
    for engine in (plain, shared):
        engine.train_step(batch, value_mse, model="critic")
        engine.train_step(batch, token_mean_pg)
    for model in ("critic", "policy"):
        a, b = plain.forward_logprobs(batch, model=model), shared.forward_logprobs(batch, model=model)
        got, want = (b.values, a.values) if model == "critic" else (b.log_probs, a.log_probs)
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
