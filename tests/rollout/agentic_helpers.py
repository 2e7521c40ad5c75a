"""Shared helpers for the agentic rollout tests: tiny engines, a tiny model taught to call a tool,
and the session server run in a background thread for synchronous clients."""

from __future__ import annotations

import asyncio
import threading

import torch

from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.models import ModelConfig, load_tokenizer, resolve_model
from tandem.models.attention import VarlenAttention
from tandem.models.transformer import CausalLM
from tandem.rollout.chat import ChatTemplate
from tandem.rollout.examples.calculator_agent import SYSTEM_PROMPT, calculator
from tandem.rollout.session import SessionConfig, SessionStore

MODEL = "tiny-llama"
QUESTION = "What is 3 + 4?"
TOOL_CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
FINAL_TEXT = "The answer is 7"


def make_engine(model: CausalLM | None = None, **kw) -> TorchEngine:
    """A tiny-model engine on one thread (tiny matrices: faster, and steady on a loaded machine).

    The thread count is process-wide; tests/rollout/conftest.py restores it after each test.
    """
    kw.setdefault("num_threads", 1)
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("max_model_len", 1024)
    return TorchEngine(TorchEngineConfig(model=ModelConfig(name=MODEL), **kw), model=model)


def make_store(engine: TorchEngine, **kw) -> SessionStore:
    return SessionStore(engine, ChatTemplate(load_tokenizer(MODEL)), SessionConfig(**kw))


def calculator_conversation() -> tuple[list[dict], list[dict]]:
    """The episode the taught model reproduces: ask, call the calculator, read 7, answer."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "_raw": TOOL_CALL_TEXT},
        {"role": "tool", "tool_call_id": "c0", "content": "7"},
        {"role": "assistant", "_raw": FINAL_TEXT},
    ]
    return messages, [calculator.schema]


def taught_model(steps: int = 80, seed: int = 0) -> CausalLM:
    """tiny-llama fine-tuned (cross-entropy on the assistant turns) to play `calculator_conversation`.

    Greedy decoding then emits the tool call after the question and the answer after the tool result:
    a real engine producing known tool calls, for tests of the tool-call path end to end.
    """
    tok = load_tokenizer(MODEL)
    template = ChatTemplate(tok)
    messages, tools = calculator_conversation()
    rows = []  # (prompt ids, target ids) per assistant turn
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = template.encode(template.render(messages[:k], tools, add_generation_prompt=True))
        rows.append((prompt, template.encode(m["_raw"]) + [tok.eos_token_id]))
    model = CausalLM.from_pretrained(resolve_model(MODEL))
    model.train().requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seqs = [torch.tensor(p + t) for p, t in rows]
    flat = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    targets = torch.cat([torch.cat([s[1:], s[:1]]) for s in seqs])
    weight = torch.cat([torch.tensor([0.0] * (len(p) - 1) + [1.0] * len(t) + [0.0]) for p, t in rows])
    ctx = VarlenAttention.from_lengths([len(s) for s in seqs])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and immune to a loaded machine
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            lp, _ = model(flat, positions, ctx, targets=targets)
            loss = -(lp * weight).sum() / weight.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.set_num_threads(threads)
    return model.eval().requires_grad_(False)


class ThreadedServer:
    """The session server's event loop in a background thread, for synchronous clients (openai).

    The engine is then driven from that thread; fine for tests (the embedded runner drives it from the
    caller's thread instead).
    """

    def __init__(self, app) -> None:
        from tandem.rollout.server import RunningServer

        self._server = RunningServer(app)
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.__aenter__())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        assert self._ready.wait(30), "the session server did not start"
        self.base_url = self._server.base_url
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._server.__aexit__(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
