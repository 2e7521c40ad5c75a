"""The embedded engine's slots sized to the rollout batch (the default since 2026-12-06) vs the old fixed 32.

    .venv/bin/python bench/rollout_slots.py [--recipe recipes/smollm2-135m/addition-grpo.yaml] [--steps 4]
                                            [--repeats 3] [--allocator auto|glibc|tcmalloc|jemalloc]

A run whose ``inference.torch.max_num_seqs`` is unset gives the engine a slot for every sequence one rollout
round submits (`tandem.engines.inference.torch.config.auto_num_seqs`: ``prompts_per_step x
n_samples_per_prompt``, at least 32, within the cache budget of 32 x 2,048 tokens); before, it had 32 slots
whatever the batch, so the demo's 64 sequences decoded in two waves. Each repeat runs each arm in a fresh
process (the order alternating): the recipe's run is built as `tandem train` builds it (the default
allocator, ``--allocator``), then takes ``--steps`` rollout rounds (generation, rewards, the recipe's
over-sampling rounds; no training, so the weights and hence the work stay the same) and times each. Both arms
draw the same tokens (each request's sampler is seeded; a sequence's numerics do not depend on its batch
here): the bench checks it and reports ``same_tokens``. Medians and min-max over all rounds but each
process's first.

RESULT keys: ``rollout_slots_time_ratio`` (auto / 32 seconds per round, lower is better), ``auto_slots``,
``auto_round_s``, ``fixed32_round_s`` and their min-max, ``tokens_per_round``, ``same_tokens``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARMS = {"auto": [], "fixed32": ["inference.torch.max_num_seqs=32"]}


def child(a) -> None:
    """One arm in this process; prints one JSON line."""
    from tandem.config import load_config
    from tandem.runtime.allocator import reexec_under
    from tandem.runtime.config import RunConfig
    from tandem.runtime.loop import Run

    cfg = load_config(RunConfig, a.recipe, ["run.save_every=0", "eval.sets=[]", "tracking.progress=false",
                                            *ARMS[a.child]])
    allocator = reexec_under(cfg.runtime.allocator if a.allocator == "auto" else a.allocator)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-slots-") as tmp:
        run = Run(cfg, Path(tmp), overwrite=True)
        try:
            digest, times, tokens = hashlib.sha256(), [], []
            for step in range(a.steps):
                t = time.perf_counter()
                _, everything, _ = run.rollouts.step(step, phase=lambda name: None)
                times.append(time.perf_counter() - t)
                tokens.append(sum(s.response_length for s in everything))
                for s in everything:
                    digest.update(json.dumps(s.tokens).encode())
            slots = run.engine.health()["num_slots"]
        finally:
            run.close()
    print("CHILD " + json.dumps({"allocator": allocator, "times": times, "tokens": tokens, "slots": slots,
                                 "digest": digest.hexdigest()}), flush=True)


def _spread(values: list[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m" / "addition-grpo.yaml"))
    p.add_argument("--steps", type=int, default=4, help="rollout rounds per process (the first is dropped)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per arm, alternating")
    p.add_argument("--allocator", choices=("auto", "glibc", "tcmalloc", "jemalloc"), default="auto",
                   help="host allocator of each arm's process (auto: the recipe's runtime.allocator, the default path)")
    p.add_argument("--child", choices=tuple(ARMS), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.repeats < 3:
        p.error(f"--repeats={a.repeats}: at least 3 for a median and a spread")
    if a.steps < 2:
        p.error(f"--steps={a.steps}: at least 2 (each process's first round is dropped)")
    if a.child:
        child(a)
        return
    load = os.getloadavg()[0]
    round_s: dict[str, list[float]] = {arm: [] for arm in ARMS}
    first: dict[str, dict] = {}
    digests: set[str] = set()
    for rep in range(a.repeats):
        for arm in ARMS if rep % 2 == 0 else list(ARMS)[::-1]:
            cmd = [sys.executable, __file__, "--child", arm, "--recipe", a.recipe, "--steps", str(a.steps),
                   "--allocator", a.allocator]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("CHILD ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{arm} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            r = json.loads(lines[-1][len("CHILD "):])
            first.setdefault(arm, r)
            digests.add(r["digest"])
            round_s[arm].extend(r["times"][1:])
            print(f"  rep {rep} {arm:7s} ({r['slots']} slots) rounds {' '.join(f'{t:.2f}' for t in r['times'])} s, "
                  f"tokens {r['tokens']}", flush=True)
    med = {arm: statistics.median(v) for arm, v in round_s.items()}
    out = {
        "recipe": Path(a.recipe).name, "steps": a.steps, "repeats": a.repeats, "allocator": first["auto"]["allocator"],
        "auto_slots": first["auto"]["slots"], "fixed_slots": first["fixed32"]["slots"],
        "auto_round_s": round(med["auto"], 3), "fixed32_round_s": round(med["fixed32"], 3),
        "auto_round_min_max": _spread(round_s["auto"]), "fixed32_round_min_max": _spread(round_s["fixed32"]),
        "tokens_per_round": first["auto"]["tokens"], "same_tokens": len(digests) == 1,
        "rollout_slots_time_ratio": round(med["auto"] / med["fixed32"], 3),
        "load_avg_start": round(load, 2), "load_avg_end": round(os.getloadavg()[0], 2),
    }
    print(f"{out['auto_slots']} slots {med['auto']:.2f} s a round vs 32 slots {med['fixed32']:.2f} s "
          f"({out['rollout_slots_time_ratio']:.3f}x); same tokens: {out['same_tokens']}", flush=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
