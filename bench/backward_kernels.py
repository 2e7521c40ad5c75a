"""The trainer's RMSNorm / rotary / SwiGLU backward passes: native one-pass kernels (the default) vs torch ops.

    .venv/bin/python bench/backward_kernels.py [--model smollm2-135m-instruct] [--group 4] [--prompts 8]
                                               [--repeats 5] [--steps 3] [--threads 2]
                                               [--allocator auto|glibc|tcmalloc|jemalloc]

`trainer.fsdp.pointwise_kernels` (default ``auto``: native where the C kernels build, CPU, normal mode) runs
the backward of the lean autograd functions (tandem/models/lean_ops.py) as one pass each
(tandem/ops/csrc/pointwise.c); ``torch`` runs their torch formulas (the path before 2026-12-06). The batch is
`bench/prompt_sharing.py`'s (the vs-TRL prompts in SmolLM2's chat template, ``--group`` responses of 8..48
tokens each, shared prompts on: the default path). Each repeat runs each arm in a fresh process (the order
alternating): it builds the engine from the same weights, takes one warm-up optimizer step (``train_step``)
and ``--steps`` timed ones on the same batch. Two engines in one process ran 10-20% slower than one and
drifted with each other's memory, hence the processes. Each process runs under ``--allocator`` (default
``auto``: what `tandem train` runs under, tcmalloc where it is installed; `runtime.allocator`): the torch
formulas allocate ~6 temporaries of [tokens, 1536] floats a layer, which cost far more under glibc's malloc,
which maps and unmaps buffers that large at each allocation, than under a caching allocator. Medians and
min-max over all timed steps. Also checked: the two arms' loss and gradient norm on their first step (same
weights, same batch).

RESULT keys: ``backward_kernel_step_ratio`` (native / torch step time, lower is better), ``native_step_s``,
``torch_step_s`` and their min-max, ``grad_norm_rel_diff``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_sharing import make_batch, pg_loss, spread  # noqa: E402


def child(a) -> None:
    """One arm in this process: build, warm up, time ``--steps`` steps; print one JSON line."""
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine
    from tandem.models import ModelConfig
    from tandem.runtime.allocator import reexec_under

    allocator = reexec_under(a.allocator)  # as `tandem train` does
    torch.set_num_threads(a.threads)
    batch = make_batch(a.model, a.prompts, a.group)
    engine = FSDPEngine(FSDPConfig(model=ModelConfig(name=a.model), pointwise_kernels=a.child))
    if a.child == "native" and engine._grad_kernels is None:
        raise SystemExit("the native kernels did not load: nothing to compare")
    first = engine.train_step(batch, pg_loss)
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        engine.train_step(batch, pg_loss)
        times.append(time.perf_counter() - t)
    print("CHILD " + json.dumps({"allocator": allocator, "times": times, "loss": first["train/loss"], "grad_norm": first["train/grad_norm"],
                                 "tokens": first["train/tokens"]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--group", type=int, default=4, help="responses per prompt")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per arm, alternating")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--allocator", choices=("auto", "glibc", "tcmalloc", "jemalloc"), default="auto",
                   help="host allocator of each arm's process (runtime.allocator; auto: the default path)")
    p.add_argument("--child", choices=("torch", "native"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.repeats < 3:
        p.error(f"--repeats={a.repeats}: at least 3 for a median and a spread")
    if a.group < 1 or a.prompts < 1 or a.steps < 1:
        p.error(f"--group={a.group}, --prompts={a.prompts} and --steps={a.steps} must be >= 1")
    if a.child:
        child(a)
        return
    load = os.getloadavg()[0]
    arms = ("torch", "native")
    step_s: dict[str, list[float]] = {arm: [] for arm in arms}
    first: dict[str, dict] = {}
    for rep in range(a.repeats):
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            cmd = [sys.executable, __file__, "--child", arm, "--model", a.model, "--group", str(a.group),
                   "--prompts", str(a.prompts), "--steps", str(a.steps), "--threads", str(a.threads),
                   "--allocator", a.allocator]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("CHILD ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{arm} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            r = json.loads(lines[-1][len("CHILD "):])
            first.setdefault(arm, r)
            step_s[arm].extend(r["times"])
            print(f"  rep {rep} {arm:6s} steps {' '.join(f'{t:.2f}' for t in r['times'])} s  "
                  f"tokens {r['tokens']:.0f}", flush=True)
    med = {arm: statistics.median(v) for arm, v in step_s.items()}
    gn = {arm: first[arm]["grad_norm"] for arm in arms}
    out = {
        "model": a.model, "prompts": a.prompts, "group": a.group, "repeats": a.repeats, "steps": a.steps,
        "threads": a.threads, "allocator": first["native"]["allocator"], "fed_tokens": first["native"]["tokens"],
        **{f"{arm}_step_s": round(med[arm], 3) for arm in arms},
        **{f"{arm}_step_min_max": spread(step_s[arm]) for arm in arms},
        "backward_kernel_step_ratio": round(med["native"] / med["torch"], 3),
        "first_loss": {arm: first[arm]["loss"] for arm in arms},
        "grad_norm_rel_diff": abs(gn["native"] - gn["torch"]) / max(abs(gn["torch"]), 1e-30),
        "load_avg_start": round(load, 2), "load_avg_end": round(os.getloadavg()[0], 2),
    }
    print(f"allocator {out['allocator']}: torch {med['torch']:.2f} s, native {med['native']:.2f} s a step "
          f"({out['backward_kernel_step_ratio']:.3f}x); grad norm rel diff {out['grad_norm_rel_diff']:.1e}", flush=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
