"""oneDNN's shape caches: PyTorch's default capacity (1,024 entries) vs Tandem's bound (64), same work.

oneDNN builds one primitive per product shape, the row count included, and PyTorch keeps up to 1,024 of them
(plus ideep's descriptors, per thread), ~0.6 MiB each; importing ``tandem`` bounds both caches at
``tandem.ONEDNN_CACHE_CAPACITY`` (tandem/ops/linear.py, "Bounded shape caches"). Two workloads, each side a
fresh process (the caches read their capacity once), the sides alternating over ``--repeats``:

* ``engine``: the embedded engine on SmolLM2-135M-Instruct alone, ``--batches`` rollout batches of 8-64
  sequences with random prompt lengths (8-80 tokens) and lengths to generate (4-48), seeded, so both sides
  are given the same requests (tokens counted on both: a sampled stop token can end a sequence elsewhere
  where two processes round differently). Live heap (tcmalloc's count, the default allocator) and RSS after
  batch 5 and at the end; generated tokens per second.
* ``grpo``: the LoRA recipe of bench/lora.py (colocated trainer and engine) for ``--steps`` steps: the
  process's peak RSS and seconds per step (the first left out); the full and QLoRA recipes with ``--recipe``.

    python bench/onednn_cache.py                       # both workloads, 3 repeats (~25 min on 2 cores)
    python bench/onednn_cache.py --only engine --batches 20 --repeats 1

Ends with ``RESULT {json}``: ``engine_live_growth_mib`` / ``engine_rss_growth_mib`` (batch 5 -> end) and
``engine_tokens_per_s`` per side, ``engine_speed_ratio`` (bounded over default), ``grpo_peak_rss_mib`` and
``grpo_s_per_step`` per side, ``grpo_peak_saved_mib``, ``grpo_step_time_ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
SIDES = ("default", "bounded")  # PyTorch's 1,024 entries, named in the environment / Tandem's, left to `import tandem`


def _env(side: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env["PYTHONPATH"] = str(ROOT)
    if side == "default":
        env.update({v: "1024" for v in VARS})
    return env


def _memory() -> tuple[float, float | None]:
    """(RSS MiB, tcmalloc's allocated MiB or None under another allocator)."""
    import ctypes

    from tandem.runtime.metrics import process_metrics

    rss = process_metrics()["sys/rss_mib"]
    try:
        value = ctypes.c_size_t(0)
        fn = ctypes.CDLL(None).MallocExtension_GetNumericProperty
        live = value.value / 2**20 if fn(b"generic.current_allocated_bytes", ctypes.byref(value)) else None
    except AttributeError:
        live = None
    return rss, live


def engine_child(batches: int) -> None:
    from tandem.runtime.allocator import reexec_under

    reexec_under("auto")  # the default allocator, as `tandem train` runs
    from tandem.core.protocols import GenerationRequest, SamplingParams
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import ModelConfig

    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name="smollm2-135m-instruct", dtype="float32"),
                                           max_num_seqs=64, max_model_len=256))
    rng = random.Random(0)
    tokens, seconds, marks = 0, 0.0, {}
    for b in range(batches):
        n = rng.choice([8, 16, 32, 64])
        reqs = [GenerationRequest(prompt_token_ids=[rng.randrange(100, 20000) for _ in range(rng.randrange(8, 81))],
                                  sampling=SamplingParams(temperature=1.0, max_new_tokens=rng.randrange(4, 49),
                                                          seed=b * 1000 + i))
                for i in range(n)]
        t = time.perf_counter()
        results = engine.generate(reqs)
        seconds += time.perf_counter() - t
        tokens += sum(len(c.token_ids) for r in results for c in r.completions)
        if b + 1 in (5, batches):
            marks[b + 1] = _memory()
    (rss5, live5), (rss_end, live_end) = marks[5], marks[batches]
    print(json.dumps({"tokens": tokens, "seconds": seconds, "rss_growth_mib": rss_end - rss5,
                      "live_growth_mib": None if live5 is None else live_end - live5, "rss_end_mib": rss_end,
                      "capacity": os.environ.get("LRU_CACHE_CAPACITY")}), flush=True)


def _child(args: list[str], side: str) -> dict:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=_env(side))
    if proc.returncode != 0:
        raise SystemExit(f"{side}: {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.4g}-{max(xs):.4g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("engine", "grpo"))
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--recipe", choices=("full", "lora", "qlora"), default="lora")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batches < 6:
        ap.error(f"--batches {args.batches}: at least 6 (growth is measured from batch 5 on)")
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (the first step is left out of the step time)")
    if args.engine_child:
        engine_child(args.batches)
        return 0
    result: dict = {"batches": args.batches, "steps": args.steps, "recipe": args.recipe, "repeats": args.repeats}
    runs: dict[str, dict[str, list[dict]]] = {"engine": {s: [] for s in SIDES}, "grpo": {s: [] for s in SIDES}}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-onednn-") as tmp:
        for rep in range(max(args.repeats, 1)):
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
                if args.only != "grpo":
                    r = _child([__file__, "--engine-child", "--batches", str(args.batches)], side)
                    runs["engine"][side].append(r)
                    print(f"repeat {rep + 1} engine {side:>8}: {r['tokens'] / r['seconds']:.1f} tok/s, live "
                          f"{r['live_growth_mib'] or 0:+.0f} MiB, RSS {r['rss_growth_mib']:+.0f} MiB (batch 5 -> "
                          f"{args.batches})", file=sys.stderr, flush=True)
                if args.only != "engine":
                    out = Path(tmp) / f"{side}-{rep}"
                    r = _child([str(ROOT / "bench" / "lora.py"), "--child", args.recipe, "--steps", str(args.steps),
                                "--out", str(out)], side)
                    runs["grpo"][side].append(r)
                    print(f"repeat {rep + 1} grpo   {side:>8}: peak {r['peak_rss_mib']:.0f} MiB, "
                          f"{statistics.median(r['step_s'][1:]):.2f} s/step", file=sys.stderr, flush=True)
    med = statistics.median
    if args.only != "grpo":
        eng = runs["engine"]
        speed = {s: [r["tokens"] / r["seconds"] for r in eng[s]] for s in SIDES}
        live = {s: [r["live_growth_mib"] for r in eng[s]] for s in SIDES}
        rss = {s: [r["rss_growth_mib"] for r in eng[s]] for s in SIDES}
        for s in SIDES:
            print(f"engine {s:>8}: {med(speed[s]):.1f} tok/s ({_spread(speed[s])}), live heap growth "
                  f"{[round(x or 0) for x in live[s]]} MiB, RSS growth {[round(x) for x in rss[s]]} MiB, "
                  f"tokens {[r['tokens'] for r in eng[s]]}")
        has_live = all(x is not None for s in SIDES for x in live[s])
        result |= {"engine_tokens": {s: [r["tokens"] for r in eng[s]] for s in SIDES},
                   "engine_tokens_per_s": {s: round(med(speed[s]), 1) for s in SIDES},
                   "engine_tokens_per_s_spread": {s: _spread(speed[s]) for s in SIDES},
                   "engine_speed_ratio": round(med(speed["bounded"]) / med(speed["default"]), 3),
                   "engine_live_growth_mib": {s: round(med(live[s])) for s in SIDES} if has_live else None,
                   "engine_rss_growth_mib": {s: round(med(rss[s])) for s in SIDES}}
    if args.only != "engine":
        grpo = runs["grpo"]
        peak = {s: [r["peak_rss_mib"] for r in grpo[s]] for s in SIDES}
        step = {s: [med(r["step_s"][1:]) for r in grpo[s]] for s in SIDES}
        for s in SIDES:
            print(f"grpo {args.recipe} {s:>8}: peak RSS {med(peak[s]):.0f} MiB ({_spread(peak[s])}), "
                  f"{med(step[s]):.2f} s/step ({_spread(step[s])})")
        result |= {"grpo_peak_rss_mib": {s: round(med(peak[s])) for s in SIDES},
                   "grpo_peak_rss_spread": {s: _spread(peak[s]) for s in SIDES},
                   "grpo_s_per_step": {s: round(med(step[s]), 2) for s in SIDES},
                   "grpo_s_per_step_spread": {s: _spread(step[s]) for s in SIDES},
                   "grpo_peak_saved_mib": round(med(peak["default"]) - med(peak["bounded"])),
                   "grpo_step_time_ratio": round(med(step["bounded"]) / med(step["default"]), 3)}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
