"""The Megatron engine: full fine-tuning vs LoRA of SmolLM2-135M-Instruct on one fixed GRPO batch.

Each run is a fresh process (one rank, gloo, fp32, Megatron's local layer spec, under the allocator `tandem train`
picks, ``runtime.allocator: auto``: tcmalloc where installed) that builds a `MegatronEngine`
and takes ``--steps`` optimizer steps on `bench/prompt_sharing.py`'s batch (8 arithmetic prompts x 8 responses
of 8-48 tokens, random advantages; the same batch on both sides), then exports what a sync would send
(`named_parameters_for_sync`: the full weights, or LoRA's adapters under peft's names). The sides alternate
(full, lora, then rotated) over ``--repeats``. Per run: peak RSS (VmHWM) and its rise over the built engine,
trainer state (parameters, gradients, AdamW state, counted from the engine), median seconds per step after the
first, and the sync's bytes and seconds. LoRA: rank 16 on every linear layer (``q_proj`` ... ``down_proj``),
alpha 32, as recipes/smollm2-135m/addition-grpo-lora.yaml trains on the FSDP engine.

    python bench/megatron_lora.py                 # 4 steps x 3 repeats (~6 min on 2 cores)
    python bench/megatron_lora.py --steps 3 --repeats 1

Ends with ``RESULT {json}``: ``megatron_lora_sync_bytes_ratio``, ``megatron_lora_peak_memory_ratio``,
``megatron_lora_step_time_ratio`` (LoRA over full; issue 20's aims for the FSDP engine are 0.02 / 0.6 / 1.0).
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

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hwm_mib() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss may carry the forking parent's across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def child(name: str, steps: int) -> None:
    """One run in this process; prints one JSON line."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from prompt_sharing import make_batch, pg_loss

    from tandem.engines.training.megatron import LoRAConfig, MegatronConfig, MegatronEngine, OptimizerConfig
    from tandem.models import ModelConfig
    from tandem.runtime.allocator import reexec_under

    allocator = reexec_under("auto")  # as `tandem train` runs (runtime.allocator: auto): tcmalloc where installed
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    lora = LoRAConfig(rank=16, alpha=32.0, target_modules=TARGETS, sync="adapter") if name == "lora" else None
    batch = make_batch(MODEL, 8, 8)
    t0 = time.perf_counter()
    engine = MegatronEngine(MegatronConfig(model=ModelConfig(name=MODEL), micro_batch_tokens=2048, lora=lora,
                                           optimizer=OptimizerConfig(lr=1e-5 if lora is None else 2e-4)))
    build_s, built_mib = time.perf_counter() - t0, _hwm_mib()
    times, losses = [], []
    for _ in range(steps):
        t = time.perf_counter()
        m = engine.train_step(batch, pg_loss)
        times.append(time.perf_counter() - t)
        losses.append(m["train/loss"])
    t = time.perf_counter()
    sync_bytes = sum(x.numel() * x.element_size() for bucket in engine.named_parameters_for_sync(1 << 28)
                     for _, x in bucket)
    sync_s = time.perf_counter() - t
    params = [p for _, _, p in engine.params]
    state = {
        "params_mib": sum(p.numel() * p.element_size() for p in params) / 2**20,
        "trainable_mib": sum(p.numel() * p.element_size() for p in params if p.requires_grad) / 2**20,
        "optimizer_mib": sum(v.numel() * v.element_size() for inner in engine.optim._inner
                             for st in inner.state.values() for v in st.values() if hasattr(v, "numel")) / 2**20,
    }
    engine.close()
    print(json.dumps({"name": name, "allocator": allocator, "train_s": times, "loss": losses, "build_s": build_s, "built_mib": built_mib,
                      "peak_mib": _hwm_mib(), "sync_bytes": sync_bytes, "sync_s": sync_s,
                      "tokens": int(batch.seq_lengths.sum()),
                      **state}), flush=True)


def _run_child(name: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(steps)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> list[float]:
    return [round(min(xs), 3), round(max(xs), 3)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps={args.steps}: at least 2 (the first step is left out of the timing)")
    if args.child:
        child(args.child, args.steps)
        return 0
    names = ["full", "lora"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(max(args.repeats, 1)):
        for name in names[rep % 2:] + names[:rep % 2]:
            r = _run_child(name, args.steps)
            r["step_s"] = statistics.median(r["train_s"][1:])
            runs[name].append(r)
            print(f"repeat {rep + 1} {name:>4}: {r['step_s']:.2f} s a step, peak {r['peak_mib']:.0f} MiB "
                  f"(built {r['built_mib']:.0f}), sync {r['sync_bytes'] / 2**20:.1f} MiB in {r['sync_s']:.2f} s, "
                  f"loss {', '.join(f'{x:.4f}' for x in r['loss'])}", file=sys.stderr, flush=True)
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in
               ("step_s", "peak_mib", "built_mib", "sync_bytes", "sync_s", "params_mib", "trainable_mib",
                "optimizer_mib")} for n in names}
    for n in names:
        m = med[n]
        print(f"{n:>5}: {m['step_s']:.2f} s a step {_spread([r['step_s'] for r in runs[n]])}, peak "
              f"{m['peak_mib']:.0f} MiB {_spread([r['peak_mib'] for r in runs[n]])}, sync {m['sync_bytes'] / 2**20:.1f} "
              f"MiB, trainable {m['trainable_mib']:.1f} MiB, AdamW {m['optimizer_mib']:.1f} MiB")
    result = {
        "model": MODEL, "engine": "megatron (1 rank, gloo, fp32, local spec)", "steps": args.steps,
        "repeats": args.repeats, "lora_rank": 16, "target_modules": list(TARGETS),
        "allocator": runs["full"][0]["allocator"],
        "megatron_lora_sync_bytes_ratio": round(med["lora"]["sync_bytes"] / med["full"]["sync_bytes"], 4),
        "megatron_lora_peak_memory_ratio": round(med["lora"]["peak_mib"] / med["full"]["peak_mib"], 3),
        "megatron_lora_step_time_ratio": round(med["lora"]["step_s"] / med["full"]["step_s"], 3),
        "medians": {n: {k: round(v, 3) for k, v in med[n].items()} for n in names},
        "spreads": {n: {k: _spread([r[k] for r in runs[n]]) for k in ("step_s", "peak_mib")} for n in names},
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
