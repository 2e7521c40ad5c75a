"""What SGLang's HTTP API and sglang-router cost, on the embedded engine (no real SGLang runs here).

Three ratios of rollout wall time (one ``generate`` of ``--prompts`` prompts x ``--n`` samples x
``--new-tokens`` tokens, temperature 1, fixed seeds), each from alternating runs (A, B, A, B, ...) of
``--repeats`` each, medians and spread ((max - min) / median):

* ``http_overhead``: the SGLang adapter over HTTP to ``tandem serve --api sglang`` / the same engine config
  in this process (aim <= 1.10), and ``http_overhead_outside_steps``: the same with only the time spent
  outside engine steps compared (the servers report their step seconds), which removes the compute noise
  of two processes on a shared machine; both engines on ``--threads`` threads (default 1: on a shared 2-core
  machine a 2-thread OpenMP engine stalls at its barriers whenever another process takes a core, which
  swamps what is measured);
* ``router_overhead``: through ``sglang-router`` with 1 replica / straight to that replica, both with one
  ``/generate`` per sample (what the adapter sends through a router) (aim <= 1.05);
* ``router_scaling``: 1 replica / 2 replicas behind the router, each replica one thread
  (``OMP_NUM_THREADS=1``): the 2-replica speedup (aim >= 1.7 on 2 free cores).

    .venv/bin/python bench/sglang_api.py             # smollm2-135m-instruct, 16 x 4 x 32 tokens (~4 min)
    .venv/bin/python bench/sglang_api.py --quick     # tiny-llama, seconds

Ends with one line ``RESULT {json}``. The machine's load average is printed with it: on a shared 2-core
machine the scaling figure is only as good as the cores that were free.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from tandem.core.protocols import GenerationRequest, SamplingParams  # noqa: E402
from tandem.engines.inference.sglang import SGLangEngine, SGLangEngineConfig  # noqa: E402
from tandem.models import ModelConfig  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, path: str = "/health", timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def server(model: str, args: argparse.Namespace, threads: int | None):
    """``tandem serve MODEL --api sglang`` in a subprocess (``threads``: its OMP_NUM_THREADS; None: torch's default)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(ROOT)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", model, "--api", "sglang", "--port", str(port),
                             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.prompts * args.n)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield from _up(proc, port)


@contextlib.contextmanager
def router(workers: list[str], policy: str = "cache_aware"):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
                             "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--policy", policy, "--log-level",
                             "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield from _up(proc, port)


def _up(proc: subprocess.Popen, port: int):
    """Yield the process's base URL once it answers; stop it afterwards."""
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def workload(args: argparse.Namespace, vocab: int) -> list[GenerationRequest]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(prompt_token_ids=torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist(),
                              sampling=SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n,
                                                      seed=i))
            for i in range(args.prompts)]


def timed(engine, requests) -> float:
    start = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - start
    bad = [r.error for r in results if r.error]
    assert not bad, bad[:2]
    return seconds


def alternate(a, b, repeats: int) -> tuple[list[float], list[float]]:
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(a())
        tb.append(b())
    return ta, tb


def summary(name: str, num: list[float], den: list[float]) -> dict[str, float]:
    ratio = statistics.median(num) / statistics.median(den)
    spread = max((max(x) - min(x)) / statistics.median(x) for x in (num, den))
    print(f"{name}: {ratio:.3f} (medians {statistics.median(num):.3f} s / {statistics.median(den):.3f} s, "
          f"spread {spread:.1%})", flush=True)
    return {name: round(ratio, 3), f"{name}_num_s": round(statistics.median(num), 3),
            f"{name}_den_s": round(statistics.median(den), 3), f"{name}_spread": round(spread, 3)}


def adapter(model: str, args, urls: list[str], workers: list[str] | None = None) -> SGLangEngine:
    return SGLangEngine(SGLangEngineConfig(model=ModelConfig(name=model), urls=urls, worker_urls=workers or [],
                                           max_model_len=args.max_model_len))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny-llama, 8 x 4 x 16 tokens")
    p.add_argument("--skip-router", action="store_true")
    p.add_argument("--policy", default="cache_aware", choices=["round_robin", "cache_aware", "power_of_two", "random"],
                   help="sglang-router's load-balancing policy (its default: cache_aware, which keeps the samples of "
                        "a prompt on one replica, where they share its prefill)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every engine (server and in-process)")
    args = p.parse_args()
    if args.quick:
        args.model, args.prompts, args.new_tokens = "tiny-llama", 8, 16
    from tandem.engines.inference.sglang.engine import model_facts
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import resolve_model

    vocab = model_facts(resolve_model(args.model))[0]
    reqs = lambda: workload(args, vocab)  # noqa: E731 - fresh request ids per run
    out: dict = {"model": args.model, "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
                 "repeats": args.repeats, "threads": args.threads, "load_avg_start": round(os.getloadavg()[0], 2)}

    local = TorchEngine(TorchEngineConfig(model=ModelConfig(name=args.model), max_model_len=args.max_model_len,
                                          max_num_seqs=args.prompts * args.n, num_threads=args.threads))
    with server(args.model, args, threads=args.threads) as url:
        remote = adapter(args.model, args, [url])
        steps = {"local": lambda: local.health()["step_seconds"],
                 "remote": lambda: httpx.get(url + "/server_info", timeout=60).json()["internal_states"][0]["step_seconds"]}
        outside: dict[str, list[float]] = {"local": [], "remote": []}

        def run(name: str, engine) -> float:
            before = steps[name]()
            wall = timed(engine, reqs())
            outside[name].append(wall - (steps[name]() - before))  # time not spent in engine steps
            return wall

        run("local", local), run("remote", remote)  # warm-up
        outside = {"local": [], "remote": []}
        inproc, http = alternate(lambda: run("local", local), lambda: run("remote", remote), args.repeats)
        out |= summary("http_overhead", http, inproc)
        # the API's own cost: what the HTTP path spends outside engine steps, beyond what the in-process
        # call spends there, over the in-process wall time (compute noise between processes removed)
        extra = statistics.median(outside["remote"]) - statistics.median(outside["local"])
        out["http_overhead_outside_steps"] = round(1 + extra / statistics.median(inproc), 4)
        out["http_outside_steps_s"] = {k: [round(x, 3) for x in v] for k, v in outside.items()}
        print(f"http_overhead_outside_steps: {out['http_overhead_outside_steps']} ({out['http_outside_steps_s']})",
              flush=True)
        remote.close()
    local.close()

    if not args.skip_router:
        with server(args.model, args, threads=1) as one, server(args.model, args, threads=1) as two:
            with router([one], args.policy) as r1:
                direct = adapter(args.model, args, [one], [one])  # per-sample requests, as through the router
                routed = adapter(args.model, args, [r1], [one])
                timed(direct, reqs()), timed(routed, reqs())
                d, r = alternate(lambda: timed(direct, reqs()), lambda: timed(routed, reqs()), args.repeats)
                out |= summary("router_overhead", r, d)
                direct.close(), routed.close()
            with router([one], args.policy) as r1, router([one, two], args.policy) as r2:
                single = adapter(args.model, args, [r1], [one])
                double = adapter(args.model, args, [r2], [one, two])
                timed(single, reqs()), timed(double, reqs())
                s1, s2 = alternate(lambda: timed(single, reqs()), lambda: timed(double, reqs()), args.repeats)
                out |= summary("router_scaling", s1, s2)
                single.close(), double.close()
    out["router_policy"] = args.policy
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
