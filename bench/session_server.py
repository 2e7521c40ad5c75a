"""Session server overhead: multi-turn chat through the HTTP session server vs calling the engine directly.

Workload: ``S`` concurrent sessions (1 and 32) x ``--turns`` turns; each turn a short user message and
exactly ``--max-tokens`` generated tokens (``ignore_eos``), fixed seeds, on SmolLM2-135M-Instruct
(``--model`` to change). The clients run in a separate process (as an agent would), over HTTP on
127.0.0.1; the server and the engine run in this process, the engine driven by the server's loop.

The direct baseline then replays exactly the same generation requests (the prompt token ids each turn
had in the server, the same seeds) with ``engine.agenerate`` from ``S`` coroutines, each turn after the
previous: the same engine work without HTTP, chat-template rendering, tokenization, TITO checks and
JSON. Both are run ``--repeats`` times (default 3), alternating; every figure is the median over the
repeats (latency percentiles over all turns of all repeats), the spread ((max - min) / median) of each
side's wall time is printed, and generated tokens are counted on both sides (the same by construction:
``ignore_eos``), so throughput is also given in tokens/s.

    overhead_ratio = (wall_server - wall_direct) / wall_direct     at 32 sessions (the aim: <= 0.10)

and, steadier on a shared machine, the wall time each run spends outside the engine's steps (HTTP,
rendering, tokenization, TITO checks, JSON, client round trips), the server's minus the direct run's,
per turn and relative to the engine's step time (``overhead_ratio_outside_steps``).

Also printed: turns/s, p50/p99 turn latency (client-observed for the server, per ``agenerate`` call
direct) and the engine's step time in both runs. Last line: ``RESULT {json}``.

    .venv/bin/python bench/session_server.py                     # SmolLM2, 4 turns x 32 tokens
    .venv/bin/python bench/session_server.py --model tiny-llama  # seconds; server cost dominates
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import multiprocessing as mp
import os
import statistics
import time

from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.models import ModelConfig, load_tokenizer
from tandem.rollout.chat import ChatTemplate
from tandem.rollout.server import RunningServer, ServerConfig, create_app
from tandem.rollout.session import SessionConfig, SessionStore

SYSTEM = "You are a helpful assistant that explains arithmetic step by step."


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# -- the client process ---------------------------------------------------------------------------------


def _client_main(base_url: str, sessions: int, turns: int, max_tokens: int, out: mp.Queue) -> None:
    import httpx2 as httpx

    async def one(c, k: int) -> list[float]:
        sid = (await c.post("/sessions")).json()["id"]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Problem {k}: what is {k} + 17?"}]
        latencies = []
        for t in range(turns):
            t0 = time.perf_counter()
            r = await c.post(f"/sessions/{sid}/v1/chat/completions", json={
                "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "seed": 1000 * k + t})
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Go on with step {t + 2}."}]
        return [sid, latencies]

    async def main():
        limits = httpx.Limits(max_connections=sessions + 4)
        async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as c:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(c, k) for k in range(sessions)))
            return time.perf_counter() - t0, results

    out.put(asyncio.run(main()))


# -- the two runs ---------------------------------------------------------------------------------------


_generate_s: contextvars.ContextVar[float] = contextvars.ContextVar("generate_s", default=0.0)


class TimedStore(SessionStore):
    """Adds up the time each turn spends in the store outside the engine call (render, tokenize, checks)."""

    processing_s = 0.0

    async def complete(self, session, request):
        t0 = time.perf_counter()
        _generate_s.set(0.0)  # each request runs in its own task, hence its own context
        try:
            return await super().complete(session, request)
        finally:
            self.processing_s += time.perf_counter() - t0 - _generate_s.get()

    async def _generate(self, session, work, request):
        t0 = time.perf_counter()
        try:
            return await super()._generate(session, work, request)
        finally:
            _generate_s.set(_generate_s.get() + time.perf_counter() - t0)


async def run_server(store: SessionStore, sessions: int, turns: int, max_tokens: int) -> dict:
    app = create_app(store, ServerConfig(sessions=store.config))
    before = store.engine.health()
    async with RunningServer(app) as srv:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_client_main, args=(srv.base_url, sessions, turns, max_tokens, queue))
        proc.start()
        loop = asyncio.get_running_loop()
        wall, results = await loop.run_in_executor(None, queue.get)
        await loop.run_in_executor(None, proc.join)
    requests = []  # the generation requests the server made: prompt ids per turn and the seed
    for k, (sid, _) in enumerate(results):
        session = store.sessions.pop(sid)
        for t, turn in enumerate(session.trajectory.turns):
            requests.append((k, t, session.trajectory.ids[: turn.start]))
    return {"wall": wall, "latencies": [x for _, lat in results for x in lat], "requests": requests,
            "engine_s": store.engine.health()["step_seconds"] - before["step_seconds"],
            "steps": store.engine.health()["steps"] - before["steps"], "processing_s": store.processing_s}


async def run_direct(engine: TorchEngine, requests: list, max_tokens: int) -> dict:
    by_session: dict[int, list] = {}
    for k, t, ids in requests:
        by_session.setdefault(k, []).append((t, ids))
    before = engine.health()
    latencies: list[float] = []

    async def one(k: int) -> None:
        for t, ids in sorted(by_session[k]):
            t0 = time.perf_counter()
            result = await engine.agenerate(GenerationRequest(prompt_token_ids=list(ids), sampling=SamplingParams(
                temperature=1.0, max_new_tokens=max_tokens, seed=1000 * k + t)))
            latencies.append(time.perf_counter() - t0)
            assert len(result.completions[0].token_ids) == max_tokens, result.completions[0].finish_reason

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in by_session))
    return {"wall": time.perf_counter() - t0, "latencies": latencies,
            "engine_s": engine.health()["step_seconds"] - before["step_seconds"],
            "steps": engine.health()["steps"] - before["steps"]}


def _median_run(runs: list[dict]) -> dict:
    """One record of the medians of ``runs``' scalars; latencies of all runs pooled."""
    return {"wall": statistics.median(r["wall"] for r in runs),
            "engine_s": statistics.median(r["engine_s"] for r in runs),
            "steps": statistics.median(r["steps"] for r in runs),
            "tokens": statistics.median(r["tokens"] for r in runs),
            "processing_s": statistics.median(r.get("processing_s", 0.0) for r in runs),
            "latencies": [t for r in runs for t in r["latencies"]],
            "spread": (max(r["wall"] for r in runs) - min(r["wall"] for r in runs)) / statistics.median(
                r["wall"] for r in runs)}


def measure(engine, template, sessions: int, turns: int, max_tokens: int, repeats: int) -> dict:
    servers, directs = [], []
    for _ in range(repeats):
        store = TimedStore(engine, template, SessionConfig(max_sessions=sessions + 4))
        before = engine.health()["generated_tokens"]
        servers.append(asyncio.run(run_server(store, sessions, turns, max_tokens)))
        middle = engine.health()["generated_tokens"]
        directs.append(asyncio.run(run_direct(engine, servers[-1]["requests"], max_tokens)))
        servers[-1]["tokens"], directs[-1]["tokens"] = middle - before, engine.health()["generated_tokens"] - middle
    server, direct = _median_run(servers), _median_run(directs)
    n = sessions * turns
    out = {
        "sessions": sessions, "turns": n, "repeats": repeats,
        "server_wall_s": server["wall"], "direct_wall_s": direct["wall"],
        "server_wall_spread": server["spread"], "direct_wall_spread": direct["spread"],
        "overhead_ratio": (server["wall"] - direct["wall"]) / direct["wall"],
        "server_turns_per_s": n / server["wall"], "direct_turns_per_s": n / direct["wall"],
        "server_tokens": server["tokens"], "direct_tokens": direct["tokens"],
        "server_tok_s": server["tokens"] / server["wall"], "direct_tok_s": direct["tokens"] / direct["wall"],
        "server_p50_ms": 1e3 * statistics.median(server["latencies"]),
        "server_p99_ms": 1e3 * _percentile(server["latencies"], 0.99),
        "direct_p50_ms": 1e3 * statistics.median(direct["latencies"]),
        "direct_p99_ms": 1e3 * _percentile(direct["latencies"], 0.99),
        "server_engine_step_s": server["engine_s"], "direct_engine_step_s": direct["engine_s"],
        "server_engine_steps": server["steps"], "direct_engine_steps": direct["steps"],
    }
    if server["tokens"] != direct["tokens"]:
        raise RuntimeError(f"the server run generated {server['tokens']} tokens, the direct one {direct['tokens']}")
    out["added_p50_ms"] = out["server_p50_ms"] - out["direct_p50_ms"]
    out["added_p99_ms"] = out["server_p99_ms"] - out["direct_p99_ms"]
    # Wall time outside engine steps (HTTP, rendering, tokenization, TITO checks, JSON, client round trips)
    # minus the same for the direct run, per turn and relative to the engine's step time: unlike the wall
    # ratio, it does not move when the shared machine slows the engine's steps down in one run only.
    outside = (server["wall"] - server["engine_s"]) - (direct["wall"] - direct["engine_s"])
    out["added_outside_steps_ms_per_turn"] = 1e3 * outside / n
    out["overhead_ratio_outside_steps"] = outside / direct["engine_s"]
    out["store_processing_ms_per_turn"] = 1e3 * server["processing_s"] / n  # TITO work, no HTTP
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the client process gets the other core of a 2-core machine)")
    args = parser.parse_args()

    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name=args.model), max_num_seqs=max(args.concurrency),
                                           max_model_len=512, num_threads=args.threads))
    template = ChatTemplate(load_tokenizer(args.model))
    engine.generate([GenerationRequest(prompt_token_ids=template.encode("Hello there"),
                                       sampling=SamplingParams(max_new_tokens=4))])  # warm-up
    print(f"model {args.model}, {args.turns} turns x {args.max_tokens} tokens per session, "
          f"load average {os.getloadavg()[0]:.1f}")
    results = {}
    for s in args.concurrency:
        r = measure(engine, template, s, args.turns, args.max_tokens, args.repeats)
        results[s] = r
        print(f"{s:>3} sessions: server {r['server_turns_per_s']:.2f} turns/s (p50 {r['server_p50_ms']:.0f} ms, "
              f"p99 {r['server_p99_ms']:.0f} ms) | direct {r['direct_turns_per_s']:.2f} turns/s (p50 "
              f"{r['direct_p50_ms']:.0f} ms, p99 {r['direct_p99_ms']:.0f} ms) | overhead {100 * r['overhead_ratio']:.1f}% "
              f"(wall spreads {r['server_wall_spread']:.2f} / {r['direct_wall_spread']:.2f}; "
              f"{r['server_tok_s']:.1f} vs {r['direct_tok_s']:.1f} tok/s) "
              f"| engine {r['server_engine_steps']} steps {r['server_engine_step_s']:.2f} s vs {r['direct_engine_steps']} "
              f"steps {r['direct_engine_step_s']:.2f} s | outside steps "
              f"+{r['added_outside_steps_ms_per_turn']:.1f} ms/turn ({100 * r['overhead_ratio_outside_steps']:.1f}%), "
              f"of which TITO work {r['store_processing_ms_per_turn']:.1f} ms")
    engine.close()
    top = max(args.concurrency)
    summary = {"overhead_ratio": results[top]["overhead_ratio"],
               "overhead_ratio_outside_steps": results[top]["overhead_ratio_outside_steps"],
               "model": args.model, "turns": args.turns,
               "max_tokens": args.max_tokens, "load_average_end": os.getloadavg()[0]}
    for s, r in results.items():
        summary |= {f"{k}_{s}": round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
