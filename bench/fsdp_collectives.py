"""FSDP's all-gather and reduce-scatter on gloo: point-to-point rings (the default) against gloo's collectives.

    .venv/bin/python bench/fsdp_collectives.py [--model smollm2-135m-instruct] [--repeats 3] [--steps 4]

Two parts, each alternating the two arms (order flipped every round) in fresh 2-rank gloo worlds, one torch
thread per rank, under the default host allocator (as `tandem train` runs):

1. Collectives alone: one decoder layer's bytes of SmolLM2-135M (3.54 M fp32 values, 13.5 MiB) reduce-scattered
   and its half all-gathered, 10 calls in a world of their own for each, with each call's input allocated beforehand; the median
   call time and the rise of the resident high-water mark (VmHWM) during the calls, rank 0.
2. Training steps: an FSDP engine at world 2 on the default configuration (``parallel.ring_collectives`` true
   or false, everything else default; ``--activation-checkpointing`` turns that on for both arms) trains ``--steps`` steps of the same batch (4 sequences x 128 tokens,
   each rank 2); every step is timed between barriers and the first (warm-up, optimizer state allocation) is
   left out; medians over all kept steps and rounds, spread = (max - min) / median; the loss of the last step
   of both arms (the same batch and weights: equal if the gradients are).

Ends with one line ``RESULT {json}``: ``ring_step_time_ratio`` = rings / gloo step time (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_throughput import MEMORY_BATCH, engine_config, make_batch, peak_rss_bytes, pg_loss  # noqa: E402

MIB = 2**20
LAYER_NUMEL = 3_538_944  # one SmolLM2-135M decoder layer: q, o 576x576; k, v 576x192; gate, up, down 576x1536
CALLS = 10
ARMS = ("rings", "gloo")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _leave() -> None:
    import torch.distributed as dist

    from tandem.engines.training.common.rank_exit import exit_rank

    dist.destroy_process_group()
    exit_rank(0)


def collectives_worker(rank: int, arm: str, port: int, out: str, op: str) -> None:
    """One collective ``op`` in a world of its own (its high-water mark not under the other's)."""
    import torch.distributed as dist

    from tandem.engines.training.fsdp.ring_comms import ring_all_gather, ring_reduce_scatter

    _join(rank, port)
    group = dist.group.WORLD
    numel = LAYER_NUMEL if op == "reduce_scatter" else LAYER_NUMEL // 2
    inputs = [torch.randn(numel) for _ in range(CALLS)]  # before the high-water mark is read
    output = torch.zeros(LAYER_NUMEL // 2 if op == "reduce_scatter" else LAYER_NUMEL)  # touched, as the inputs
    dist.barrier()
    before = peak_rss_bytes()
    times = []
    for x in inputs:
        t = time.perf_counter()
        if op == "reduce_scatter" and arm == "rings":
            ring_reduce_scatter(output, x, group)  # sums into x in place, as FSDP's copy-in buffer
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(output, x, group=group)
        elif arm == "rings":
            ring_all_gather(output, x, group)
        else:
            dist.all_gather_into_tensor(output, x, group=group)
        times.append(time.perf_counter() - t)
    found = {op: {"ms": statistics.median(times) * 1e3, "hwm_rise_mib": (peak_rss_bytes() - before) / MIB}}
    if rank == 0:
        Path(out, "c.json").write_text(json.dumps(found))
    _leave()


def steps_worker(rank: int, arm: str, port: int, out: str, model: str, steps: int, ac: bool) -> None:
    import torch.distributed as dist

    from tandem.engines.training.common import split_for_data_parallel
    from tandem.engines.training.fsdp import ParallelConfig

    _join(rank, port)
    from tandem.engines.training.fsdp import FSDPEngine

    engine = FSDPEngine(engine_config(model, parallel=ParallelConfig(ring_collectives=arm == "rings",
                                                                     activation_checkpointing=ac)))
    batch = make_batch(MEMORY_BATCH, seed=1)
    local = batch.select(split_for_data_parallel(batch, 2)[rank])
    times, loss = [], None
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        loss = engine.train_step(local, pg_loss)["train/loss"]
        dist.barrier()
        times.append(time.perf_counter() - t)
    if rank == 0:
        Path(out, "s.json").write_text(json.dumps({"times": times, "loss": loss}))
    _leave()


def spawn(fn, arm: str, *args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(fn, args=(arm, _port(), out, *args), nprocs=2, start_method="spawn")
        return json.loads(next(Path(out).glob("*.json")).read_text())


def spread(v: list[float]) -> float:
    return round((max(v) - min(v)) / statistics.median(v), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of both arms")
    p.add_argument("--steps", type=int, default=4, help="training steps per world (the first is left out)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="train with parallel.activation_checkpointing (as the memory bench does); default off")
    args = p.parse_args()
    if args.steps < 2:
        p.error(f"--steps {args.steps}: at least 2 (the first step is left out)")
    from tandem.models import resolve_model
    from tandem.runtime.allocator import reexec_under

    allocator = reexec_under("auto")
    print(f"host allocator: {allocator}", flush=True)
    resolve_model(args.model)
    coll: dict[str, dict[str, list[float]]] = {a: {} for a in ARMS}
    step_s: dict[str, list[float]] = {a: [] for a in ARMS}
    losses: dict[str, float] = {}
    for r in range(args.repeats):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            c = {op: spawn(collectives_worker, arm, op)[op] for op in ("reduce_scatter", "all_gather")}
            for op, v in c.items():
                for k, x in v.items():
                    coll[arm].setdefault(f"{op}_{k}", []).append(x)
            s = spawn(steps_worker, arm, args.model, args.steps, args.activation_checkpointing)
            step_s[arm] += s["times"][1:]
            losses[arm] = s["loss"]
            print(f"round {r + 1}/{args.repeats} {arm}: reduce-scatter {c['reduce_scatter']['ms']:.2f} ms "
                  f"(+{c['reduce_scatter']['hwm_rise_mib']:.1f} MiB), all-gather {c['all_gather']['ms']:.2f} ms "
                  f"(+{c['all_gather']['hwm_rise_mib']:.1f} MiB); steps {[round(t, 2) for t in s['times']]} s",
                  flush=True)
    med = {a: statistics.median(v) for a, v in step_s.items()}
    result = {
        "model": args.model, "allocator": allocator, "world": 2, "threads_per_rank": 1, "repeats": args.repeats,
        "steps_per_world": args.steps, "activation_checkpointing": args.activation_checkpointing,
        "step_s": {a: round(med[a], 3) for a in ARMS},
        "step_s_spread": {a: spread(step_s[a]) for a in ARMS},
        "ring_step_time_ratio": round(med["rings"] / med["gloo"], 3),
        "last_loss": losses,
        "collectives": {a: {k: round(statistics.median(v), 2) for k, v in coll[a].items()} for a in ARMS},
    }
    for a in ARMS:
        print(f"{a}: step {med[a]:.2f} s (spread {result['step_s_spread'][a]}), " + ", ".join(
            f"{k} {v}" for k, v in result["collectives"][a].items()))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
