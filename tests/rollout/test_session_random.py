"""Random multi-turn conversations with tool calls through the session server (tiny model, loopback).

Each conversation mixes user turns, model turns (1-4 tokens, some cut by ``max_tokens``), tool calls
the client writes as assistant messages, tool results, and retries of a turn. The stored token ids are
compared with an oracle built from ChatML's structure alone (each message is
``<|im_start|>role\\ncontent<|im_end|>\\n``, the model's tokens spliced in as returned), so a wrong
append, a re-tokenized model token or a lost newline shows up as a difference. Also: the loss mask is
1 exactly on the model's tokens, every model token has its log-prob, and no turn reports drift.
"""

from __future__ import annotations

import asyncio
import random

import httpx2 as httpx
import pytest

from tandem.rollout.server import RunningServer, create_app
from tandem.rollout.tools import format_tool_calls, tools_system_block
from tests.rollout.agentic_helpers import make_engine, make_store

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WORDS = "the sum of seven and three is ten apples tool call result é 中文 ☃ {json} <b> 42 -1 3.5".split()
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def _text(rng: random.Random) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    if rng.random() < 0.2:
        text = rng.choice(["\n", " ", "\n\n"]) + text + rng.choice(["", " ", "\n"])
    return text


class Conversation:
    """Drives one random conversation and records what the oracle needs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tools = rng.sample(TOOLS, rng.randint(1, 2)) if rng.random() < 0.5 else None
        self.messages: list[dict] = []
        if rng.random() < 0.5:
            self.messages.append({"role": "system", "content": _text(rng)})
        self.messages.append({"role": "user", "content": _text(rng)})
        self.model_turns: dict[int, dict] = {}  # message index -> {"ids", "log_probs", "finish"}

    async def run(self, c: httpx.AsyncClient, turns: int) -> str:
        sid = (await c.post("/sessions")).json()["id"]
        for _ in range(turns):
            reply = await self._complete(c, sid)
            if self.rng.random() < 0.1:  # resample the same step: the server rolls the last turn back
                self.messages.pop()
                reply = await self._complete(c, sid)
            self._continue(reply)
        return sid

    async def _complete(self, c, sid) -> dict:
        body = {"messages": self.messages, "max_tokens": self.rng.randint(1, 4), "logprobs": True,
                "return_token_ids": True, "seed": self.rng.randrange(1 << 30), "ignore_eos": self.rng.random() < 0.3}
        if self.tools:
            body["tools"] = self.tools
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        self.model_turns[len(self.messages)] = {
            "ids": choice["token_ids"], "log_probs": [e["logprob"] for e in choice["logprobs"]["content"]],
            "finish": "length" if choice["finish_reason"] == "length" else "stop"}
        self.messages.append(choice["message"])
        return choice["message"]

    def _continue(self, reply: dict) -> None:
        rng = self.rng
        calls = reply.get("tool_calls") or []
        if not calls and self.tools and rng.random() < 0.4:  # the client writes a tool call turn
            calls = [{"id": f"c{len(self.messages)}_{i}", "type": "function",
                      "function": {"name": rng.choice(self.tools)["function"]["name"],
                                   "arguments": f'{{"expression": "{rng.randint(0, 99)} * {rng.randint(0, 9)}"}}'}}
                     for i in range(rng.randint(1, 2))]
            self.messages.append({"role": "assistant", "content": _text(rng) if rng.random() < 0.3 else None,
                                  "tool_calls": calls})
        if calls:
            for call in calls:
                self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng)})
        else:
            self.messages.append({"role": "user", "content": _text(rng)})

    def expected_ids(self, encode) -> tuple[list[int], list[int], list[float | None]]:
        """Token ids, loss mask and log-probs from ChatML's structure and the model's returned tokens."""
        msgs = self.messages[: max(self.model_turns) + 1]
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else None
        if self.tools:
            system = (system + "\n\n" if system else "") + tools_system_block(self.tools)
        blocks = [] if system is None and msgs[0]["role"] == "system" else [("system", system or DEFAULT_SYSTEM)]
        ids, mask, lps = [], [], []

        def env(text):
            new = encode(text)
            ids.extend(new), mask.extend([0] * len(new)), lps.extend([None] * len(new))

        for role, content in blocks:
            env(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        for i, m in enumerate(msgs):
            if m["role"] == "system":
                continue
            if i in self.model_turns:
                turn = self.model_turns[i]
                env("<|im_start|>assistant\n")
                ids.extend(turn["ids"]), mask.extend([1] * len(turn["ids"])), lps.extend(turn["log_probs"])
                if i < len(msgs) - 1:
                    env("\n" if turn["finish"] == "stop" else "<|im_end|>\n")
                continue
            content = m.get("content") or ""
            if m.get("tool_calls"):
                content = (content + "\n" if content else "") + format_tool_calls(m["tool_calls"])
            env(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        return ids, mask, lps


async def _run_all(app, seeds: list[int], *, concurrency: int, tokenizer_encode) -> dict[str, int]:
    totals = {"conversations": 0, "model_tokens": 0, "turns": 0}
    gate = asyncio.Semaphore(concurrency)
    async with RunningServer(app) as srv, httpx.AsyncClient(base_url=srv.base_url, timeout=120,
                                                            limits=httpx.Limits(max_connections=concurrency)) as c:

        async def one(seed: int) -> None:
            async with gate:
                rng = random.Random(seed)
                conv = Conversation(rng)
                sid = await conv.run(c, turns=rng.randint(1, 4))
                view = (await c.get(f"/sessions/{sid}")).json()
                ids, mask, lps = conv.expected_ids(tokenizer_encode)
                assert view["token_ids"] == ids, f"seed {seed}: token ids differ from the ChatML oracle"
                assert view["loss_mask"] == mask, f"seed {seed}"
                assert view["log_probs"] == lps, f"seed {seed}"
                assert view["last_error"] is None and view["status"] == "active"
                assert sum(mask) == sum(len(t["ids"]) for t in conv.model_turns.values() if t) > 0
                totals["conversations"] += 1
                totals["model_tokens"] += sum(mask)
                totals["turns"] += len(view["turns"])
                assert (await c.delete(f"/sessions/{sid}")).status_code == 200

        await asyncio.gather(*(one(s) for s in seeds))
    return totals


def _check(num: int) -> None:
    engine = make_engine(max_num_seqs=32, max_model_len=1024)
    store = make_store(engine, max_sessions=64)
    encode = store.template.encode
    try:
        totals = asyncio.run(_run_all(create_app(store), list(range(num)), concurrency=32, tokenizer_encode=encode))
    finally:
        engine.close()
    assert totals["conversations"] == num
    assert store.counters["drift_errors"] == 0 and store.counters["history_mismatches"] == 0
    assert store.counters["retries"] > 0  # the retry path ran
    assert len(store.sessions) == 0


def test_random_conversations_small():
    _check(240)  # CI's bound (~20 s); the 1,000-conversation run below is slow


@pytest.mark.slow
def test_random_conversations_1000():
    _check(1000)
