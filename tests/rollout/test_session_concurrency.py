"""Many sessions at once on one engine: every turn completes, and no session sees another's tokens.

Each session has its own secret in its system prompt and numbers its turns. Afterwards every session's
tokens must hold only its own secret and turn markers, and replaying some sessions alone, one request
at a time with the same seeds, must give exactly the same token ids (the engine runs in deterministic,
batch-invariant mode, so a session's tokens cannot depend on what else shared its batches).
"""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import pytest

from tandem.rollout.server import RunningServer, create_app
from tests.rollout.agentic_helpers import make_engine, make_store


def _secret(k: int) -> str:
    return f"secret-{k:03d}-{(k * 7919) % 1000:03d}"


async def _session(c: httpx.AsyncClient, k: int, turns: int) -> str:
    sid = (await c.post("/sessions")).json()["id"]
    messages = [{"role": "system", "content": f"You are session {_secret(k)}."},
                {"role": "user", "content": f"turn 0 of {_secret(k)}"}]
    for t in range(turns):
        r = await c.post(f"/sessions/{sid}/v1/chat/completions",
                         json={"messages": messages, "max_tokens": 2, "ignore_eos": True, "seed": 1000 * k + t})
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"turn {t + 1} of {_secret(k)}"}]
    return sid


async def _run(num_sessions: int, turns: int, replay: list[int]) -> tuple[dict[int, dict], dict[int, list[int]]]:
    engine = make_engine(max_num_seqs=num_sessions, max_model_len=1024, deterministic=True)
    store = make_store(engine, max_sessions=num_sessions + len(replay))
    async with RunningServer(create_app(store)) as srv, httpx.AsyncClient(
            base_url=srv.base_url, timeout=300, limits=httpx.Limits(max_connections=num_sessions)) as c:
        sids = await asyncio.gather(*(_session(c, k, turns) for k in range(num_sessions)))
        views = {k: (await c.get(f"/sessions/{sid}")).json() for k, sid in enumerate(sids)}
        alone = {}
        for k in replay:  # one session at a time: nothing else in the engine's batches
            sid = await _session(c, k, turns)
            alone[k] = (await c.get(f"/sessions/{sid}")).json()["token_ids"]
    engine.close()
    return views, alone


def _check(num_sessions: int, turns: int, replay: list[int]) -> None:
    from tandem.models import load_tokenizer

    views, alone = asyncio.run(_run(num_sessions, turns, replay))
    tok = load_tokenizer("tiny-llama")
    for k, view in views.items():
        assert len(view["turns"]) == turns and view["status"] == "active" and view["last_error"] is None
        assert sum(view["loss_mask"]) == 2 * turns
        text = tok.decode([t for t, m in zip(view["token_ids"], view["loss_mask"], strict=True) if m == 0])
        assert text.count(_secret(k)) == turns + 1
        assert text.count("secret-") == turns + 1, f"session {k} holds another session's secret"
        for t in range(turns):
            assert f"turn {t} of {_secret(k)}" in text
    for k, ids in alone.items():
        assert views[k]["token_ids"] == ids, f"session {k}: its tokens depend on the other sessions"


def test_concurrent_sessions_small():
    _check(8, 5, replay=[0, 5])


@pytest.mark.slow
@pytest.mark.ci
def test_64_concurrent_sessions_of_20_turns():
    _check(64, 20, replay=[0, 17, 63])
