"""Training throughput of the FSDP engine: packed vs padded micro-batches, and memory per rank.

    .venv/bin/python bench/train_throughput.py [--model smollm2-135m-instruct] [--steps 2]

1. Throughput, one process: the same batch of mixed-length sequences trained with packed micro-batches
   (native model, no padding) and with padded ones (the HF-model fallback), in real (unpadded) tokens
   per CPU-second of one thread (and per wall second), best of ``--steps`` interleaved steps: the
   machine is shared, and CPU time is what other jobs do not inflate. Baseline: padded.
2. Memory: two optimizer steps (activation checkpointing on) in a fresh world of 1 process and of 2
   gloo processes (each rank holding half the batch): peak resident memory per rank (VmHWM) above what
   the process held before building the engine, or ``torch.cuda.max_memory_allocated`` on a GPU.
   FSDP should bring it towards half.

Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.core.batch import TrainBatch  # noqa: E402
from tandem.core.sample import Sample  # noqa: E402

# prompt + response lengths of the throughput batch: mixed, as RL rollouts are (padding ~2x)
LENGTHS = [(24, 16), (32, 40), (20, 70), (40, 90), (30, 150), (50, 200)]


def make_batch(shape, seed: int = 0, vocab: int = 49152) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    samples = [
        Sample(tokens=torch.randint(3, vocab, (p + r,), generator=g).tolist(), response_length=r, index=i)
        for i, (p, r) in enumerate(shape)
    ]
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def pg_loss(out, batch, scale):
    loss = -(out.log_probs * batch.advantages * batch.loss_mask).sum() / scale.num_tokens
    return loss, {}


def engine_config(model: str, **kw):
    from tandem.engines.training.fsdp import FSDPConfig, OptimizerConfig
    from tandem.models import ModelConfig

    return FSDPConfig(model=ModelConfig(name=model), optimizer=OptimizerConfig(lr=1e-6), **kw)


def throughput(model: str, steps: int) -> dict[str, dict]:
    """Per-step wall and CPU time of packed and padded training, steps interleaved.

    The machine is shared: wall time swings with other jobs, while the process's CPU time in one
    thread counts only the work done, so the ratio is taken from CPU time (best of ``steps``).
    """
    from tandem.engines.training.fsdp import FSDPEngine

    engines = {
        name: FSDPEngine(engine_config(model, packing=name == "packed", micro_batch_tokens=1024))
        for name in ("packed", "padded")
    }
    batch = make_batch(LENGTHS)
    real_tokens = int((batch.seq_lengths - 1).sum())
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    fed: dict[str, float] = {}
    for engine in engines.values():
        engine.train_step(make_batch([(8, 8)], seed=99), pg_loss)  # warm-up
    for _ in range(steps):
        for name, engine in engines.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fed[name] = engine.train_step(batch, pg_loss)["train/tokens"]
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    return {
        name: {
            "tokens_per_cpu_s": real_tokens / min(cpu[name]),
            "tokens_per_s": real_tokens / min(wall[name]),
            "fed_tokens_per_step": fed[name],
            "wall_s": wall[name],
            "cpu_s": cpu[name],
        }
        for name in engines
    }


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (VmHWM; unlike ru_maxrss it does not survive exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


MEMORY_BATCH = [(16, 112)] * 4  # 4 x 128 tokens; each of 2 ranks takes 2 rows


def memory_worker(rank: int, world: int, model: str, port: int, out: str) -> None:
    """One step with activation checkpointing; writes the peak memory above the pre-engine level."""
    import torch.distributed as dist

    from tandem.engines.training.common import split_for_data_parallel
    from tandem.engines.training.fsdp import FSDPEngine, ParallelConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    base = rss_bytes()
    engine = FSDPEngine(
        engine_config(model, micro_batch_tokens=128, parallel=ParallelConfig(activation_checkpointing=True))
    )
    batch = make_batch(MEMORY_BATCH, seed=1)
    local = batch.select(split_for_data_parallel(batch, world)[rank])
    for _ in range(2):  # the second step runs with the optimizer state allocated: the peak
        engine.train_step(local, pg_loss)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:  # the pre-engine level was below the peak
        peak = peak_rss_bytes() - base
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak}))
    if world > 1:
        dist.destroy_process_group()


def peak_memory(model: str, world: int) -> float:
    """Mean peak bytes per rank, each world in fresh processes so high-water marks start clean."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # glibc keeps freed blocks below its (growing) mmap threshold in its heap, so resident memory
    # would show the allocator's history rather than the tensors alive; a fixed 1 MiB threshold
    # returns large blocks to the OS when freed. Same setting for both worlds.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(memory_worker, args=(world, model, port, out), nprocs=world, start_method="spawn")
        peaks = [json.loads(Path(out, f"rank{r}.json").read_text())["peak_bytes"] for r in range(world)]
    return sum(peaks) / len(peaks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the throughput part")
    args = p.parse_args()
    from tandem.models import resolve_model

    resolve_model(args.model)  # build the cache once, outside any timing
    torch.set_num_threads(args.threads)
    runs = throughput(args.model, args.steps)
    packed, padded = runs["packed"], runs["padded"]
    for name, r in runs.items():
        walls = ", ".join(f"{t:.1f}" for t in r["wall_s"])
        cpus = ", ".join(f"{t:.1f}" for t in r["cpu_s"])
        print(
            f"{name}: {r['tokens_per_cpu_s']:.1f} real tokens per CPU-second, {r['tokens_per_s']:.1f} per wall "
            f"second (best), {r['fed_tokens_per_step']:.0f} fed/step; wall {walls} s; CPU {cpus} s"
        )
    mem1 = peak_memory(args.model, 1)
    mem2 = peak_memory(args.model, 2)
    print(f"peak memory per rank: world 1 {mem1 / 2**20:.0f} MiB, world 2 {mem2 / 2**20:.0f} MiB")
    result = {
        "model": args.model,
        "threads": args.threads,
        "packed_tokens_per_cpu_s": round(packed["tokens_per_cpu_s"], 2),
        "padded_tokens_per_cpu_s": round(padded["tokens_per_cpu_s"], 2),
        "packed_vs_padded": round(packed["tokens_per_cpu_s"] / padded["tokens_per_cpu_s"], 3),
        "packed_vs_padded_wall": round(packed["tokens_per_s"] / padded["tokens_per_s"], 3),
        "padded_fed_vs_real_tokens": round(padded["fed_tokens_per_step"] / packed["fed_tokens_per_step"], 3),
        "peak_mib_world1": round(mem1 / 2**20, 1),
        "peak_mib_world2_per_rank": round(mem2 / 2**20, 1),
        "memory_ratio_world2": round(mem2 / mem1, 3),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
