"""Speculative decoding in the embedded engine: the sampled distribution is the target's, the log-probs
are the target's (bit for bit in deterministic mode), rejected tokens leave no trace in the KV cache, and
stop tokens, length limits and aborts behave as without speculation.

Engine tests use an *oracle* drafter (the continuation a plain run produced, some tokens corrupted): the
tiny random models rarely repeat themselves, so the n-gram drafter would almost never be accepted, and
what is tested here is what the engine does with drafts, accepted or not.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from tandem.core.protocols import FinishReason, GenerationRequest, SamplingParams
from tandem.core.speculative import SpeculativeConfig
from tandem.engines.inference.torch.sampling import RowSampler, filtered_probs
from tandem.engines.inference.torch.speculative import DraftDist, NgramDrafter, next_k, speculative_sample
from tests.engines.torch_helpers import make_engine, prompts, teacher_forced, wait_until

ALPHA = 1e-6  # false-failure rate of each chi-square check below


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic over the tokens of non-zero probability, and the critical value at ALPHA; a
    token of zero probability that was drawn makes the statistic infinite."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return float("inf"), 0.0
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, float(chi2.ppf(1 - ALPHA, int(support.sum()) - 1))


def _target(logits: torch.Tensor, sampler: RowSampler) -> np.ndarray:
    scaled = logits / sampler.temperature
    p = filtered_probs(scaled, [sampler] * len(logits), logits.shape[-1]).double()
    return (p / p.sum(-1, keepdim=True)).numpy()


@pytest.mark.parametrize("settings", [dict(temperature=1.0, top_k=0, top_p=1.0),
                                      dict(temperature=0.7, top_k=6, top_p=1.0),
                                      dict(temperature=1.3, top_k=0, top_p=0.8)])
def test_speculative_sampling_reproduces_the_target_distribution(settings):
    """12,000 draws over a 10-token vocabulary: the first emitted token follows p_0, and the second (after an
    accepted first draft token) follows p_1, whatever the draft; chi-square at a false-failure rate of 1e-6
    per check. The same check rejects "always accept the draft" (the test can fail). Power: moving 0.03 of
    mass between two tokens of probability 0.1 gives a noncentrality of 12,000 x 2 x 0.03^2 / 0.1 = 216 against
    a critical value of 33-45; a residual that keeps the rejected draft token scores ~2,700-2,900 (checked)."""
    vocab, draws = 10, 12_000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    sampler = RowSampler(generator=torch.Generator().manual_seed(11), **settings)
    p = _target(logits, sampler)
    likely, unlikely = int(p[0].argmax()), int(p[0].argmin())  # argmin may be excluded by top-k / top-p
    for draft in ([likely, int(p[1].argmax())], [unlikely, likely]):
        first = np.zeros(vocab)
        second = np.zeros(vocab)
        for _ in range(draws):
            out = speculative_sample(logits, draft, sampler)
            first[out[0]] += 1
            if out[0] == draft[0]:
                second[out[1]] += 1
        stat, critical = _chi_square(first, p[0])
        assert stat < critical, (draft, stat, critical)
        if second.sum() > 1000:
            stat, critical = _chi_square(second, p[1])
            assert stat < critical, (draft, stat, critical)
    always = np.zeros(vocab)
    always[likely] = draws  # what accepting every draft token would give
    assert _chi_square(always, p[0])[0] > _chi_square(always, p[0])[1]


@pytest.mark.parametrize("settings", [dict(temperature=1.0, top_k=0, top_p=1.0),
                                      dict(temperature=0.8, top_k=5, top_p=1.0)])
def test_drafts_sampled_from_a_draft_distribution_keep_the_target_distribution(settings):
    """Draft tokens drawn from q (a draft model's distribution, here unrelated to p): accept with min(1, p/q),
    resample from max(0, p - q); the emitted tokens still follow p (chi-square, false-failure rate 1e-6 per
    check), and sum(min(p, q)) of the drafts are accepted."""
    vocab, draws = 10, 10_000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, vocab, generator=g), dim=-1).double()
    sampler = RowSampler(generator=torch.Generator().manual_seed(3), **settings)
    p = _target(logits, sampler)
    first = np.zeros(vocab)
    accepted = 0
    for _ in range(draws):
        d = int(torch.multinomial(q[0], 1, generator=g))
        out = speculative_sample(logits, [d], sampler, DraftDist(q, torch.arange(vocab), torch.arange(vocab)))
        first[out[0]] += 1
        accepted += len(out) == 2
    stat, critical = _chi_square(first, p[0])
    assert stat < critical, (stat, critical)
    expected = float(np.minimum(p[0], q[0].numpy()).sum())
    assert abs(accepted / draws - expected) < 5 * (expected * (1 - expected) / draws) ** 0.5


def test_greedy_speculation_accepts_exactly_the_argmax():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    sampler = RowSampler(temperature=0.0, top_k=0, top_p=1.0, generator=torch.Generator())
    assert speculative_sample(logits, best[:3], sampler) == best  # all accepted + the bonus token
    wrong = (best[1] + 1) % 16
    assert speculative_sample(logits, [best[0], wrong, best[2]], sampler) == best[:2]


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(SpeculativeConfig(ngram_max=3, ngram_min=1))
    tokens = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    assert drafter.propose(tokens, 3) == [2, 3, 5]  # the latest earlier "5 6 7" is followed by 2 3 5
    assert drafter.propose(np.array([1, 2, 3, 4]), 3) == []  # no earlier occurrence of any suffix
    assert drafter.propose(np.array([4, 9, 9, 4]), 5) == [9, 9, 4]  # falls back to the 1-gram "4"
    assert drafter.propose(tokens, 0) == []


def test_adaptive_k_follows_acceptance():
    spec = SpeculativeConfig(k=5)
    assert next_k(spec, 3, 3, 3) == 4 and next_k(spec, 5, 5, 5) == 5
    assert next_k(spec, 4, 4, 1) == 2 and next_k(spec, 4, 4, 0) == 1
    assert next_k(SpeculativeConfig(k=5, adaptive=False), 2, 2, 0) == 5


class Oracle(NgramDrafter):
    """Drafts the continuation a plain run produced for the same prompt, every ``corrupt``-th draft token
    replaced by another token (so some are rejected)."""

    def __init__(self, references: dict[tuple, list[int]], corrupt: int, vocab: int) -> None:
        self.references, self.corrupt, self.vocab, self.calls = references, corrupt, vocab, 0

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        tokens = tokens.tolist()
        for prompt, continuation in self.references.items():
            if tuple(tokens[: len(prompt)]) == prompt and tokens[len(prompt):] == continuation[: len(tokens) - len(prompt)]:
                done = len(tokens) - len(prompt)
                draft = continuation[done : done + k]
                self.calls += 1
                return [(t + 1) % self.vocab if (self.calls + i) % self.corrupt == 0 else t for i, t in enumerate(draft)]
        return []


def _requests(ps, **sampling):
    return [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(seed=i, **sampling)) for i, p in enumerate(ps)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_greedy_output_is_unchanged_by_speculation_and_rejected_tokens_leave_no_trace(deterministic):
    """With drafts of which every third token is wrong, greedy outputs equal plain decoding token for token:
    a rejected token's keys/values, left in the slot, would change every later token if anything read them.
    7 prompts on 3 slots: sequences join as others finish, at different acceptance."""
    ps = prompts([6, 21, 3, 14, 9, 30, 11], seed=8)
    sampling = dict(temperature=0.0, max_new_tokens=24)
    with make_engine(max_num_seqs=3, deterministic=deterministic) as plain:
        reference = plain.generate(_requests(ps, **sampling))
    refs = {tuple(p): r.completions[0].token_ids for p, r in zip(ps, reference, strict=True)}
    with make_engine(max_num_seqs=3, deterministic=deterministic, speculative=SpeculativeConfig(k=4)) as engine:
        engine._drafter = Oracle(refs, corrupt=3, vocab=512)
        results = engine.generate(_requests(ps, **sampling))
        stats = engine.health()
        pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
        expected = teacher_forced(engine, pairs, invariant=deterministic)
    assert [r.completions[0].token_ids for r in results] == [r.completions[0].token_ids for r in reference]
    assert 0.3 < stats["spec_acceptance_rate"] < 0.95 and stats["spec_tokens_per_pass"] > 1.5, stats
    assert stats["steps"] < 24 * 7 / 3  # fewer target passes than plain decoding needs
    for r, e in zip(results, expected, strict=True):
        got = torch.tensor(r.completions[0].log_probs)
        if deterministic:
            assert torch.equal(got, e)  # the exact contract: bit for bit
        else:
            torch.testing.assert_close(got, e, rtol=0, atol=2e-5)


def test_the_exact_contract_holds_with_sampled_speculation():
    """Deterministic mode at T = 0.5 with drafts from a greedy run (mostly accepted, some not): the log-probs
    equal the trainer-side forward bit for bit."""
    ps = prompts([9, 17, 5], seed=2)
    with make_engine(deterministic=True) as plain:
        greedy = plain.generate(_requests(ps, temperature=0.0, max_new_tokens=20))
    refs = {tuple(p): r.completions[0].token_ids for p, r in zip(ps, greedy, strict=True)}
    with make_engine(deterministic=True, speculative=SpeculativeConfig(k=3)) as engine:
        engine._drafter = Oracle(refs, corrupt=5, vocab=512)
        results = engine.generate(_requests(ps, temperature=0.5, max_new_tokens=20))
        accepted = engine.health()["spec_accepted"]
        pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
        expected = teacher_forced(engine, pairs, temperature=0.5, invariant=True)
    assert accepted > 0
    for r, e in zip(results, expected, strict=True):
        assert torch.equal(torch.tensor(r.completions[0].log_probs), e)


def test_stop_tokens_and_length_limits_cut_a_speculated_run():
    ps = prompts([7, 12], seed=5)
    with make_engine(max_model_len=40) as plain:
        reference = plain.generate(_requests(ps, temperature=0.0, max_new_tokens=30))
    refs = {tuple(p): r.completions[0].token_ids for p, r in zip(ps, reference, strict=True)}
    stop = refs[tuple(ps[0])][9]
    first_stop = refs[tuple(ps[0])].index(stop)
    with make_engine(max_model_len=40, speculative=SpeculativeConfig(k=6)) as engine:
        engine._drafter = Oracle(refs, corrupt=10**9, vocab=512)  # never wrong: drafts run past the limits
        stopped, capped = engine.generate([
            GenerationRequest(prompt_token_ids=ps[0], sampling=SamplingParams(temperature=0.0, max_new_tokens=30,
                                                                              stop_token_ids=(stop,))),
            GenerationRequest(prompt_token_ids=ps[1], sampling=SamplingParams(temperature=0.0, max_new_tokens=30)),
        ])
        assert engine.health()["spec_accepted"] > 10
    s, c = stopped.completions[0], capped.completions[0]
    assert s.finish_reason == FinishReason.STOP and s.token_ids == refs[tuple(ps[0])][: first_stop + 1]
    assert len(s.log_probs) == len(s.token_ids)
    assert c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 40 - 12  # prompt + response = context
    assert c.token_ids == refs[tuple(ps[1])][: 40 - 12] and len(c.log_probs) == len(c.token_ids)


def test_abort_mid_speculation_returns_the_tokens_so_far():
    p = prompts([8], seed=9)[0]
    with make_engine() as plain:
        [reference] = plain.generate(_requests([p], temperature=0.0, max_new_tokens=200))
    refs = {tuple(p): reference.completions[0].token_ids}
    with make_engine(speculative=SpeculativeConfig(k=4)) as engine:
        engine._drafter = Oracle(refs, corrupt=4, vocab=512)
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=engine.generate(_requests([p], temperature=0.0,
                                                                                        max_new_tokens=200))))
        thread.start()
        wait_until(lambda: engine.health()["spec_passes"] >= 3)
        engine.abort_all()
        thread.join(timeout=60)
    c = out["r"][0].completions[0]
    assert c.finish_reason == FinishReason.ABORT and 0 < len(c.token_ids) < 200
    assert c.token_ids == refs[tuple(p)][: len(c.token_ids)] and len(c.log_probs) == len(c.token_ids)


def test_moe_routed_experts_with_speculation_match_the_teacher_forced_router():
    ps = prompts([6, 13], seed=21)
    with make_engine("tiny-qwen3-moe") as plain:
        reference = plain.generate(_requests(ps, temperature=0.0, max_new_tokens=12))
    refs = {tuple(p): r.completions[0].token_ids for p, r in zip(ps, reference, strict=True)}
    with make_engine("tiny-qwen3-moe", speculative=SpeculativeConfig(k=3)) as engine:
        engine._drafter = Oracle(refs, corrupt=3, vocab=engine.model.args.vocab_size)
        results = engine.generate(_requests(ps, temperature=0.0, max_new_tokens=12, return_routed_experts=True))
        assert engine.health()["spec_accepted"] > 0
        pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
        _, routes = teacher_forced(engine, pairs, routing=True)
    for (p, r), res, expected in zip(pairs, results, routes, strict=True):
        got = res.completions[0].routed_experts
        assert got.shape[0] == len(p) + len(r) - 1
        np.testing.assert_array_equal(np.sort(got, -1), np.sort(expected, -1))


def test_the_draft_head_learns_online_and_its_drafts_keep_the_exact_contract():
    """drafter: draft_head on the tiny model: nothing drafted before the first training; each weight update
    trains it on the rollouts since the last one and its own loss falls over rounds; deterministic-mode
    log-probs stay bit-identical to the trainer-side forward while its sampled drafts are verified."""
    ps = prompts([5, 9, 7, 12, 6, 10, 8, 11], seed=31)
    spec = SpeculativeConfig(drafter="draft_head", k=3, max_batch=None, draft_vocab=256, head_epochs=4)
    with make_engine(deterministic=True, max_num_seqs=8, speculative=spec) as engine:
        weights = [(n, p.detach().clone()) for n, p in engine.named_weights().items()]
        engine.generate(_requests(ps, temperature=1.0, max_new_tokens=24))
        assert engine.health()["spec_passes"] == 0  # untrained: no drafts
        losses, accepts = [], []
        for version in range(1, 6):
            engine.update_weights(weights, version=version)  # trains the head on the rollouts so far
            losses.append(engine.health()["spec_head_loss"])
            accepts.append(engine.health()["spec_head_expected_acceptance"])
            results = engine.generate(_requests(ps, temperature=1.0, max_new_tokens=24))
        health = engine.health()
        pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
        expected = teacher_forced(engine, pairs, invariant=True)
    assert health["spec_head_trainings"] == 5 and health["spec_passes"] > 0 and health["spec_drafted"] > 0
    assert losses[-1] < losses[0], losses
    assert accepts[-1] > accepts[0], accepts  # sum min(p, q) of its first draft token, on its training rows
    for r, e in zip(results, expected, strict=True):
        assert torch.equal(torch.tensor(r.completions[0].log_probs), e)


def test_the_draft_head_distils_the_targets_distribution_from_a_replayed_window():
    """What the draft head trains on: every kept row's normaliser is the logsumexp of the target's logits at
    that row (decode rows and verified draft rows alike), so ``exp(h W^T - lse)`` is the distribution the
    token was sampled from; the window keeps the newest ``head_buffer_tokens`` rows across trainings, and a
    training needs new rollouts."""
    ps = prompts([5, 9, 7, 12, 6, 10, 8, 11], seed=33)
    spec = SpeculativeConfig(drafter="draft_head", k=3, max_batch=None, draft_vocab=256, head_buffer_tokens=300)
    with make_engine(max_num_seqs=8, speculative=spec) as engine:
        drafter = engine._drafter
        weights = [(n, p.detach().clone()) for n, p in engine.named_weights().items()]
        engine.generate(_requests(ps, temperature=1.0, max_new_tokens=24))
        engine.update_weights(weights, version=1)
        engine.generate(_requests(ps, temperature=1.0, max_new_tokens=24))  # with drafts, verified
        assert engine.health()["spec_accepted"] > 0
        drafter._sweep()
        out = engine.model.lm_head.weight.detach().float()
        for hidden, _tokens, lse in drafter.buffer:
            torch.testing.assert_close(lse, torch.logsumexp(hidden @ out.T, dim=-1), rtol=1e-5, atol=1e-5)
        kept = sum(len(t) for _, t, _ in drafter.buffer)
        assert 300 <= kept < 300 + 24 + 1 and drafter.buffered == kept  # the newest 300+ of 2 x 8 x 24 rows
        assert drafter.fresh == 8  # the second round's sequences, not trained on yet
        engine.update_weights(weights, version=2)
        assert sum(len(t) for _, t, _ in drafter.buffer) == kept  # kept for replay, not dropped
        assert engine.health()["spec_head_trainings"] == 2 and drafter.fresh == 0
        engine.update_weights(weights, version=3)  # nothing new: no training
        assert engine.health()["spec_head_trainings"] == 2


def test_the_draft_head_state_restores_into_a_new_engine():
    """What a run checkpoint keeps of the head (`drafter_state`): a new engine that loads it drafts at once
    and, on the same seeded requests, generates exactly what the engine that trained the head does (same
    weights, same drafts, same acceptance draws); a state that does not fit is refused by name."""
    ps = prompts([5, 9, 7, 12, 6, 10], seed=35)
    spec = SpeculativeConfig(drafter="draft_head", k=3, max_batch=None, draft_vocab=256)
    with make_engine(max_num_seqs=8, speculative=spec) as trained, \
            make_engine(max_num_seqs=8, speculative=spec) as fresh:
        assert trained.drafter_state() == {}  # untrained: nothing to keep
        weights = [(n, p.clone()) for n, p in trained.named_weights().items()]
        trained.generate(_requests(ps, temperature=1.0, max_new_tokens=20))
        trained.update_weights(weights, version=1)  # one training
        state = trained.drafter_state()
        assert int(state["trainings"]) == 1 and state["out"].shape == (256, trained.model.args.hidden_size)
        fresh.load_drafter_state(state)
        assert fresh.health()["spec_head_trainings"] == 1
        a = trained.generate(_requests(ps, temperature=1.0, max_new_tokens=20))
        b = fresh.generate(_requests(ps, temperature=1.0, max_new_tokens=20))
        assert fresh.health()["spec_passes"] > 0 and fresh.health()["spec_drafted"] > 0  # drafts at once
        assert [r.completions[0].token_ids for r in a] == [r.completions[0].token_ids for r in b]
        # the same drafts accepted (the trained engine's first round drafted nothing: untrained)
        assert fresh.health()["spec_accepted"] == trained.health()["spec_accepted"] > 0
        bad = dict(state, index=state["index"][:-1])  # another vocabulary
        with pytest.raises(ValueError, match=f"vocabulary of {trained.model.args.vocab_size - 1};"):
            fresh.load_drafter_state(bad)
        with pytest.raises(ValueError, match=r"lacks \['trainings'\]"):
            fresh.load_drafter_state({k: v for k, v in state.items() if k != "trainings"})
        assert fresh.health()["spec_head_trainings"] == 1  # refused: the head it had is kept
    with make_engine(speculative=SpeculativeConfig(drafter="ngram")) as ngram, pytest.raises(ValueError, match="no draft head"):
        ngram.load_drafter_state(state)


def test_bad_speculative_settings_are_refused():
    with pytest.raises(ValueError, match="speculative k=0 must be an integer in"):
        SpeculativeConfig(k=0)
    with pytest.raises(ValueError, match="drafter='eagle' is not one of"):
        SpeculativeConfig(drafter="eagle")
    with pytest.raises(ValueError, match="ngram_min=3, ngram_max=2"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="max_batch=0 must be >= 1"):
        SpeculativeConfig(max_batch=0)
    with pytest.raises(ValueError, match=r"head_unroll=0 \(1 .. 8\), head_replay=2.0 \(>= 0\): out of range"):
        SpeculativeConfig(head_unroll=0)
