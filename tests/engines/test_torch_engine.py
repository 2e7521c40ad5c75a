"""The embedded torch engine generates what HF generates, with the log-probs a trainer computes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tandem.core.protocols import FinishReason, GenerationRequest, InferenceEngine, SamplingParams
from tandem.models import load_model
from tests.engines.torch_helpers import STOP, make_engine, plain_model, prompts, requests, teacher_forced

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]


def hf_greedy(hf, prompt, max_new_tokens):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=STOP,
            pad_token_id=STOP,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", TINY)
def test_greedy_matches_hf_generate_in_a_mixed_batch(name):
    hf = load_model(name)
    ps = prompts([5, 23, 1, 40, 12], seed=1)
    with make_engine(name, max_num_seqs=4) as engine:
        assert isinstance(engine, InferenceEngine)
        results = engine.generate(requests(ps, temperature=0, max_new_tokens=24, stop_token_ids=(STOP,)))
    for p, res in zip(ps, results, strict=True):
        [c] = res.completions
        expected = hf_greedy(hf, p, 24)
        assert c.token_ids == expected
        assert c.finish_reason == (FinishReason.STOP if expected[-1] == STOP else FinishReason.LENGTH)
        assert len(c.log_probs) == len(c.token_ids) and c.weight_versions == [0]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forced_forward(name, temperature):
    ps = prompts([3, 30, 11, 17], seed=2)
    with make_engine(name, max_num_seqs=3, prefill_chunk=16) as engine:
        results = engine.generate(requests(ps, temperature=temperature, max_new_tokens=20, seed=5))
        pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
        ref = teacher_forced(engine, pairs, temperature=temperature)
    for res, expected in zip(results, ref, strict=True):
        got = torch.tensor(res.completions[0].log_probs)
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_logprob_convention_ignores_top_k_and_top_p():
    """top-k / top-p restrict sampling only: the returned log-prob is log_softmax(logits / T)."""
    ps = prompts([9, 14], seed=3)
    with make_engine() as engine:
        results = engine.generate(
            requests(ps, temperature=1.3, top_k=5, top_p=0.8, max_new_tokens=16, seed=1)
        )
        pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
        ref = teacher_forced(engine, pairs, temperature=1.3)
        hidden_logits = _next_token_logits(plain_model(engine), pairs)
    for res, expected, logits in zip(results, ref, hidden_logits, strict=True):
        torch.testing.assert_close(torch.tensor(res.completions[0].log_probs), expected, rtol=0, atol=2e-5)
        # every sampled token is among the 5 most likely ones
        tokens = torch.tensor(res.completions[0].token_ids)
        rank = (logits > logits.gather(-1, tokens[:, None])).sum(-1)
        assert int(rank.max()) < 5


def _next_token_logits(model, pairs):
    from tandem.models.attention import VarlenAttention

    out = []
    for p, r in pairs:
        ids = torch.tensor(p + r)
        with torch.no_grad():
            hidden = model(ids, torch.arange(len(ids)), VarlenAttention.from_lengths([len(ids)]))
        out.append(model.logits(hidden)[len(p) - 1 : len(ids) - 1])
    return out


def test_top_k_one_and_tiny_top_p_are_greedy():
    ps = prompts([7, 19], seed=4)
    with make_engine() as engine:
        greedy = engine.generate(requests(ps, temperature=0, max_new_tokens=16))
        top_k = engine.generate(requests(ps, temperature=1.0, top_k=1, max_new_tokens=16, seed=3))
        top_p = engine.generate(requests(ps, temperature=1.0, top_p=1e-6, max_new_tokens=16, seed=3))
    for g, k, p in zip(greedy, top_k, top_p, strict=True):
        assert g.completions[0].token_ids == k.completions[0].token_ids == p.completions[0].token_ids


def test_same_seed_same_sample_alone_or_batched():
    target = prompts([13], seed=5)[0]
    others = prompts([4, 31, 8], seed=6)
    sampling = dict(temperature=1.0, max_new_tokens=30)
    with make_engine(max_num_seqs=4) as engine:
        alone = engine.generate(
            [GenerationRequest(prompt_token_ids=target, sampling=SamplingParams(seed=11, **sampling))]
        )
        mixed = engine.generate(
            requests(others, seed=1, **sampling)
            + [GenerationRequest(prompt_token_ids=target, sampling=SamplingParams(seed=11, **sampling))]
        )
        other_seed = engine.generate(
            [GenerationRequest(prompt_token_ids=target, sampling=SamplingParams(seed=12, **sampling))]
        )
    a, b = alone[0].completions[0], mixed[-1].completions[0]
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=0, atol=1e-5)
    assert other_seed[0].completions[0].token_ids != a.token_ids


def test_n_samples_share_one_prefill():
    prompt = prompts([37], seed=7)[0]
    with make_engine(max_num_seqs=8) as engine:
        before = engine.health()["prompt_tokens_computed"]
        [res] = engine.generate(requests([prompt], temperature=1.0, n=4, max_new_tokens=12, seed=9))
        computed = engine.health()["prompt_tokens_computed"] - before
        ref = teacher_forced(engine, [(prompt, c.token_ids) for c in res.completions])
    # the leader computes the prompt once; each follower computes only the last prompt token
    assert computed == len(prompt) + 3
    assert len({tuple(c.token_ids) for c in res.completions}) == 4  # independent samples
    for c, expected in zip(res.completions, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.log_probs), expected, rtol=0, atol=2e-5)


def _single(prompt, seed, **sampling):
    return GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(seed=seed, **sampling))


@pytest.mark.parametrize("deterministic", [False, True])
def test_requests_with_the_same_prompt_share_one_prefill(deterministic):
    """n single-sample requests of one prompt (how SGLang's API sends n) compute the prompt once and
    sample exactly what each request gets alone."""
    prompt, other = prompts([37, 29], seed=7)
    sampling = dict(temperature=1.0, max_new_tokens=12)
    with make_engine(max_num_seqs=8, deterministic=deterministic) as engine:
        alone = [engine.generate([_single(prompt, seed, **sampling)])[0] for seed in (1, 2, 3)]
        before = engine.health()["prompt_tokens_computed"]
        shared = engine.generate([_single(prompt, seed, **sampling) for seed in (1, 2, 3)]
                                 + [_single(other, 4, **sampling)])
        computed = engine.health()["prompt_tokens_computed"] - before
        assert engine.scheduler.groups == {}  # groups end with their requests
    assert computed == len(prompt) + 2 + len(other)
    for a, b in zip(alone, shared, strict=False):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        if deterministic:
            assert a.completions[0].log_probs == b.completions[0].log_probs
        else:
            np.testing.assert_allclose(a.completions[0].log_probs, b.completions[0].log_probs, rtol=0, atol=2e-5)


def test_a_weight_update_ends_prefix_sharing_with_requests_before_it():
    """A request submitted after a weight update never reuses prompt keys/values computed before it."""
    prompt = prompts([33], seed=3)[0]
    sampling = dict(temperature=1.0, max_new_tokens=40)
    with make_engine(max_num_seqs=4) as engine:
        first = engine._submit(_single(prompt, 1, **sampling))  # in flight across the update
        while engine.health()["prompt_tokens_computed"] < len(prompt):
            engine._drive(blocking=True)
        named = [(n, p.detach().clone() * 1.01) for n, p in engine.named_weights().items()]
        engine.update_weights(named, version=1)
        before = engine.health()["prompt_tokens_computed"]
        [late] = engine.generate([_single(prompt, 2, **sampling)])
        assert engine.health()["prompt_tokens_computed"] - before == len(prompt)
        ref = teacher_forced(engine, [(prompt, late.completions[0].token_ids)])[0]
        first.result(timeout=60)
    torch.testing.assert_close(torch.tensor(late.completions[0].log_probs), ref, rtol=0, atol=2e-5)


def test_moe_routed_experts_with_a_prefill_shared_across_requests():
    prompt = prompts([19], seed=13)[0]
    with make_engine("tiny-qwen3-moe") as engine:
        results = engine.generate([_single(prompt, s, temperature=1.0, max_new_tokens=8, return_routed_experts=True)
                                   for s in (5, 6)])
        pairs = [(prompt, r.completions[0].token_ids) for r in results]
        _, routes = teacher_forced(engine, pairs, routing=True)
    for r, expected in zip(results, routes, strict=True):
        np.testing.assert_array_equal(np.sort(r.completions[0].routed_experts, -1), np.sort(expected, -1))


def test_continuous_batching_equals_one_at_a_time():
    ps = prompts([6, 40, 3, 22, 15, 9, 28], seed=8)
    sampling = dict(temperature=0.9, max_new_tokens=25, seed=4, stop_token_ids=(STOP,))
    with make_engine(max_num_seqs=3, prefill_chunk=8) as engine:
        one_by_one = [engine.generate(requests([p], **sampling))[0] for p in ps]
        batched = engine.generate(requests(ps, **sampling))
        assert engine.health()["running"] == 0
    for a, b in zip(one_by_one, batched, strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        np.testing.assert_allclose(a.completions[0].log_probs, b.completions[0].log_probs, rtol=0, atol=1e-5)


def test_agenerate_calls_join_the_running_batch():
    ps = prompts([5, 12, 20, 8], seed=9)

    async def run_all(engine):
        return await asyncio.gather(
            *(engine.agenerate(r) for r in requests(ps, temperature=0, max_new_tokens=30))
        )

    with make_engine(max_num_seqs=4) as engine:
        steps0 = engine.health()["steps"]
        results = asyncio.run(run_all(engine))
        steps = engine.health()["steps"] - steps0
        blocking = engine.generate(requests(ps, temperature=0, max_new_tokens=30))
    # 4 x 30 tokens in far fewer than 120 steps: the calls were decoded together
    assert steps < 60
    for a, b in zip(results, blocking, strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids


def test_requests_beyond_the_kv_budget_wait_and_complete():
    ps = prompts([10, 20, 5, 30, 12], seed=10)
    with make_engine(max_num_seqs=8, max_model_len=64, kv_cache_tokens=128) as engine:
        health = engine.health()
        assert health["num_slots"] == 2 and health["kv_cache_tokens"] == 128
        results = engine.generate(requests(ps, temperature=0, n=2, max_new_tokens=20))
    for res in results:
        assert [c.finish_reason for c in res.completions] == [FinishReason.LENGTH] * 2
        assert all(len(c.token_ids) == 20 for c in res.completions)
        assert res.completions[0].token_ids == res.completions[1].token_ids  # greedy samples agree


def test_more_samples_than_slots():
    """n = 5 samples on 2 slots: later samples re-use a live sibling's prefix or recompute it."""
    prompt = prompts([25], seed=16)[0]
    with make_engine(max_num_seqs=2, max_model_len=64) as engine:
        [greedy] = engine.generate(requests([prompt], temperature=0, n=5, max_new_tokens=12))
        [sampled] = engine.generate(requests([prompt], temperature=1.0, n=5, max_new_tokens=12, seed=4))
        ref = teacher_forced(engine, [(prompt, c.token_ids) for c in sampled.completions])
    assert len({tuple(c.token_ids) for c in greedy.completions}) == 1
    assert all(len(c.token_ids) == 12 for c in greedy.completions + sampled.completions)
    for c, expected in zip(sampled.completions, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.log_probs), expected, rtol=0, atol=2e-5)


def test_stop_tokens_and_context_limit():
    with make_engine(max_model_len=40) as engine:
        [free] = engine.generate(requests(prompts([10], seed=11), temperature=0, max_new_tokens=20))
        stop_at = free.completions[0].token_ids[4]
        [stopped] = engine.generate(
            requests(prompts([10], seed=11), temperature=0, max_new_tokens=20, stop_token_ids=(stop_at,))
        )
        [capped] = engine.generate(requests(prompts([30], seed=12), temperature=0, max_new_tokens=50))
    c = stopped.completions[0]
    first = free.completions[0].token_ids.index(stop_at)
    assert c.finish_reason == FinishReason.STOP and c.token_ids == free.completions[0].token_ids[: first + 1]
    assert capped.completions[0].finish_reason == FinishReason.LENGTH
    assert len(capped.completions[0].token_ids) == 40 - 30  # prompt + response fill max_model_len


@pytest.mark.parametrize("deterministic", [False, True])
def test_moe_routed_experts_match_teacher_forced_router(deterministic):
    ps = prompts([6, 19], seed=13)
    with make_engine("tiny-qwen3-moe", deterministic=deterministic) as engine:
        results = engine.generate(
            requests(ps, temperature=1.0, n=2, max_new_tokens=10, seed=2, return_routed_experts=True)
        )
        pairs = [(p, c.token_ids) for p, r in zip(ps, results, strict=True) for c in r.completions]
        _, routes = teacher_forced(engine, pairs, routing=True, invariant=deterministic)
        layers, topk = len(engine.model.args.moe_layers), engine.model.args.num_experts_per_tok
    completions = [c for r in results for c in r.completions]
    for (p, r), c, expected in zip(pairs, completions, routes, strict=True):
        assert c.routed_experts.dtype == np.int32
        assert c.routed_experts.shape == (len(p) + len(r) - 1, layers, topk)
        np.testing.assert_array_equal(np.sort(c.routed_experts, -1), np.sort(expected, -1))


def test_dense_model_refuses_routed_experts():
    with make_engine() as engine:
        [res] = engine.generate(requests(prompts([5]), return_routed_experts=True, max_new_tokens=3))
    assert res.completions[0].finish_reason == FinishReason.ERROR
    assert "returns no routed experts (a dense model" in res.error


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_mode_is_batch_invariant(dtype):
    """In deterministic mode a request's tokens and log-probs are the same alone or in any batch."""
    target = prompts([21], seed=14)[0]
    others = prompts([3, 50, 9, 33, 14], seed=15)
    sampling = dict(temperature=1.0, max_new_tokens=24, seed=3)
    with make_engine(dtype=dtype, deterministic=True, max_num_seqs=4, prefill_chunk=16) as engine:
        [alone] = engine.generate(requests([target], **sampling))
        mixed = engine.generate(
            requests(others[:3], **sampling)
            + requests([target], **sampling)
            + requests(others[3:], **sampling)
        )
    a, b = alone.completions[0], mixed[3].completions[0]
    assert a.token_ids == b.token_ids and a.log_probs == b.log_probs


@pytest.mark.parametrize(("start", "rows"), [(0, 5), (37, 5), (100, 1), (12, 16)])
def test_small_chunk_attention_equals_causal_sdpa(start, rows):
    """A verification/prompt chunk of <= 16 rows (`_small_chunk_attention`, grouped query heads) attends
    like SDPA with the chunk's causal mask over the cache before it."""
    import torch.nn.functional as F

    from tandem.engines.inference.torch.kv_cache import _small_chunk_attention

    gen = torch.Generator().manual_seed(start + rows)
    hq, hkv, d, end = 9, 3, 16, start + rows
    q = torch.randn(rows, hq, d, generator=gen)
    k, v = torch.randn(2, hkv, end, d, generator=gen)
    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                              scale=0.25, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(_small_chunk_attention(q, k, v, start, 0.25), expected, rtol=1e-5, atol=1e-5)
