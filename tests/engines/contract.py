"""The inference-engine contract: protocol-level behaviour every `InferenceEngine` adapter must show.

A test module subclasses `InferenceEngineContract` (pytest collects the inherited tests) and provides a
module-scoped ``case`` fixture returning an `EngineCase`: the engine, the folder of the model it runs
(the teacher-forced reference reads the same weights), and the log-prob tolerance measured for it.
Tests leave the engine as they found it (weights restored, nothing in flight), so one engine serves a
whole module. Versions only rise: tests read ``engine.weight_version`` instead of assuming 0.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.core.protocols import (
    CapabilityError,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    InferenceEngine,
    LoRAEngine,
    SamplingParams,
    ScoringEngine,
    WeightsView,
)
from tests.engines.torch_helpers import prompts, requests, teacher_forced, wait_until


@dataclass
class EngineCase:
    engine: Any
    model_path: Path  # the HF folder the engine runs (reference weights and teacher-forced model)
    max_model_len: int
    vocab_size: int
    logprob_atol: float  # |engine log-prob - teacher-forced log-prob| bound, measured per engine
    _reference: Any = None

    def reference(self):
        """Tandem's native model on the same weights, float32 (the teacher-forced oracle)."""
        if self._reference is None:
            from tandem.models.transformer import CausalLM

            self._reference = CausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        return self._reference

    def reference_with(self, weights: dict[str, torch.Tensor]):
        """The native model of this folder holding ``weights`` (HF names) instead, float32."""
        from tandem.models.transformer import CausalLM

        model = CausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, t in model.hf_state_dict().items():
                t.copy_(weights[name])
        return model

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The model folder's weights by HF name (what a trainer at step 0 would send)."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in sorted(self.model_path.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out


def _tokens(results):
    return [c.token_ids for r in results for c in r.completions]


def _log_probs(results):
    return [c.log_probs for r in results for c in r.completions]


def _noisy(weights: dict[str, torch.Tensor], scale: float = 0.3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(k, v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)) for k, v in weights.items()]


class InferenceEngineContract:
    """Inherited by one test class per engine (see the module docstring)."""

    def test_satisfies_the_protocol(self, case):
        engine = case.engine
        assert isinstance(engine, InferenceEngine)
        health = engine.health()
        assert health["status"] == "ok" and health["weight_version"] == engine.weight_version

    def test_info_describes_the_engine_and_its_flags_hold(self, case):
        """`EngineInfo` is constant and true: each capability flag comes with its working methods."""
        engine, info = case.engine, case.engine.info
        assert isinstance(info, EngineInfo) and engine.info == info
        assert info.max_context == case.max_model_len and info.vocab_size == case.vocab_size
        assert info.dtype in ("float32", "bfloat16", "float16") and info.name
        assert isinstance(engine, ScoringEngine) if info.can_score else True
        assert isinstance(engine, LoRAEngine) if info.lora_adapters else True
        if info.can_score:  # the prefill log-probs of a generated response are the decode ones (tolerance)
            p = prompts([9], seed=31, vocab=case.vocab_size)[0]
            [r] = engine.generate(requests([p], temperature=1.0, max_new_tokens=12, seed=3))
            [scored] = engine.score([(p + r.completions[0].token_ids, len(p))], temperature=1.0)
            torch.testing.assert_close(torch.tensor(scored), torch.tensor(r.completions[0].log_probs), rtol=0,
                                       atol=max(case.logprob_atol, 1e-4))
        if info.exposes_weights:  # named_weights are the live weights by HF name
            assert isinstance(engine, WeightsView)
            weights, checkpoint = engine.named_weights(), case.checkpoint()
            assert set(checkpoint) <= set(weights)
            name = next(iter(checkpoint))
            torch.testing.assert_close(weights[name].float(), checkpoint[name].float())
        if not info.routed_experts:  # a request for routed experts fails alone, with the reason
            [res] = engine.generate([GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(
                max_new_tokens=2, return_routed_experts=True))])
            assert res.completions[0].finish_reason == FinishReason.ERROR and "routed experts" in res.error

    @pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
    def test_logprobs_match_a_teacher_forced_forward(self, case, temperature):
        """The returned log-prob is log_softmax(logits / T) of the sampled token (T = 1 when greedy)."""
        ps = prompts([3, 30, 11, 17], seed=2, vocab=case.vocab_size)
        n = 1 if temperature == 0 else 2
        results = case.engine.generate(requests(ps, temperature=temperature, n=n, max_new_tokens=20, seed=5))
        pairs = [(p, c.token_ids) for p, r in zip(ps, results, strict=True) for c in r.completions]
        expected = teacher_forced(case.reference(), pairs, temperature=temperature or 1.0)
        for (_p, r), c, ref in zip(pairs, [c for res in results for c in res.completions], expected, strict=True):
            assert len(r) == 20 and len(c.log_probs) == 20 and c.finish_reason == FinishReason.LENGTH
            torch.testing.assert_close(torch.tensor(c.log_probs), ref, rtol=0, atol=case.logprob_atol)
        if temperature == 0:  # greedy picks the most likely token (up to the tolerance)
            best = _best_log_probs(case.reference(), pairs)
            for c, b in zip([c for res in results for c in res.completions], best, strict=True):
                assert (torch.tensor(c.log_probs) >= b - 2 * case.logprob_atol).all()

    def test_n_samples_are_independent_and_seeded(self, case):
        prompt = prompts([12], seed=7, vocab=case.vocab_size)[0]
        engine = case.engine
        [a] = engine.generate(requests([prompt], temperature=1.0, n=4, max_new_tokens=12, seed=9))
        [b] = engine.generate(requests([prompt], temperature=1.0, n=4, max_new_tokens=12, seed=9))
        [c] = engine.generate(requests([prompt], temperature=1.0, n=4, max_new_tokens=12, seed=10))
        [g] = engine.generate(requests([prompt], temperature=0, n=3, max_new_tokens=12))
        assert len(a.completions) == 4 and len({tuple(x.token_ids) for x in a.completions}) == 4
        assert _tokens([a]) == _tokens([b])  # same seed, same samples
        torch.testing.assert_close(torch.tensor(_log_probs([a])), torch.tensor(_log_probs([b])), rtol=0,
                                   atol=case.logprob_atol)
        assert _tokens([c]) != _tokens([a])
        assert len({tuple(x.token_ids) for x in g.completions}) == 1  # greedy samples agree

    def test_stop_tokens_and_the_context_limit(self, case):
        engine, limit = case.engine, case.max_model_len
        p = prompts([10], seed=11, vocab=case.vocab_size)
        [free] = engine.generate(requests(p, temperature=0, max_new_tokens=20))
        stop_at = free.completions[0].token_ids[4]
        [stopped] = engine.generate(requests(p, temperature=0, max_new_tokens=20, stop_token_ids=(stop_at,)))
        [capped] = engine.generate(requests(prompts([limit - 10], seed=12, vocab=case.vocab_size),
                                            temperature=0, max_new_tokens=50))
        c = stopped.completions[0]
        first = free.completions[0].token_ids.index(stop_at)
        assert c.finish_reason == FinishReason.STOP and c.token_ids == free.completions[0].token_ids[: first + 1]
        assert capped.completions[0].finish_reason == FinishReason.LENGTH
        assert len(capped.completions[0].token_ids) == 10  # prompt + response fill max_model_len

    def test_agenerate_calls_run_concurrently_and_match_generate(self, case):
        ps = prompts([5, 12, 20, 8], seed=9, vocab=case.vocab_size)

        async def run_all():
            return await asyncio.gather(
                *(case.engine.agenerate(r) for r in requests(ps, temperature=0, max_new_tokens=30))
            )

        results = asyncio.run(run_all())
        blocking = case.engine.generate(requests(ps, temperature=0, max_new_tokens=30))
        assert _tokens(results) == _tokens(blocking)

    def test_abort_mid_decode_returns_the_partial_response(self, case):
        engine = case.engine
        long_ = GenerationRequest(prompt_token_ids=prompts([6], vocab=case.vocab_size)[0],
                                  sampling=SamplingParams(temperature=1.0, max_new_tokens=200, seed=2))
        short = requests(prompts([9], seed=1, vocab=case.vocab_size), temperature=0, max_new_tokens=10)[0]

        async def scenario():
            start = engine.health()["generated_tokens"]
            task = asyncio.ensure_future(engine.agenerate(long_))
            short_result = await engine.agenerate(short)

            async def some_tokens():
                while engine.health()["generated_tokens"] < start + 20:
                    await asyncio.sleep(0.002)

            await asyncio.wait_for(some_tokens(), timeout=60)
            engine.abort(long_.request_id)
            return await asyncio.wait_for(task, timeout=60), short_result

        aborted, short_result = asyncio.run(scenario())
        c = aborted.completions[0]
        assert c.finish_reason == FinishReason.ABORT
        assert 0 < len(c.token_ids) < 200 and len(c.log_probs) == len(c.token_ids)
        assert short_result.completions[0].finish_reason == FinishReason.LENGTH
        wait_until(lambda: engine.health()["running"] == 0, timeout=30)

    def test_cancelling_agenerate_aborts_its_request(self, case):
        engine = case.engine

        async def scenario():
            start = engine.health()["generated_tokens"]
            request = requests(prompts([7], vocab=case.vocab_size), temperature=1.0, max_new_tokens=200, seed=3)[0]
            task = asyncio.ensure_future(engine.agenerate(request))
            while engine.health()["generated_tokens"] < start + 5:
                await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return start

        start = asyncio.run(scenario())
        wait_until(lambda: engine.health()["running"] == 0, timeout=30)
        assert engine.health()["generated_tokens"] - start < 200

    def test_abort_all_from_another_thread(self, case):
        engine = case.engine
        reqs = requests(prompts([5, 6, 7], vocab=case.vocab_size), temperature=1.0, max_new_tokens=200, seed=0)
        out: dict[str, Any] = {}
        start = engine.health()["generated_tokens"]
        driver = threading.Thread(target=lambda: out.update(results=engine.generate(reqs)))
        driver.start()
        wait_until(lambda: engine.health()["generated_tokens"] >= start + 5)
        engine.abort_all()
        driver.join(timeout=60)
        assert not driver.is_alive()
        results = out["results"]
        assert [r.completions[0].finish_reason for r in results] == [FinishReason.ABORT] * 3
        assert all(len(r.completions[0].token_ids) < 200 for r in results)

    def test_bad_requests_fail_alone(self, case):
        vocab, limit = case.vocab_size, case.max_model_len
        good = requests(prompts([6], vocab=vocab), temperature=0, max_new_tokens=16)[0]
        bad = [
            (GenerationRequest(prompt_token_ids=[]), "prompt_token_ids is empty"),
            (GenerationRequest(prompt_token_ids=list(range(3, 3 + limit))),
             f"prompt has {limit} tokens; max_model_len={limit} allows at most {limit - 1}"),
            (GenerationRequest(prompt_token_ids=[5, vocab + 88, 7]),
             rf"token id {vocab + 88} at position 1 is outside the vocabulary \[0, {vocab}\)"),
            (GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(max_new_tokens=0)),
             "max_new_tokens=0 must be > 0"),
            (GenerationRequest(prompt_token_ids=[5, 6], sampling={"temperature": 1.0, "top_q": 0.5}),
             "unknown sampling key 'top_q'"),
            (GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(temperature=float("nan"))),
             "temperature=nan must be finite"),
            (GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(stop_token_ids=(vocab,))),
             rf"stop token id {vocab} is outside the vocabulary \[0, {vocab}\)"),
            (GenerationRequest(prompt_token_ids=[5, 6], sampling={"temperature": "hot"}),
             "temperature='hot' must be a number"),
        ]
        results = case.engine.generate([r for r, _ in bad[:3]] + [good] + [r for r, _ in bad[3:]])
        ok = results.pop(3)
        assert ok.error is None and len(ok.completions[0].token_ids) == 16
        for res, (_, message) in zip(results, bad, strict=True):
            [c] = res.completions
            assert c.finish_reason == FinishReason.ERROR and c.token_ids == []
            assert res.error == c.error and re.search(message, res.error), (message, res.error)
        assert case.engine.health()["status"] == "ok"

    def test_duplicate_request_id_in_flight_is_rejected(self, case):
        first = GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(max_new_tokens=100, seed=0),
                                  request_id="dup")
        second = GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(max_new_tokens=3),
                                   request_id="dup")
        results = case.engine.generate([first, second])
        assert len(results[0].completions[0].token_ids) == 100
        assert results[1].error == "request_id 'dup' is already in flight"

    def test_update_weights_changes_outputs_and_restoring_restores_them_exactly(self, case):
        engine = case.engine
        ps = prompts([8, 15], seed=20, vocab=case.vocab_size)
        sampled = dict(temperature=1.0, max_new_tokens=16, seed=4)
        original = case.checkpoint()
        v = engine.weight_version
        before = engine.generate(requests(ps, temperature=0, max_new_tokens=16) + requests(ps, **sampled))
        noisy = _noisy(original)
        engine.update_weights(noisy, version=v + 1)
        assert engine.weight_version == v + 1
        after = engine.generate(requests(ps, temperature=0, max_new_tokens=16) + requests(ps, **sampled))
        # every weight took effect (tied output head included): log-probs are the new model's
        reference = case.reference_with(dict(noisy))
        pairs = [(p, c.token_ids) for p, r in zip(ps + ps, after, strict=True) for c in r.completions]
        for c, ref in zip([c for r in after for c in r.completions], teacher_forced(reference, pairs), strict=True):
            torch.testing.assert_close(torch.tensor(c.log_probs), ref, rtol=0, atol=case.logprob_atol)
        after = after[:2]
        engine.update_weights(original.items(), version=v + 2)
        restored = engine.generate(requests(ps, temperature=0, max_new_tokens=16) + requests(ps, **sampled))
        assert _tokens(after) != _tokens(before[:2])
        assert all(c.weight_versions == [v + 1] for r in after for c in r.completions)
        assert all(c.weight_versions == [v + 2] for r in restored for c in r.completions)
        assert _tokens(restored) == _tokens(before)
        assert _log_probs(restored) == _log_probs(before)  # bit for bit

    def test_a_rejected_weight_update_leaves_the_engine_untouched(self, case):
        engine = case.engine
        original = case.checkpoint()
        ps = prompts([8], seed=21, vocab=case.vocab_size)
        before = engine.generate(requests(ps, temperature=0, max_new_tokens=12))
        v = engine.weight_version
        name = next(k for k in original if k.endswith("mlp.up_proj.weight"))
        broken = [(k, torch.zeros(3, 3) if k == name else t + 1.0) for k, t in original.items()]
        with pytest.raises(ValueError, match=rf"{re.escape(name)}: shape \(3, 3\) != engine shape"):
            engine.update_weights(broken, version=v + 1)
        assert engine.weight_version == v
        assert _tokens(engine.generate(requests(ps, temperature=0, max_new_tokens=12))) == _tokens(before)

    def test_a_weight_update_during_generation_is_recorded_per_token(self, case):
        engine = case.engine
        original = case.checkpoint()
        v = engine.weight_version
        request = requests(prompts([5], vocab=case.vocab_size), temperature=1.0, max_new_tokens=200, seed=1)[0]
        result: dict[str, Any] = {}
        start = engine.health()["generated_tokens"]
        thread = threading.Thread(target=lambda: result.update(r=engine.generate([request])[0]))
        thread.start()
        wait_until(lambda: engine.health()["generated_tokens"] >= start + 20)
        engine.update_weights(original.items(), version=v + 5)  # the same weights, a new version
        thread.join(timeout=60)
        c = result["r"].completions[0]
        assert c.weight_versions == [v, v + 5] and c.weight_version == v
        assert len(c.token_ids) == 200

    def test_sleep_and_wake_up_or_a_clear_refusal(self, case):
        engine = case.engine
        ps = prompts([12, 7], seed=21, vocab=case.vocab_size)
        sampling = dict(temperature=1.0, max_new_tokens=20, seed=8)
        before = engine.generate(requests(ps, **sampling))
        if not engine.info.can_sleep:
            with pytest.raises(CapabilityError, match="not supported on this device"):
                engine.sleep()
        else:
            engine.sleep()
            assert engine.health()["status"] == "sleeping"
            with pytest.raises(RuntimeError, match="call wake_up"):
                engine.generate(requests(ps, **sampling))
            engine.wake_up()
        after = engine.generate(requests(ps, **sampling))
        assert engine.health()["status"] == "ok"
        assert _tokens(after) == _tokens(before)


def _best_log_probs(model, pairs) -> list[torch.Tensor]:
    """Per position, the largest log-prob over the vocabulary under a teacher-forced forward."""
    from tandem.models.attention import VarlenAttention

    out = []
    for p, r in pairs:
        ids = torch.tensor(p + r)
        with torch.no_grad():
            hidden = model(ids, torch.arange(len(ids)), VarlenAttention.from_lengths([len(ids)]))
        logits = model.logits(hidden)[len(p) - 1 : len(ids) - 1].float()
        out.append(torch.log_softmax(logits, -1).max(-1).values)
    return out
