"""The SGLang adapter against the embedded engine serving SGLang's native API (``tandem serve --api sglang``).

No test here runs real SGLang (it does not install on these machines): the adapter talks HTTP to embedded-
engine servers started as subprocesses, so the wire format, the adapter and the server are real; what only
real SGLang could answer (its kernels, its own log-prob convention, GPU memory release) is listed in
docs/sglang.md. The shared inference contract runs first; then what is SGLang's own: the API on the wire
(fields, 400s naming the value), broadcast weight updates (gloo), pause/continue, LoRA by path, routed
experts on the tiny MoE, and the failures: server down, 4xx/5xx, timeouts, a server of another version.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import torch

from tandem.core.protocols import FinishReason, GenerationRequest, SamplingParams
from tandem.engines.inference.sglang import SGLangServerError
from tandem.engines.inference.sglang.config import SGLangEngineConfig
from tandem.engines.inference.sglang.launch import launch_command
from tandem.models import ModelConfig, resolve_model
from tests.engines.contract import EngineCase, InferenceEngineContract
from tests.engines.sglang_helpers import MAX_MODEL_LEN, adapter, failing_app, sglang_server, stub_server
from tests.engines.torch_helpers import prompts, requests, teacher_forced, wait_until


@pytest.fixture(scope="module")
def server():
    with sglang_server() as url:
        yield url


@pytest.fixture(scope="module")
def case(server):
    engine = adapter(server)
    yield EngineCase(engine=engine, model_path=resolve_model("tiny-llama"), max_model_len=MAX_MODEL_LEN,
                     vocab_size=512, logprob_atol=2e-5)
    engine.close()


class TestSGLangAdapterContract(InferenceEngineContract):
    pass


# -- the API on the wire ------------------------------------------------------------------------------------


def test_generate_speaks_sglang_fields(server):
    """One prompt, one sample: one object with output_ids and meta_info (SGLang 0.5's names); n = 2: a list."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "rid": "a"}
    out = httpx.post(f"{server}/generate", json=body, timeout=60).json()
    meta = out["meta_info"]
    assert meta["id"] == "a" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert [row[1] for row in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["weight_versions"][0]["start"] == 0 and meta["weight_version"] == meta["weight_versions"][-1]["version"]
    many = httpx.post(f"{server}/generate", json=body | {"sampling_params": {"n": 2, "max_new_tokens": 3,
                                                                             "sampling_seed": 1}}, timeout=60).json()
    assert isinstance(many, list) and len(many) == 2 and [m["meta_info"]["id"] for m in many] == ["a_0", "a_1"]
    info = httpx.get(f"{server}/get_server_info", timeout=10).json()
    assert info["version"] == "0.5.23" and info["context_length"] == MAX_MODEL_LEN
    assert httpx.get(f"{server}/health_generate", timeout=30).status_code == 200
    assert httpx.post(f"{server}/flush_cache", timeout=10).status_code == 200


@pytest.mark.parametrize(("body", "message"), [
    ({}, "input_ids=None must be a non-empty list"),
    ({"text": "hello"}, "text='hello' is not supported"),
    ({"input_ids": [5], "stream": True}, "stream=True is not supported"),
    ({"input_ids": [5], "image_data": "x.png"}, "field image_data='x.png' is not supported"),
    ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "top_k must be -1 \\(disable\\) or at least 1, got 0"),
    ({"input_ids": [5], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty=0.5 is not supported"),
    ({"input_ids": [5], "sampling_params": {"top_q": 0.5}}, "unknown key 'top_q'"),
    ({"input_ids": [5], "sampling_params": {"temperature": "hot"}}, "temperature='hot' must be a number"),
    ({"input_ids": [5, 9999]}, "token id 9999 at position 1 is outside the vocabulary"),
    ({"input_ids": [[5], [6]], "rid": ["x", "x"]}, "Duplicate request IDs"),
    ({"input_ids": [5], "sampling_params": {"n": "two"}}, "n='two' must be an integer in \\[1, 1024\\]"),
    ({"input_ids": [5], "sampling_params": {"n": 0}}, "n=0 must be an integer"),
    ({"input_ids": [[5], ["a"]]}, "prompt_token_ids must be a list of ints"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens='many' must be an integer"),
    ({"input_ids": [5], "return_routed_experts": True}, "return_routed_experts=True but this engine returns no"),
    ({"input_ids": [5], "lora_path": "nope"}, "nope"),
    ({"input_ids": [5], "sampling_params": [{}, {}]}, "sampling_params must be an object or a list of 1 objects"),
])
def test_bad_generate_bodies_get_a_400_naming_the_value(server, body, message):
    r = httpx.post(f"{server}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()


def test_bad_control_bodies_get_a_400(server):
    for path, body, message in [
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "is not a folder"),
        ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "v7"}, "'v7' is not an integer"),
        ("/pause_generation", {"mode": "retract"}, "mode='retract' is not supported"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags=\\['gpu'\\]"),
        ("/abort_request", {"rid": 5}, "rid=5 must be a request id"),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, "not a peft adapter folder"),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "no group"),
        ("/load_lora_adapter", {"lora_name": "x"}, "lora_path=None must be strings"),
        ("/unload_lora_adapter", {"lora_name": 3}, "lora_name=3 must be a string"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                        "world_size": 2, "backend": "gloo"}, "init_weights_update_group failed"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                        "world_size": 2, "backend": "gloo"}, "rank_offset=0 must be in"),
        ("/update_weights_from_disk", {"model_path": 7}, "model_path=7 is not a folder"),
        ("/pause_generation", {"mode": "abort", "extra": 1}, "unknown field 'extra'"),
    ]:
        r = httpx.post(f"{server}{path}", json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert re.search(message, r.text), (path, r.text)
    assert httpx.post(f"{server}/generate", content=b"{not json", timeout=10).status_code == 400


# -- what the adapter adds on SGLang's API --------------------------------------------------------------------


def test_broadcast_weight_updates_reach_the_server(case, server):
    """weight_transport: distributed (gloo here): the same tokens and log-probs as the same update from disk."""
    ps = prompts([8, 13], seed=40)
    noisy = [(k, v + 0.2 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)))
             for k, v in case.checkpoint().items()]
    engine = case.engine
    v = engine.weight_version
    engine.update_weights(noisy, version=v + 1)
    by_disk = engine.generate(requests(ps, temperature=1.0, max_new_tokens=10, seed=3))
    engine.update_weights(case.checkpoint().items(), version=v + 2)
    broadcaster = adapter(server, weight_transport="distributed")
    try:
        broadcaster.update_weights(noisy, version=v + 3)
        by_broadcast = broadcaster.generate(requests(ps, temperature=1.0, max_new_tokens=10, seed=3))
        assert [c.token_ids for r in by_broadcast for c in r.completions] == \
               [c.token_ids for r in by_disk for c in r.completions]
        assert all(c.weight_versions == [v + 3] for r in by_broadcast for c in r.completions)
        broadcaster.update_weights(case.checkpoint().items(), version=v + 4)  # a second update, same group
    finally:
        broadcaster.close()
    engine.update_weights(case.checkpoint().items(), version=v + 5)


def _generating(engine, prompt: list[int], max_new_tokens: int, *, seed: int) -> tuple[dict, threading.Thread]:
    """A long request generating in a thread (``out["long"]`` once it returns), past its first 10 tokens."""
    out: dict = {}
    [request] = requests([prompt], temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    start = engine.health()["generated_tokens"]
    thread = threading.Thread(target=lambda: out.update(long=engine.generate([request])[0]))
    thread.start()
    wait_until(lambda: engine.health()["generated_tokens"] >= start + 10)
    return out, thread


def test_pause_aborts_running_requests_and_holds_new_ones_until_continue(case):
    engine = case.engine
    out, thread = _generating(engine, prompts([6], seed=3)[0], 200, seed=2)
    engine.pause_generation()
    thread.join(timeout=60)
    assert out["long"].completions[0].finish_reason == FinishReason.ABORT
    held = threading.Thread(target=lambda: out.update(held=engine.generate(requests(prompts([4]), max_new_tokens=3))))
    held.start()
    time.sleep(0.5)
    assert "held" not in out  # waits while paused
    engine.continue_generation()
    held.join(timeout=60)
    assert out["held"][0].error is None and len(out["held"][0].completions[0].token_ids) == 3
    with pytest.raises(ValueError, match="mode='retract' is not supported"):
        engine.pause_generation("retract")


def test_in_place_pause_holds_running_requests_with_their_cache_until_continue(case, server):
    """mode in_place: a running request makes no progress while paused and finishes after continue,
    with the tokens it had (no abort, no recompute); new requests wait at the door."""
    engine = case.engine
    out, thread = _generating(engine, prompts([6], seed=4)[0], 120, seed=5)
    engine.pause_generation("in_place")
    try:
        held_at = engine.health()["generated_tokens"]
        time.sleep(0.5)
        assert engine.health()["generated_tokens"] == held_at and engine.health()["paused"]
        assert "long" not in out
    finally:
        engine.continue_generation()
    thread.join(timeout=60)
    c = out["long"].completions[0]
    assert c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 120


def test_weight_updates_pause_the_servers_in_place_and_in_flight_requests_continue_on_the_new_weights(case, server):
    """The adapter wraps an update in /pause_generation (in_place) + /continue_generation: a request in flight
    keeps its tokens and finishes on the new weights (partial rollout: two versions in its completion)."""
    engine = case.engine
    pauses = httpx.get(f"{server}/get_server_info", timeout=10).json()["tandem"]["pauses"]
    v = engine.weight_version
    out, thread = _generating(engine, prompts([7], seed=6)[0], 150, seed=7)
    engine.update_weights(case.checkpoint().items(), version=v + 1)
    thread.join(timeout=60)
    c = out["long"].completions[0]
    assert c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 150
    assert c.weight_versions == [v, v + 1]
    assert httpx.get(f"{server}/get_server_info", timeout=10).json()["tandem"]["pauses"] == pauses + 1
    assert not engine.health()["paused"]
    quiet = adapter(server, pause_on_update="none")
    try:
        quiet.update_weights(case.checkpoint().items(), version=v + 2)
    finally:
        quiet.close()
    assert httpx.get(f"{server}/get_server_info", timeout=10).json()["tandem"]["pauses"] == pauses + 1


def test_a_lora_adapter_loaded_by_path_serves_requests_that_name_it(case, tmp_path):
    """/load_lora_adapter with a peft folder; requests with lora=name use it: the log-probs are those of a
    teacher-forced forward with the adapter merged into the weights."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    weights = case.checkpoint()
    name = "model.layers.0.self_attn.q_proj"
    out_dim, in_dim = weights[f"{name}.weight"].shape
    a, b = 0.5 * torch.randn(4, in_dim, generator=g), 0.5 * torch.randn(out_dim, 4, generator=g)
    save_file({f"base_model.model.{name}.lora_A.weight": a, f"base_model.model.{name}.lora_B.weight": b},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0,
                                                              "target_modules": ["q_proj"]}))
    case.engine.load_lora_adapter_from_path("mine", str(tmp_path))
    p = prompts([9], seed=5)
    [tuned] = case.engine.generate([GenerationRequest(prompt_token_ids=p[0], lora="mine", sampling=SamplingParams(
        temperature=1.0, max_new_tokens=12, seed=1))])
    merged = dict(weights)
    merged[f"{name}.weight"] = weights[f"{name}.weight"] + (8.0 / 4) * b @ a
    [ref] = teacher_forced(case.reference_with(merged), [(p[0], tuned.completions[0].token_ids)])
    torch.testing.assert_close(torch.tensor(tuned.completions[0].log_probs), ref, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="not a peft adapter folder"):
        case.engine.load_lora_adapter_from_path("other", str(tmp_path / "missing"))


def test_routed_experts_of_the_tiny_moe_come_back_as_the_router_chose():
    """On an MoE model the adapter asks for routed experts; they are the router's own top-k of a
    teacher-forced forward ([prompt + response - 1, layers, topk])."""
    with sglang_server("tiny-qwen3-moe") as url:
        engine = adapter(url, model="tiny-qwen3-moe")
        try:
            assert engine.info.routed_experts and engine.info.moe
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(str(resolve_model("tiny-qwen3-moe"))).vocab_size
            p = prompts([7], seed=2, vocab=vocab)[0]
            [r] = engine.generate([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
                temperature=0, max_new_tokens=6, return_routed_experts=True))])
            c = r.completions[0]
            assert r.error is None, r.error
            from tandem.models.transformer import CausalLM

            model = CausalLM.from_pretrained(resolve_model("tiny-qwen3-moe"), dtype=torch.float32).eval()
            _lp, [routes] = teacher_forced(model, [(p, c.token_ids)], routing=True)
            assert c.routed_experts.shape == routes.shape == (len(p) + 6 - 1, len(engine.info.moe_layers),
                                                              routes.shape[2])
            assert (c.routed_experts == routes).mean() > 0.99  # fp ties aside, the same experts
        finally:
            engine.close()


# -- failures ---------------------------------------------------------------------------------------------------


def test_a_server_of_another_version_is_refused_with_the_reason(server):
    with pytest.raises(SGLangServerError, match=r"runs SGLang 0\.5\.23, but this adapter speaks the API of SGLang "
                                                r"0\.4\.\*"):
        adapter(server, sglang_version="0.4.*")
    with stub_server(failing_app(version="0.6.0")) as url, pytest.raises(SGLangServerError, match="runs SGLang 0.6.0"):
        adapter(url)


def test_a_server_that_is_down_is_reported_at_start_and_per_request():
    from tests.serve_helpers import free_port

    with pytest.raises(SGLangServerError, match="unreachable"):
        adapter(f"http://127.0.0.1:{free_port()}")
    with sglang_server() as url:
        engine = adapter(url)
    # the server has stopped: requests fail alone with the reason, health says so, nothing hangs
    [r] = engine.generate(requests(prompts([5]), max_new_tokens=4))
    assert r.completions[0].finish_reason == FinishReason.ERROR and "unreachable" in r.error
    assert engine.health()["status"] == "error"
    with pytest.raises(SGLangServerError, match="unreachable"):
        engine.update_weights([("x", torch.zeros(1))], version=1)
    engine.close()


def test_5xx_and_timeouts_fail_the_request_with_the_server_message():
    with stub_server(failing_app(generate_status=503)) as url:
        engine = adapter(url)
        [r] = engine.generate(requests(prompts([5]), max_new_tokens=4))
        assert "answered 503 to /generate: CUDA out of memory (stub)" in r.error
        with pytest.raises(SGLangServerError, match="answered 500 to /update_weights_from_disk: internal failure"):
            engine.update_weights([("x", torch.zeros(1))], version=1)
        assert engine.weight_version == 0
        engine.close()
    with stub_server(failing_app(generate_delay_s=3.0)) as url:
        engine = adapter(url, request_timeout_s=0.5)
        t0 = time.monotonic()
        [r] = engine.generate(requests(prompts([5]), max_new_tokens=4))
        assert "timed out after 0.5 s" in r.error and time.monotonic() - t0 < 2.5
        engine.close()


# -- launching SGLang (only the command: SGLang itself cannot run here) ------------------------------------------


def test_launch_command_passes_server_args_through_and_guards_tandems_own():
    config = SGLangEngineConfig(model=ModelConfig(name="tiny-llama", dtype="bfloat16"), max_model_len=512, seed=3,
                                server_args={"mem_fraction_static": 0.5, "enable_deterministic_inference": True,
                                             "disable_radix_cache": False})
    argv = launch_command(config, resolve_model("tiny-llama"), 30001, routed_experts=False)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(argv)
    for part in ("--dtype bfloat16", "--context-length 512", "--random-seed 3", "--port 30001",
                 "--skip-tokenizer-init", "--mem-fraction-static 0.5", "--enable-deterministic-inference"):
        assert part in joined
    assert "radix" not in joined and "--enable-return-routed-experts" not in joined
    with pytest.raises(ValueError, match=r"server_args\['context_length'\] is set by the adapter: use "
                                         "SGLangEngineConfig.max_model_len"):
        SGLangEngineConfig(server_args={"context_length": 4})
    with pytest.raises(ValueError, match="apply only when the adapter launches SGLang"):
        SGLangEngineConfig(urls=["http://127.0.0.1:1"], server_args={"tp_size": 2})


def test_launch_embedded_starts_replicas_the_adapter_spreads_requests_over_and_stops_them():
    """launch: embedded (no SGLang, no servers started by hand): the adapter starts `tandem serve --api sglang`
    replicas from a recipe of its own, sends requests to both, and stops them on close."""
    engine = adapter([], launch="embedded", replicas=2, server_args={"deterministic": True, "max_num_seqs": 4})
    try:
        assert len(engine.urls) == 2 and engine.info.deterministic
        results = engine.generate(requests(prompts([5, 9, 7, 11], seed=2), temperature=1.0, max_new_tokens=6, seed=1))
        assert all(r.error is None and len(r.completions[0].token_ids) == 6 for r in results)
        served = [httpx.get(f"{u}/get_server_info", timeout=10).json()["internal_states"][0] for u in engine.urls]
        assert all(s["generated_tokens"] >= 6 for s in served)  # both replicas served requests
        assert all(s["num_slots"] == 4 for s in served)  # server_args reached the embedded engines
        urls = list(engine.urls)
    finally:
        engine.close()
    for url in urls:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)


def test_launch_settings_are_checked():
    model = ModelConfig(name="tiny-llama")
    with pytest.raises(ValueError, match="replicas=2 applies to launch: embedded"):
        SGLangEngineConfig(model=model, replicas=2)
    with pytest.raises(ValueError, match="replicas=0 must be an integer >= 1"):
        SGLangEngineConfig(model=model, launch="embedded", replicas=0)
    with pytest.raises(ValueError, match=r"server_args\['seed'\] is set by the adapter: use SGLangEngineConfig.seed"):
        SGLangEngineConfig(model=model, launch="embedded", server_args={"seed": 1})
    with pytest.raises(ValueError, match=r"server_args\['mem_fraction_static'\] is not a setting of the embedded"):
        adapter([], launch="embedded", server_args={"mem_fraction_static": 0.5})
    with pytest.raises(ValueError, match="pause_on_update='later' must be"):
        SGLangEngineConfig(model=model, pause_on_update="later")


def test_without_sglang_installed_launching_names_the_install():
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(ImportError, match=r"pip install 'sglang\[all\]==0.5.23'"):
        adapter([], max_model_len=64)


# -- sglang-router in front of two embedded-engine servers -----------------------------------------------------


def test_sglang_router_spreads_requests_over_two_servers_and_updates_reach_both(server):
    from tests.engines.sglang_helpers import router_available, sglang_router

    if (reason := router_available()) is not None:
        pytest.skip(reason)
    with sglang_server() as second, sglang_router([server, second]) as router:
        engine = adapter(router, worker_urls=[server, second])
        try:
            before = {u: httpx.get(f"{u}/get_server_info").json()["internal_states"][0]["generated_tokens"]
                      for u in (server, second)}
            ps = prompts([5, 9, 12, 7], seed=50)
            results = [engine.generate(requests([p], temperature=1.0, max_new_tokens=8, seed=i))[0]
                       for i, p in enumerate(ps)]  # one /generate each: round robin alternates servers
            assert all(r.error is None and len(r.completions[0].token_ids) == 8 for r in results), results
            pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
            from tandem.models.transformer import CausalLM

            model = CausalLM.from_pretrained(resolve_model("tiny-llama"), dtype=torch.float32).eval()
            for r, ref in zip(results, teacher_forced(model, pairs), strict=True):
                torch.testing.assert_close(torch.tensor(r.completions[0].log_probs), ref, rtol=0, atol=2e-5)
            after = {u: httpx.get(f"{u}/get_server_info").json()["internal_states"][0]["generated_tokens"]
                     for u in (server, second)}
            assert all(after[u] - before[u] >= 16 for u in after), (before, after)  # both served
            [many] = engine.generate(requests(ps[:1], temperature=1.0, n=4, max_new_tokens=6, seed=9))
            assert many.error is None and len({tuple(c.token_ids) for c in many.completions}) == 4
            # a weight update goes to both workers: greedy outputs agree whichever server answers
            v = engine.weight_version
            noisy = [(k, t + 0.3) for k, t in case_weights().items()]
            engine.update_weights(noisy, version=v + 1)
            greedy = [engine.generate(requests(ps[:1], temperature=0, max_new_tokens=8))[0] for _ in range(4)]
            assert all(g.error is None for g in greedy), greedy
            assert len({tuple(g.completions[0].token_ids) for g in greedy}) == 1
            assert all(g.completions[0].weight_versions == [v + 1] for g in greedy)
            engine.update_weights(case_weights().items(), version=v + 2)
            assert all(httpx.get(f"{u}/model_info").json()["weight_version"] == str(v + 2)
                       for u in (server, second))
        finally:
            engine.close()


def case_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(resolve_model("tiny-llama").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# -- real SGLang (GPU machines with sglang installed; never runs here) --------------------------------------------


@pytest.fixture(scope="module")
def real_case():
    """The adapter launching real SGLang 0.5.23 on the tests' tiny Llama (head_dim 32, as vLLM needs)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (pip install 'sglang[all]==0.5.23' on a CUDA machine)")
    from tests.engines.vllm_helpers import vllm_tiny_model

    folder = vllm_tiny_model()
    engine = adapter([], model=str(folder), max_model_len=MAX_MODEL_LEN,
                     server_args={"enable_deterministic_inference": True, "mem_fraction_static": 0.3,
                                  "disable_cuda_graph": True})
    yield EngineCase(engine=engine, model_path=folder, max_model_len=MAX_MODEL_LEN, vocab_size=512,
                     logprob_atol=1e-3)  # SGLang's kernels in fp32: tolerance to be measured
    engine.close()


@pytest.mark.gpu
class TestRealSGLangContract(InferenceEngineContract):
    @pytest.fixture
    def case(self, real_case):
        return real_case
