"""The session server's HTTP API on loopback: lifecycle, errors by status code, limits, streaming."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest

from tandem.rollout.server import RunningServer, ServerConfig, create_app
from tests.rollout.agentic_helpers import make_engine, make_store
from tests.rollout.test_tito import REASONING_DROPPING

USER = {"role": "user", "content": "What is 3 + 4?"}


@pytest.fixture(scope="module")
def engine():
    eng = make_engine(max_num_seqs=8, max_model_len=512)
    yield eng
    eng.close()


def serve(app, body, **client_kw):
    """Run ``await body(client)`` against ``app`` served on 127.0.0.1."""

    async def main():
        async with RunningServer(app) as srv, httpx.AsyncClient(base_url=srv.base_url, timeout=60, **client_kw) as c:
            return await body(c)

    return asyncio.run(main())


async def new_session(c) -> str:
    r = await c.post("/sessions")
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def chat(c, sid, messages, **kw):
    return await c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages, "max_tokens": 6, **kw})


def test_lifecycle_and_response_shape(engine):
    store = make_store(engine)

    async def body(c):
        r = await c.post("/sessions", json={"metadata": {"task": 1}, "max_turns": 3})
        assert r.status_code == 201
        sid, base_url = r.json()["id"], r.json()["base_url"]
        assert base_url == f"{str(c.base_url).rstrip('/')}/sessions/{sid}/v1"
        empty = (await c.get(f"/sessions/{sid}")).json()
        assert empty["token_ids"] == [] and empty["turns"] == [] and empty["metadata"] == {"task": 1}
        r = await chat(c, sid, [USER], logprobs=True, return_token_ids=True)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert out["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        view = (await c.get(f"/sessions/{sid}")).json()
        [turn] = view["turns"]
        ids = choice["token_ids"]
        assert view["token_ids"][turn["start"]:turn["end"]] == ids
        assert out["usage"] == {"prompt_tokens": turn["start"], "completion_tokens": len(ids),
                                "total_tokens": turn["start"] + len(ids)}
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == view["log_probs"][turn["start"]:]
        assert view["loss_mask"] == [0] * turn["start"] + [1] * len(ids)
        assert all(lp is None for lp in view["log_probs"][: turn["start"]])
        assert view["messages"][-1] == choice["message"]
        r = await c.delete(f"/sessions/{sid}")
        assert r.status_code == 200 and r.json()["token_ids"] == view["token_ids"]
        assert (await c.get(f"/sessions/{sid}")).status_code == 404
        assert (await c.delete(f"/sessions/{sid}")).status_code == 404

    serve(create_app(store), body)


def test_unknown_session_is_404_everywhere(engine):
    async def body(c):
        for method, path, payload in [("get", "/sessions/nope", None), ("delete", "/sessions/nope", None),
                                      ("post", "/sessions/nope/rollback", None),
                                      ("post", "/sessions/nope/v1/chat/completions", {"messages": [USER]}),
                                      ("get", "/sessions/nope/v1/models", None)]:
            r = await c.request(method.upper(), path, json=payload)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["type"] == "not_found"

    serve(create_app(make_store(engine)), body)


@pytest.mark.parametrize("payload, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [USER], "temperature": -1}, "temperature"),
    ({"messages": [USER], "top_p": 0}, "top_p"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
    ({"messages": [USER], "n": 2}, "n"),
    ({"messages": [USER], "stop": ["\n"]}, "stop"),
    ({"messages": [USER], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}]}, "messages.0.tool_calls.0.function"),
])
def test_malformed_bodies_are_422_naming_the_field(engine, payload, param):
    async def body(c):
        sid = await new_session(c)
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", json=payload)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == param
        assert param in r.json()["error"]["message"]
        assert (await c.get(f"/sessions/{sid}")).json()["token_ids"] == []

    serve(create_app(make_store(engine)), body)


def test_not_json_is_422(engine):
    async def body(c):
        sid = await new_session(c)
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
        assert r.status_code == 422

    serve(create_app(make_store(engine)), body)


def test_bearer_token(engine):
    app = create_app(make_store(engine), ServerConfig(api_key="s3cret"))

    async def body(c):
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/sessions")).status_code == 401
        r = await c.post("/sessions", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await c.post("/sessions", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 201
        assert (await c.get(f"/sessions/{r.json()['id']}")).status_code == 401

    serve(app, body)


def test_request_size_limit_is_413(engine):
    app = create_app(make_store(engine), ServerConfig(max_request_bytes=2048))

    async def body(c):
        sid = await new_session(c)
        r = await chat(c, sid, [{"role": "user", "content": "x" * 5000}])
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

        async def chunks():  # no content-length: the limit applies to the streamed body too
            for _ in range(10):
                yield b" " * 500

        r = await c.post(f"/sessions/{sid}/v1/chat/completions", content=chunks(),
                         headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert (await chat(c, sid, [USER])).status_code == 200

    serve(app, body)


def test_session_count_limit_is_429(engine):
    async def body(c):
        for _ in range(3):
            await new_session(c)
        r = await c.post("/sessions")
        assert r.status_code == 429 and "max_sessions=3" in r.json()["error"]["message"]

    serve(create_app(make_store(engine, max_sessions=3)), body)


def test_engine_failure_is_503_and_the_session_is_intact(engine):
    store = make_store(engine)

    async def body(c):
        sid = await new_session(c)
        first = (await chat(c, sid, [USER])).json()["choices"][0]["message"]
        before = (await c.get(f"/sessions/{sid}")).json()
        follow = [USER, first, {"role": "user", "content": "and 5 + 6?"}]
        engine.sleep()
        try:
            r = await chat(c, sid, follow)
        finally:
            engine.wake_up()
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "engine_unavailable"
        after = (await c.get(f"/sessions/{sid}")).json()
        assert {k: after[k] for k in ("token_ids", "turns", "messages")} == {k: before[k] for k in ("token_ids", "turns", "messages")}
        r = await chat(c, sid, follow)  # the same request, retried
        assert r.status_code == 200 and len((await c.get(f"/sessions/{sid}")).json()["turns"]) == 2

    serve(create_app(store), body)


def test_drift_is_409_with_the_position(engine):
    from tandem.models import load_tokenizer
    from tandem.rollout.chat import ChatTemplate
    from tandem.rollout.session import SessionStore

    store = SessionStore(engine, ChatTemplate(load_tokenizer("tiny-llama"), chat_template=REASONING_DROPPING))

    async def body(c):
        sid = await new_session(c)
        reply = (await chat(c, sid, [USER])).json()["choices"][0]["message"]
        thought = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n7"}
        history = [USER, reply, thought, {"role": "tool", "content": "ok"}]
        assert (await chat(c, sid, history)).status_code == 200  # no new user turn: the block stays
        view = (await c.get(f"/sessions/{sid}")).json()
        r = await chat(c, sid, [*history, view["messages"][-1], {"role": "user", "content": "sure?"}])
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["type"] == "token_drift" and err["info"]["kind"] == "text"
        think_at = view["token_ids"].index(1, view["turns"][0]["end"])  # <|im_start|> of the injected message
        assert think_at < err["info"]["position"] < view["turns"][1]["start"]
        assert (await c.get(f"/sessions/{sid}")).json()["token_ids"] == view["token_ids"]
        assert (await c.get(f"/sessions/{sid}")).json()["last_error"]["type"] == "TokenDriftError"

    serve(create_app(store), body)


def test_history_mismatch_is_409(engine):
    async def body(c):
        sid = await new_session(c)
        reply = (await chat(c, sid, [USER])).json()["choices"][0]["message"]
        r = await chat(c, sid, [USER, {**reply, "content": "edited"}, {"role": "user", "content": "?"}])
        assert r.status_code == 409 and r.json()["error"]["type"] == "history_mismatch"
        assert "messages[1]" in r.json()["error"]["message"]

    serve(create_app(make_store(engine)), body)


def test_rollback_endpoint_and_implicit_retry(engine):
    async def body(c):
        sid = await new_session(c)
        reply = (await chat(c, sid, [USER])).json()["choices"][0]["message"]
        one = (await c.get(f"/sessions/{sid}")).json()
        follow = [USER, reply, {"role": "user", "content": "again"}]
        assert (await chat(c, sid, follow)).status_code == 200
        two = (await c.get(f"/sessions/{sid}")).json()
        assert len(two["turns"]) == 2
        r = await c.post(f"/sessions/{sid}/rollback")
        assert r.status_code == 200 and r.json()["token_ids"] == one["token_ids"] and r.json()["stats"]["rollbacks"] == 1
        # the same request twice: the second resamples the turn instead of failing
        assert (await chat(c, sid, follow, seed=1)).status_code == 200
        r = await chat(c, sid, follow, seed=2)
        assert r.status_code == 200
        view = (await c.get(f"/sessions/{sid}")).json()
        assert len(view["turns"]) == 2 and view["stats"]["rollbacks"] == 2
        assert view["messages"][-1] == r.json()["choices"][0]["message"]
        for _ in range(2):
            assert (await c.post(f"/sessions/{sid}/rollback")).status_code == 200
        r = await c.post(f"/sessions/{sid}/rollback")
        assert r.status_code == 409 and "nothing to roll back" in r.json()["error"]["message"]

    serve(create_app(make_store(engine)), body)


def _events(text: str) -> list:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streaming_sends_openai_chunks(engine):
    async def body(c):
        sid = await new_session(c)
        r = await chat(c, sid, [USER], stream=True, stream_options={"include_usage": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.text)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        view = (await c.get(f"/sessions/{sid}")).json()
        assert content == (view["messages"][-1]["content"] or "")
        assert finish == [view["turns"][0]["finish_reason"]] or finish == ["tool_calls"]
        assert events[-1]["usage"]["completion_tokens"] == view["turns"][0]["end"] - view["turns"][0]["start"]

    serve(create_app(make_store(engine)), body)


def test_context_full_and_max_turns_truncate_the_session(engine):
    async def body(c):
        sid = await new_session(c)
        r = await chat(c, sid, [USER], max_tokens=50, ignore_eos=True)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        view = (await c.get(f"/sessions/{sid}")).json()
        assert len(view["token_ids"]) == 100 and view["status"] == "truncated" and view["status_reason"] == "context_full"
        r = await chat(c, sid, [USER, r.json()["choices"][0]["message"], {"role": "user", "content": "more"}])
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["choices"][0]["message"]["content"] is None and r.json()["usage"]["completion_tokens"] == 0
        assert (await c.get(f"/sessions/{sid}")).json()["token_ids"] == view["token_ids"]

        r = await c.post("/sessions", json={"max_turns": 1})
        sid = r.json()["id"]
        reply = (await chat(c, sid, [USER], max_tokens=2)).json()["choices"][0]["message"]
        r = await chat(c, sid, [USER, reply, {"role": "user", "content": "more"}], max_tokens=2)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert (await c.get(f"/sessions/{sid}")).json()["status_reason"] == "max_turns"

    serve(create_app(make_store(engine, max_context_tokens=100)), body)


def test_openapi_schema_health_and_models(engine):
    async def body(c):
        schema = (await c.get("/openapi.json")).json()
        assert {"/sessions", "/sessions/{session_id}", "/sessions/{session_id}/v1/chat/completions",
                "/sessions/{session_id}/rollback", "/health"} <= set(schema["paths"])
        health = (await c.get("/health")).json()
        assert health["status"] == "ok" and health["sessions"]["sessions"] == 0
        sid = await new_session(c)
        models = (await c.get(f"/sessions/{sid}/v1/models")).json()
        assert models["data"][0]["id"] == "tiny"

    serve(create_app(make_store(engine), ServerConfig(model_name="tiny")), body)


def test_a_request_names_a_lora_adapter_by_model(engine):
    """`"model": NAME` generates with the adapter the engine serves under NAME; other names (clients send
    their own) use the engine's default; /v1/models lists the adapters."""
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = []
    for name, lin in engine.adapters.linears.items():
        if name.endswith(("q_proj", "v_proj")):
            out_dim, in_dim = lin.weight.shape
            tensors += [(f"base_model.model.{name}.lora_A.weight", torch.randn(4, in_dim, generator=g)),
                        (f"base_model.model.{name}.lora_B.weight", torch.randn(out_dim, 4, generator=g))]
    engine.add_lora_adapter("mine", tensors, alpha=16.0)
    store = make_store(engine)

    async def body(c):
        out = {}
        for model in ("mine", "gpt-4o", "base"):
            sid = await new_session(c)
            r = await chat(c, sid, [USER], model=model, temperature=0, max_tokens=8, return_token_ids=True)
            assert r.status_code == 200, r.text
            out[model] = r.json()["choices"][0]["token_ids"]
        listed = (await c.get(f"/sessions/{sid}/v1/models")).json()["data"]
        return out, [m["id"] for m in listed]

    try:
        out, listed = serve(create_app(store), body)
    finally:
        engine.remove_lora_adapter("mine")
    assert out["gpt-4o"] == out["base"] != out["mine"]
    assert "mine" in listed
