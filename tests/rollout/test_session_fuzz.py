"""Fuzz the session server from its own OpenAPI schema (schemathesis): no input gives a 5xx.

Bounded: a fixed number of examples per operation, a tiny engine with 4-token turns, on 127.0.0.1.
Half of the cases aim at a live session (a random id only ever reaches the 404 path).
"""

from __future__ import annotations

import hashlib
from collections import Counter

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tandem.rollout.server import ServerConfig, create_app
from tandem.rollout.session import SessionConfig
from tests.rollout.agentic_helpers import ThreadedServer, make_engine, make_store

SESSIONS = SessionConfig(max_sessions=64, max_turns=6, max_tokens_cap=4, session_ttl_s=30)


def _schema() -> dict:
    from tandem.rollout.session import SessionStore

    class _NoEngine:  # enough for create_app to build routes and the OpenAPI document
        config = type("C", (), {"max_model_len": 256})()

    store = SessionStore.__new__(SessionStore)
    store.engine, store.config = _NoEngine(), SESSIONS
    return create_app(store, ServerConfig(sessions=SESSIONS)).openapi()


STATUSES: Counter = Counter()  # (method, path template, status) over the fuzz run
schema = schemathesis.openapi.from_dict(_schema())
# valid bodies (they reach the engine) and invalid ones (they must stop at validation, as 4xx)
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
                                database="none")


@pytest.fixture(scope="module")
def live():
    engine = make_engine(max_num_seqs=8, max_model_len=256)
    store = make_store(engine, max_sessions=64, max_turns=6, max_tokens_cap=4, session_ttl_s=30)
    with ThreadedServer(create_app(store, ServerConfig(sessions=store.config, max_request_bytes=64 << 10))) as srv:
        sid = httpx.post(f"{srv.base_url}/sessions").json()["id"]
        yield srv.base_url, sid
    engine.close()


@schema.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_no_input_is_a_server_error(case, live):
    base_url, sid = live
    if "session_id" in (case.path_parameters or {}):
        digest = hashlib.sha256(repr(case.body).encode()).digest()[0]
        if digest % 2 == 0:  # a live session; deletes get one of their own, so the shared one lives on
            fresh = case.method == "DELETE"
            case.path_parameters["session_id"] = httpx.post(f"{base_url}/sessions").json()["id"] if fresh else sid
    response = case.call(base_url=base_url, timeout=60)
    STATUSES[case.method, case.path, response.status_code] += 1
    assert response.status_code < 500, (case.method, case.formatted_path, repr(case.body)[-600:], response.text[:300])


# JSON has no NaN or Infinity, so a schema-driven fuzzer never sends them; Python's JSON parser accepts them
# (and turns 1e999 into inf), and integers of any size: each must stop at validation, as a 422
NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 40, "-1" + "0" * 40]
CHAT_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs"]


@pytest.mark.parametrize("value", NUMBERS)
def test_non_finite_and_huge_numbers_are_422_never_a_server_error(live, value):
    base_url, sid = live
    headers = {"Content-Type": "application/json"}
    chat = f"/sessions/{sid}/v1/chat/completions"
    bodies = [(chat, f'{{"messages": [{{"role": "user", "content": "hi"}}], "{name}": {value}}}', 422)
              for name in CHAT_FIELDS]
    # a huge integer is valid JSON where any value is allowed (a tool's parameters, metadata): then any
    # answer but a 5xx (the shared session may refuse the history, the store may be full); NaN never is
    free = value.lstrip("-").isdigit()
    bodies += [(chat, '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                f'"function": {{"name": "f", "parameters": {{"x": {value}}}}}}}]}}', None if free else 422),
               ("/sessions", f'{{"metadata": {{"x": {value}}}}}', None if free else 422),
               ("/sessions", f'{{"max_turns": {value}}}', 422)]
    with httpx.Client(base_url=base_url, timeout=60) as c:  # one keep-alive connection for all of them
        for path, body, expected in bodies:
            r = c.post(path, content=body, headers=headers)
            assert r.status_code < 500 and r.status_code == (expected or r.status_code), (body, r.text[:300])
        assert c.get(f"/sessions/{sid}").status_code == 200  # and the connection still serves


def test_the_fuzz_reached_the_engine_and_the_validators():
    if not STATUSES:
        pytest.skip("run with the fuzz test above")
    chat = "/sessions/{session_id}/v1/chat/completions"
    codes = {code for (method, path, code) in STATUSES if path == chat}
    assert 200 in codes and 422 in codes and 404 in codes, STATUSES
