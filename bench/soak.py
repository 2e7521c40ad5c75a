"""Soak: a tiny recipe for many steps in each loop mode; resident memory, open files and threads stay flat.

Each mode runs ``tandem train recipes/tiny/grpo-sync.yaml`` in a fresh process for ``--steps`` steps,
with checkpoints every ``--save-every`` steps (``keep_checkpoints: 2``, so saving and pruning run all
along) and an evaluation every ``--save-every`` steps. The loop logs ``sys/rss_mib``, ``sys/open_fds``
and ``sys/threads`` every step (`tandem.runtime.metrics.process_metrics`); after a warm-up (the first
``--warmup`` fraction of the steps) the figures of the last tenth are compared with those just after the
warm-up: growth = median(last tenth) / median(tenth after warm-up) - 1.

Aim (issue 23): growth < 5% for memory and open files, no more threads at the end than after warm-up.

    python bench/soak.py                      # 1,000 steps x 3 modes (~10 minutes on 2 cores)
    python bench/soak.py --steps 120          # the bounded version the test suite runs

Ends with ``RESULT {json}``: per mode ``rss_growth`` (medians of the window after warm-up and the last
tenth), ``fds_growth`` (the windows' minimum open files: a leak raises it, a file held open for a moment by
the background rollout does not), ``threads_growth`` (the last tenth's fewest threads minus the fewest
after warm-up: one_step_off's rollout thread is alive or finished when a step is sampled, by timing),
``s_per_step`` and ``ok``; ``soak_ok`` when every mode passed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
MODES = {
    "sync": [],
    "one_step_off": ["algorithm.off_policy.mode=tis"],
    "fully_async": ["algorithm.off_policy.mode=tis", "runtime.max_staleness=2"],
}
AIM = 0.05


def _series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def soak(mode: str, steps: int, save_every: int, warmup: float, out: Path) -> dict:
    run_dir = out / mode
    cmd = [sys.executable, "-m", "tandem.cli", "train", str(RECIPE), f"runtime.mode={mode}", *MODES[mode],
           f"run.steps={steps}", f"run.save_every={save_every}", "run.keep_checkpoints=2",
           "eval.sets=[{name: held, data: {source: 'synthetic:arithmetic'}, max_prompts: 4}]",
           f"eval.every={save_every}", "--run-dir", str(run_dir), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=max(600, steps * 3))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"soak {mode}: tandem train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "sys/rss_mib" in r]  # the rows of steps (not the final evaluation's)
    if len(rows) != steps:
        raise SystemExit(f"soak {mode}: {len(rows)} step rows for {steps} steps")
    start = int(steps * warmup)
    tenth = max(1, steps // 10)
    after_warmup, last = rows[start:start + tenth], rows[-tenth:]

    def growth(key: str, pick=statistics.median) -> float:
        return pick(_series(last, key)) / pick(_series(after_warmup, key)) - 1.0

    # open files: the floor of each window. A leak raises the floor; files a background rollout or save
    # holds open for a moment do not (one_step_off samples 5 or 8 open files from step to step, by timing)

    result = {
        "steps": steps,
        "rss_mib_after_warmup": statistics.median(_series(after_warmup, "sys/rss_mib")),
        "rss_mib_end": statistics.median(_series(last, "sys/rss_mib")),
        "rss_growth": growth("sys/rss_mib"),
        "fds_after_warmup": min(_series(after_warmup, "sys/open_fds")),
        "fds_end": min(_series(last, "sys/open_fds")),
        "fds_growth": growth("sys/open_fds", min),
        # threads: the floor too. one_step_off starts the next rollout's thread before training; when a step
        # is sampled it has finished or not by timing (10 or 11 threads), and a leak raises the floor
        "threads_growth": min(_series(last, "sys/threads")) - min(_series(after_warmup, "sys/threads")),
        "threads_max_end": max(_series(last, "sys/threads")),
        "s_per_step": wall / steps,
        "wall_s": wall,
    }
    result["ok"] = result["rss_growth"] < AIM and result["fds_growth"] < AIM and result["threads_growth"] <= 0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=0, help="default: steps // 10")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the steps left out as warm-up")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="", help="keep the run folders here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.steps < 20:
        ap.error(f"--steps {args.steps}: at least 20 steps (a warm-up and two tenths to compare)")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown mode {bad[0]!r} (choose from {', '.join(MODES)})")
    save_every = args.save_every or max(1, args.steps // 10)
    with tempfile.TemporaryDirectory(prefix="tandem-soak-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        results = {}
        for mode in modes:
            results[mode] = r = soak(mode, args.steps, save_every, args.warmup, out)
            print(f"{mode:>13}: {r['steps']} steps, {r['s_per_step']:.3f} s/step | RSS {r['rss_mib_after_warmup']:.0f}"
                  f" -> {r['rss_mib_end']:.0f} MiB ({r['rss_growth']:+.1%}) | fds {r['fds_after_warmup']:.0f} -> "
                  f"{r['fds_end']:.0f} ({r['fds_growth']:+.1%}) | threads {r['threads_growth']:+.0f} | "
                  f"{'ok' if r['ok'] else 'GROWS'}", flush=True)
    summary = {"modes": results, "soak_ok": all(r["ok"] for r in results.values()), "aim_growth": AIM}
    print("RESULT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
