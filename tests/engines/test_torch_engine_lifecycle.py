"""The torch engine's life cycle: weight updates, sleep/wake, abort, bad input, configuration."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

from tandem.core.protocols import FinishReason, GenerationRequest, SamplingParams
from tandem.engines.inference.torch import EngineAsleepError, TorchEngineConfig
from tandem.models import ModelConfig
from tandem.ops.linear import PackedOnlyWeight
from tests.engines.torch_helpers import make_engine, prompts, requests, wait_until

GREEDY = dict(temperature=0, max_new_tokens=16)


def _tokens(results):
    return [c.token_ids for r in results for c in r.completions]


def test_update_weights_changes_outputs_and_version():
    ps = prompts([8, 15], seed=20)
    with make_engine() as engine:
        before = engine.generate(requests(ps, **GREEDY))
        original = {k: v.clone() for k, v in engine.named_weights().items()}
        weight = engine.model.model.layers[0].mlp.down_proj.weight
        assert type(weight) is PackedOnlyWeight  # the default: its packed copy is the weight
        stored = engine._packed[id(weight)]
        g = torch.Generator().manual_seed(0)
        noisy = [
            (k, v + 0.2 * torch.randn(v.shape, generator=g)) for k, v in original.items() if "layers.0." in k
        ]
        engine.update_weights(noisy, version=1)
        after = engine.generate(requests(ps, **GREEDY))
        assert engine.weight_version == 1 and engine._packed[id(weight)] is stored  # packed in place
        engine.update_weights(original.items(), version=2)
        restored = engine.generate(requests(ps, **GREEDY))
    assert _tokens(after) != _tokens(before)
    assert all(c.weight_versions == [1] for r in after for c in r.completions)
    assert _tokens(restored) == _tokens(before)
    assert [c.log_probs for r in restored for c in r.completions] == [
        c.log_probs for r in before for c in r.completions
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))],
            r"shape \(3, 3\) != engine shape \(128, 64\)",
        ),
        ([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))], "unknown weight 'model.layers.9"),
    ],
)
def test_bad_weight_update_is_rejected_and_leaves_weights_untouched(bad, message):
    with make_engine() as engine:
        snapshot = {k: v.clone() for k, v in engine.named_weights().items()}
        good_first = [("model.norm.weight", torch.full((64,), 3.0))]  # valid, but must not be applied
        with pytest.raises(ValueError, match=message):
            engine.update_weights(good_first + bad, version=7)
        assert engine.weight_version == 0
        for k, v in engine.named_weights().items():
            assert torch.equal(v, snapshot[k]), k


def test_weight_update_during_generation_is_recorded_per_token():
    with make_engine(max_model_len=512) as engine:
        request = requests(prompts([5]), temperature=1.0, max_new_tokens=400, seed=1)[0]
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=engine.generate([request])[0]))
        thread.start()
        wait_until(lambda: engine.health()["generated_tokens"] >= 20)
        same = [(k, v.clone()) for k, v in engine.named_weights().items()]
        engine.update_weights(same, version=5)
        thread.join()
    c = result["r"].completions[0]
    assert c.weight_versions == [0, 5] and c.weight_version == 0
    assert len(c.token_ids) == 400


def test_sleep_frees_the_cache_and_wake_up_restores_identical_outputs():
    ps = prompts([12, 7], seed=21)
    sampling = dict(temperature=1.0, max_new_tokens=20, seed=8)
    with make_engine() as engine:
        before = engine.generate(requests(ps, **sampling))
        engine.sleep()
        health = engine.health()
        assert health["status"] == "sleeping" and health["kv_cache_bytes"] == 0 and engine.cache.k is None
        with pytest.raises(EngineAsleepError, match="call wake_up"):
            engine.generate(requests(ps, **sampling))
        engine.wake_up()
        after = engine.generate(requests(ps, **sampling))
        assert engine.health()["kv_cache_bytes"] > 0
    assert _tokens(after) == _tokens(before)
    assert [c.log_probs for r in after for c in r.completions] == [
        c.log_probs for r in before for c in r.completions
    ]


def test_sleep_refuses_while_requests_are_in_flight():
    with make_engine(max_model_len=512) as engine:
        future = engine._submit(requests(prompts([4]), temperature=1.0, max_new_tokens=400, seed=0)[0])
        with pytest.raises(EngineAsleepError, match=r"1 request\(s\) in flight"):
            engine.sleep()
        engine.abort_all()
        assert future.result(timeout=30).completions[0].finish_reason == FinishReason.ABORT


def test_abort_mid_decode_returns_the_partial_response():
    async def scenario(engine):
        long = GenerationRequest(
            prompt_token_ids=prompts([6])[0],
            sampling=SamplingParams(temperature=1.0, max_new_tokens=400, seed=2),
        )
        short = requests(prompts([9], seed=1), temperature=0, max_new_tokens=10)[0]
        task = asyncio.ensure_future(engine.agenerate(long))
        short_result = await engine.agenerate(short)

        async def forty_tokens():
            while engine.health()["generated_tokens"] < 40:
                await asyncio.sleep(0.002)

        await asyncio.wait_for(forty_tokens(), timeout=60)
        engine.abort(long.request_id)
        return await task, short_result

    with make_engine(max_model_len=512) as engine:
        aborted, short = asyncio.run(scenario(engine))
        assert engine.health()["running"] == 0 and engine.health()["free_slots"] == 8
    c = aborted.completions[0]
    assert c.finish_reason == FinishReason.ABORT
    assert 0 < len(c.token_ids) < 400 and len(c.log_probs) == len(c.token_ids)
    assert short.completions[0].finish_reason == FinishReason.LENGTH


def test_cancelling_agenerate_aborts_its_request():
    async def scenario(engine):
        request = requests(prompts([7]), temperature=1.0, max_new_tokens=400, seed=3)[0]
        task = asyncio.ensure_future(engine.agenerate(request))

        async def some_tokens():
            while engine.health()["generated_tokens"] < 10:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(some_tokens(), timeout=60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with make_engine(max_model_len=512) as engine:
        asyncio.run(scenario(engine))
        health = engine.health()
    assert health["running"] == 0 and health["free_slots"] == 8
    assert 10 <= health["generated_tokens"] < 400


def test_agenerate_callers_arriving_late_join_one_batch():
    """Callers that reach `agenerate` a few loop iterations apart (as through an HTTP stack) decode
    together: one driver steps once per loop iteration, so a late caller misses only those steps. If
    every waiting caller drove a step per iteration, the batch would run ahead by up to 8 steps per
    iteration and the late callers would decode alone afterwards."""
    n, new_tokens = 8, 16

    async def scenario(engine):
        async def late(i: int, request):
            for _ in range(i):  # caller i arrives i loop iterations after the first
                await asyncio.sleep(0)
            return await engine.agenerate(request)

        reqs = requests(prompts([6] * n), temperature=1.0, max_new_tokens=new_tokens, seed=0)
        return await asyncio.gather(*(late(i, r) for i, r in enumerate(reqs)))

    with make_engine(max_model_len=128) as engine:
        results = asyncio.run(scenario(engine))
        steps = engine.health()["steps"]
    assert all(len(r.completions[0].token_ids) == new_tokens for r in results)
    assert steps <= new_tokens + n, f"{steps} steps for {n} requests of {new_tokens} tokens"


def test_abort_all_covers_waiting_requests():
    with make_engine(max_num_seqs=1, max_model_len=512) as engine:
        reqs = requests(prompts([5, 6, 7]), temperature=1.0, max_new_tokens=400, seed=0)
        out = {}
        driver = threading.Thread(target=lambda: out.update(results=engine.generate(reqs)))
        driver.start()
        wait_until(lambda: engine.health()["generated_tokens"] >= 5)
        engine.abort_all()
        driver.join(timeout=60)
    results = out["results"]
    assert [r.completions[0].finish_reason for r in results] == [FinishReason.ABORT] * 3
    assert len(results[0].completions[0].token_ids) > 0
    assert results[2].completions[0].token_ids == []  # never admitted: nothing generated


def test_concurrent_generate_calls_from_threads_share_the_engine():
    ps = prompts([5, 9, 14, 3], seed=22)
    with make_engine(max_num_seqs=4) as engine:
        expected = [engine.generate(requests([p], temperature=0, max_new_tokens=40))[0] for p in ps]
        out = [None] * len(ps)

        def call(i):
            out[i] = engine.generate(requests([ps[i]], temperature=0, max_new_tokens=40))[0]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert [r.completions[0].token_ids for r in out] == [r.completions[0].token_ids for r in expected]


def test_bad_requests_fail_alone():
    good = requests(prompts([6]), **GREEDY)[0]
    bad = [
        GenerationRequest(prompt_token_ids=[]),
        GenerationRequest(prompt_token_ids=list(range(3, 3 + 256))),
        GenerationRequest(prompt_token_ids=[5, 600, 7]),
        GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(max_new_tokens=0)),
        GenerationRequest(prompt_token_ids=[5, 6], sampling={"temperature": 1.0, "top_q": 0.5}),
        GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(temperature=float("nan"))),
        GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(stop_token_ids=(512,))),
        GenerationRequest(prompt_token_ids=[5, 6], sampling={"temperature": "hot"}),
    ]
    messages = [
        "prompt_token_ids is empty",
        "prompt has 256 tokens; max_model_len=256 allows at most 255",
        r"token id 600 at position 1 is outside the vocabulary \[0, 512\)",
        "max_new_tokens=0 must be > 0",
        "unknown sampling key 'top_q'",
        "temperature=nan must be finite",
        r"stop token id 512 is outside the vocabulary \[0, 512\)",
        "temperature='hot' must be a number",
    ]
    with make_engine() as engine:
        results = engine.generate(bad[:3] + [good] + bad[3:])
        dict_ok = engine.generate(
            [GenerationRequest(prompt_token_ids=[5, 6], sampling={"temperature": 0, "max_new_tokens": 3})]
        )
        assert engine.health()["status"] == "ok"
    ok = results.pop(3)
    assert ok.error is None and len(ok.completions[0].token_ids) == 16
    for res, message in zip(results, messages, strict=True):
        [c] = res.completions
        assert c.finish_reason == FinishReason.ERROR and c.token_ids == []
        assert res.error == c.error
        assert re.search(message, res.error), (message, res.error)
    assert len(dict_ok[0].completions[0].token_ids) == 3


def test_duplicate_request_id_in_flight_is_rejected():
    with make_engine(max_model_len=512) as engine:
        first = GenerationRequest(
            prompt_token_ids=[5, 6], sampling=SamplingParams(max_new_tokens=300, seed=0), request_id="x"
        )
        second = GenerationRequest(
            prompt_token_ids=[5, 6], sampling=SamplingParams(max_new_tokens=3), request_id="x"
        )
        results = engine.generate([first, second])
    assert len(results[0].completions[0].token_ids) == 300
    assert results[1].error == "request_id 'x' is already in flight"


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving():
    with make_engine() as engine:
        forward = engine.model.forward

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault")

        engine.model.forward = broken
        [failed] = engine.generate(requests(prompts([5]), **GREEDY))
        engine.model.forward = forward
        [ok] = engine.generate(requests(prompts([5]), **GREEDY))
        health = engine.health()
    assert failed.completions[0].finish_reason == FinishReason.ERROR
    assert "injected fault" in failed.error and "injected fault" in health["last_error"]
    assert len(ok.completions[0].token_ids) == 16 and health["free_slots"] == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_seqs=0), "max_num_seqs=0 must be >= 1"),
        (dict(max_model_len=1), "max_model_len=1 must be >= 2"),
        (dict(max_model_len=100, kv_cache_tokens=50), "kv_cache_tokens=50 must be >= max_model_len=100"),
        (dict(prefill_chunk=0), "prefill_chunk=0 must be >= 1"),
        (dict(num_threads=0), "num_threads=0 must be >= 1"),
        (dict(device="tpu"), "device='tpu' must be 'cpu' or 'cuda'"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TorchEngineConfig(model=ModelConfig(name="tiny-llama"), **kwargs)


def test_engine_rejects_a_context_longer_than_the_model():
    from tandem.engines.inference.torch import TorchEngine

    with pytest.raises(
        ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=1024"
    ):
        TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-llama"), max_model_len=4096))
    with pytest.raises(ValueError, match="TorchEngineConfig.model is None"):
        TorchEngine(TorchEngineConfig())
    with pytest.raises(ValueError, match="holds no sequence slot of 128 tokens"):
        TorchEngine(
            TorchEngineConfig(
                model=ModelConfig(name="tiny-llama"),
                max_model_len=100,
                kv_cache_tokens=120,
                deterministic=True,
            )
        )
