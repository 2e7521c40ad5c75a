"""Training throughput of the FSDP engine (packing gain vs model gain), and memory per rank, itemised.

    .venv/bin/python bench/train_throughput.py [--model smollm2-135m-instruct] [--steps 3]
                                               [--memory-only | --throughput-only] [--shape mixed|grpo]
                                               [--threads 1]

1. Throughput, one process, one torch thread: the same batch of mixed-length sequences trained by
   four arms, steps interleaved (the order rotating each repeat), ``--steps`` repeats, median and
   spread (min-max) of real (unpadded) tokens per CPU-second (and per wall second): the machine is
   shared, and CPU time is what other jobs do not inflate.

   * ``native_packed``: the native model on packed micro-batches (the engine's default);
   * ``native_padded``: the native model fed exactly the padded micro-batches of the HF fallback (each
     row right-padded to its micro-batch's longest, as equal-length segments: causal attention keeps
     real tokens off the padding, so the log-probs are the packed ones). The engine has no setting
     for this (``packing = False`` also switches to the HF model), so the bench subclasses it;
   * ``hf_padded``: ``packing = False``, the HF-model fallback on padded micro-batches;
   * ``native_packed_bf16``: ``native_packed`` with ``parallel.param_dtype: bfloat16`` (the forward under
     bf16 autocast, fp32 master weights and AdamW state): ``bf16_gain`` = it / ``native_packed`` (on a CPU
     with AVX512-BF16 or AMX bf16 products run ~2.5x fp32's), ``bf16_loss_delta`` its first step's loss
     minus fp32's (the same weights and batch).

   packing gain = native packed / native padded; model gain = native padded / HF padded; their
   product is the old packed / padded figure. Padding ratio = fed / real tokens of a padded step.
2. Memory: steps (activation checkpointing on) in a fresh world of 1 process and of 2 gloo processes
   (each rank holding half the batch); world 2 three times: the default path (``parallel.vocab_parallel``, the
   embedding used by vocabulary shard; ``parallel.ring_collectives``, FSDP's all-gather and reduce-scatter as
   point-to-point rings), ``vocab_parallel: false`` (gathered whole, for the gain) and ``ring_collectives:
   false`` (gloo's own collectives, for that gain); the four arms alternate over ``--memory-repeats`` rounds (order rotating), medians and min-max. Peak resident memory per rank (VmHWM) over two optimizer steps
   above the level before building the engine (or ``torch.cuda.max_memory_allocated`` on a GPU), then
   a third, identical step under torch's tensor memory tracker (``MemTracker``, ``FSDPMemTracker`` at
   world 2: every live tensor storage, by role) itemises the peak: parameters, gradients and AdamW
   state (local shard sizes read from the tensors), the gathered tied embedding, backward temporaries,
   activations (live at the peak; and, apart, the most a micro-batch's forward keeps for its backward),
   FSDP's communication buffers, and what resident memory holds beyond live tensors (allocator,
   libraries). The logits buffers are computed (rows x vocab x 4 bytes x buffers live), not measured.

Host allocator: the default path, as `tandem train` runs (``runtime.allocator: auto``: tcmalloc when
installed, `make allocator`); the bench restarts itself under it and the ranks inherit it. ``--allocator
glibc`` measures on glibc malloc with a 1 MiB mmap threshold (the figures before 2026-12-05). Reported
as ``allocator``.

Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.core.batch import TrainBatch  # noqa: E402
from tandem.core.sample import Sample  # noqa: E402

MIB = 2**20
# prompt + response lengths of the throughput batch: mixed, as RL rollouts are (padding ~2x)
LENGTHS = [(24, 16), (32, 40), (20, 70), (40, 90), (30, 150), (50, 200)]
# --shape: the batch trained ("mixed": LENGTHS; "grpo": the demo's / vs_trl's shape, 32 x (60 + 30) tokens)
SHAPES = {"mixed": LENGTHS, "grpo": [(60, 30)] * 32}
ARMS = ("native_packed", "native_padded", "hf_padded", "native_packed_bf16")


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


def padded_as_packed(mb):
    """A padded ``[b, L]`` micro-batch as ``b`` packed segments of ``L`` tokens each (the same tokens)."""
    from tandem.engines.training.common import MicroBatch

    b, length = mb.input_ids.shape
    return MicroBatch(
        input_ids=mb.input_ids.reshape(-1),
        positions=mb.positions.reshape(-1),
        cu_seqlens=torch.arange(b + 1, dtype=torch.long) * length,
        attention_mask=None,
        select=mb.select,  # row * L + position: the flattened padded index is the packed one
        targets=mb.targets,
        scatter=mb.scatter,
        response_shape=mb.response_shape,
        is_dummy=mb.is_dummy,
    )


def make_engine(arm: str, model: str, **kw):
    """The engine of a throughput arm; ``native_padded`` is the engine with its micro-batch layout swapped."""
    from tandem.engines.training.fsdp import FSDPEngine

    if arm == "hf_padded":
        return FSDPEngine(engine_config(model, packing=False, **kw))
    if arm == "native_packed":
        return FSDPEngine(engine_config(model, packing=True, **kw))
    if arm == "native_packed_bf16":  # bf16 mixed precision: the forward under autocast, fp32 master weights
        from tandem.engines.training.fsdp.config import ParallelConfig

        return FSDPEngine(engine_config(model, packing=True, parallel=ParallelConfig(param_dtype="bfloat16"), **kw))

    class NativePaddedEngine(FSDPEngine):
        # the library couples the layout to the model (packed <=> native); the bench decouples them
        def _micro_batches(self, batch, plan, native):
            assert native, "the native model did not load"
            for sub, mb in super()._micro_batches(batch, plan, False):  # the HF fallback's padded layout
                yield sub, padded_as_packed(mb).to(self.ctx.device)

    return NativePaddedEngine(engine_config(model, packing=True, **kw))


def throughput(model: str, steps: int, lengths=LENGTHS) -> dict[str, dict]:
    """Per-step wall and CPU time of each arm, steps interleaved and the order rotated each repeat.

    The machine is shared: wall time swings with other jobs, while the process's CPU time in one
    thread counts only the work done, so the ratios are taken from CPU time (medians of ``steps``).
    """
    engines = {arm: make_engine(arm, model, micro_batch_tokens=1024) for arm in ARMS}
    batch = make_batch(lengths)
    real_tokens = int((batch.seq_lengths - 1).sum())
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    fed: dict[str, float] = {}
    loss: dict[str, float] = {}
    for engine in engines.values():
        engine.train_step(make_batch([(8, 8)], seed=99), pg_loss)  # warm-up
    for rep in range(steps):
        for arm in ARMS[rep % len(ARMS):] + ARMS[: rep % len(ARMS)]:
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            metrics = engines[arm].train_step(batch, pg_loss)
            wall[arm].append(time.perf_counter() - start_wall)
            cpu[arm].append(time.process_time() - start_cpu)
            fed[arm] = metrics["train/tokens"]
            loss.setdefault(arm, metrics["train/loss"])  # the first measured step: the same weights in every arm
    return {
        arm: {
            "tokens_per_cpu_s": real_tokens / statistics.median(cpu[arm]),
            "tokens_per_cpu_s_range": (real_tokens / max(cpu[arm]), real_tokens / min(cpu[arm])),
            "tokens_per_s": real_tokens / statistics.median(wall[arm]),
            "real_tokens": real_tokens,
            "fed_tokens_per_step": fed[arm],
            "loss": loss[arm],
            "wall_s": wall[arm],
            "cpu_s": cpu[arm],
        }
        for arm in ARMS
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
MEMORY_MB_TOKENS = 128  # one row per micro-batch: both worlds run the same micro-batch shape
LOGITS_BUFFERS = 4  # [rows, vocab] fp32 live in the log-prob backward: logits, log-softmax, softmax, its gradient


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t`` (its shard when ``t`` is a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(engine, grads: dict[str, int]) -> dict[str, int]:
    """Parameters and optimizer state of the policy as this rank holds them; ``grads`` filled at the step."""
    trainable = engine.policy
    opt = sum(local_bytes(v) for s in trainable.optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0)  # the moments, not the step counters
    return {"parameters": sum(local_bytes(p) for p in trainable.module.parameters()),
            "gradients": grads.get("bytes", 0), "optimizer_state": opt}


NOT_ACTIVATIONS = {"Total", "Parameter", "Sharded Param", "Unsharded Param", "Buffer", "Gradient", "Sharded Grad",
                   "Unsharded Grad", "Optstate", "OptState", "All Gather", "Reduce Scatter"}


def tracked_step(engine, batch) -> tuple[dict[str, int], int]:
    """One train step under torch's tensor memory tracker: live bytes by role at the step's peak, and
    the most activation bytes a micro-batch's forward leaves for its backward (after minus before)."""
    module, optimizer = engine.policy.module, engine.policy.optimizer
    if engine.ctx.sharded:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(module, optimizer)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(module, optimizer)
    device = engine.ctx.device

    def by_role(snapshot) -> dict[str, int]:
        snap = snapshot.get(device) or next(iter(snapshot.values()), {})
        return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}

    def live_activations() -> int:
        return sum(v for k, v in by_role(tracker.get_tracker_snapshot()).items() if k not in NOT_ACTIVATIONS)

    run, kept = engine._run, [0]

    def run_measured(*args, **kw):  # each micro-batch's forward, seen by the tracker as a new iteration
        tracker.reset_mod_stats()
        before = live_activations()
        out = run(*args, **kw)
        kept.append(live_activations() - before)
        return out

    engine._run = run_measured
    try:
        with tracker:
            engine.train_step(batch, pg_loss)
    finally:
        del engine._run
    return by_role(tracker.get_tracker_snapshot("peak")), max(kept)


def breakdown(states: dict[str, int], peak: int, at_peak: dict[str, int], activations: int,
              embedding: int, logits: int) -> dict[str, float]:
    """The peak itemised, MiB. Tracker roles: FSDP's (sharded / unsharded param, ...) or MemTracker's."""
    def role(snap, *names):
        return sum(snap.get(n, 0) for n in names)

    params = role(at_peak, "Parameter", "Sharded Param")
    gathered = role(at_peak, "Unsharded Param")
    comm = role(at_peak, "All Gather", "Reduce Scatter")
    temp = role(at_peak, "Temp", "Unsharded Grad")
    act_at_peak = role(at_peak, "Activation", "Inputs", "Buffer", "Other")
    tracked = at_peak.get("Total", 0)
    return {k: round(v / MIB, 1) for k, v in {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer_state": states["optimizer_state"],
        "gathered_embedding": gathered,  # the tied 49152 x 576 weight, whole on every rank at world > 1
        "gathered_embedding_size": embedding,
        "backward_temporaries": temp,
        "activations_saved_by_forward": activations,
        "activations_at_peak": act_at_peak,
        "fsdp_comm_buffers": comm,
        "logits_buffers_computed": logits,
        "tracked_tensors_at_peak": tracked,
        "tracked_parameters": params,
        "untracked": peak - tracked,  # resident beyond live tensors: allocator arenas, libraries, gloo
        "peak": peak,
    }.items()}


def memory_worker(rank: int, world: int, model: str, port: int, out: str, vocab_parallel: bool = True,
                  rings: bool = True) -> None:
    """Two steps with activation checkpointing (the resident peak), then a tracked third (the itemising)."""
    import torch.distributed as dist

    from tandem.engines.training.common import split_for_data_parallel
    from tandem.engines.training.fsdp import FSDPEngine, ParallelConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    base = rss_bytes()
    engine = FSDPEngine(engine_config(model, micro_batch_tokens=MEMORY_MB_TOKENS, parallel=ParallelConfig(
        activation_checkpointing=True, vocab_parallel=vocab_parallel, ring_collectives=rings)))
    batch = make_batch(MEMORY_BATCH, seed=1)
    local = batch.select(split_for_data_parallel(batch, world)[rank])
    grads: dict[str, int] = {}

    def count_grads(optimizer, args, kwargs):  # the gradients as the optimizer step finds them
        grads["bytes"] = sum(local_bytes(p.grad) for g in optimizer.param_groups for p in g["params"]
                             if p.grad is not None)

    engine.policy.optimizer.register_step_pre_hook(count_grads)
    for _ in range(2):  # the second step runs with the optimizer state allocated: the peak
        engine.train_step(local, pg_loss)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:  # the pre-engine level was below the peak
        peak = peak_rss_bytes() - base
    at_peak, activations = tracked_step(engine, local)
    weight = engine.policy.module.output_weight()
    embedding = weight.numel() * weight.element_size()  # the global shape: what a gather materialises
    rows = min(engine.config.logprob_chunk, int(local.response_lengths.max()))  # one row per micro-batch
    logits = rows * weight.shape[0] * 4 * LOGITS_BUFFERS
    parts = breakdown(state_bytes(engine, grads), peak, at_peak, activations, embedding, logits)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak, "breakdown_mib": parts}))
    if world > 1:
        from tandem.engines.training.common.rank_exit import exit_rank

        dist.destroy_process_group()
        exit_rank(0)  # gloo's worker threads outlive the group and can abort a normal exit (rank_exit.py)


def peak_memory(model: str, world: int, vocab_parallel: bool = True,
                rings: bool = True) -> tuple[float, dict[str, float]]:
    """Mean peak bytes per rank and rank 0's breakdown, each world in fresh processes (clean high-water marks)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # glibc keeps freed blocks below its (growing) mmap threshold in its heap, so resident memory
    # would show the allocator's history rather than the tensors alive; a fixed 1 MiB threshold
    # returns large blocks to the OS when freed. Same setting for both worlds (glibc only: --allocator glibc).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(memory_worker, args=(world, model, port, out, vocab_parallel, rings), nprocs=world,
                           start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return sum(r["peak_bytes"] for r in ranks) / world, ranks[0]["breakdown_mib"]


ROWS = [  # (key, label)
    ("parameters", "parameters (local shard)"),
    ("gradients", "gradients (local shard)"),
    ("optimizer_state", "AdamW moments (local shard)"),
    ("gathered_embedding", "gathered tied embedding (at the peak)"),
    ("backward_temporaries", "backward temporaries (at the peak)"),
    ("fsdp_comm_buffers", "FSDP all-gather / reduce-scatter buffers"),
    ("activations_at_peak", "activations (at the peak)"),
    ("untracked", "untracked: allocator, libraries, gloo"),
    ("peak", "peak resident (VmHWM) per rank"),
    ("activations_saved_by_forward", "activations a forward keeps for backward"),
    ("logits_buffers_computed", f"logits buffers (computed, {LOGITS_BUFFERS} live)"),
]


# memory arms: (world, parallel.vocab_parallel, parallel.ring_collectives); "world2" is the default path,
# "world2_gathered" the embedding and LM head gathered whole by FSDP as before vocab_parallel, "world2_gloo"
# gloo's own all-gather and reduce-scatter as before ring_collectives (same run, for the gains)
MEMORY_ARMS = {"world1": (1, True, True), "world2": (2, True, True), "world2_gathered": (2, False, True),
               "world2_gloo": (2, True, False)}


def measure_memory(model: str, repeats: int) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Peak bytes per rank of each arm over ``repeats`` rounds (arms alternating, order rotating each
    round), and each arm's breakdown from its last round."""
    peaks: dict[str, list[float]] = {arm: [] for arm in MEMORY_ARMS}
    mem: dict[str, dict[str, float]] = {}
    arms = list(MEMORY_ARMS)
    for r in range(repeats):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            world, vocab_parallel, rings = MEMORY_ARMS[arm]
            peak, mem[arm] = peak_memory(model, world, vocab_parallel, rings)
            peaks[arm].append(peak)
            print(f"memory round {r + 1}/{repeats} {arm}: {peak / MIB:.0f} MiB per rank", flush=True)
    return peaks, mem


def memory_result(peaks: dict[str, list[float]], mem: dict[str, dict[str, float]]) -> dict:
    med = {arm: statistics.median(v) for arm, v in peaks.items()}
    return {
        "memory_repeats": len(peaks["world1"]),
        "peak_mib_world1": round(med["world1"] / MIB, 1),
        "peak_mib_world2_per_rank": round(med["world2"] / MIB, 1),
        "peak_mib_world2_gathered_per_rank": round(med["world2_gathered"] / MIB, 1),
        "memory_ratio_world2": round(med["world2"] / med["world1"], 3),
        "memory_ratio_world2_gathered": round(med["world2_gathered"] / med["world1"], 3),
        "peak_mib_world2_gloo_collectives_per_rank": round(med["world2_gloo"] / MIB, 1),
        "memory_ratio_world2_gloo_collectives": round(med["world2_gloo"] / med["world1"], 3),
        "peak_mib_spread": {arm: [round(min(v) / MIB, 1), round(max(v) / MIB, 1)] for arm, v in peaks.items()},
        "memory_breakdown_mib": mem,
    }


def print_breakdown(mem: dict[str, dict[str, float]]) -> None:
    w1, w2, g2, gl = mem["world1"], mem["world2"], mem["world2_gathered"], mem["world2_gloo"]
    print(f"\nmemory per rank, MiB (last round)           {'world 1':>9} {'world 2':>9} {'2 / 1':>6} "
          f"{'w2 gathered':>11} {'w2 gloo':>9}")
    for key, label in ROWS:
        a, b, c, d = w1[key], w2[key], g2[key], gl[key]
        ratio = f"{b / a:6.2f}" if a else "     -"
        print(f"  {label:<42} {a:9.1f} {b:9.1f} {ratio} {c:11.1f} {d:9.1f}")
        if key == "peak":
            print("  (below: not part of the peak's sum)")
    sharded = [sum(w[k] for k in ("parameters", "gradients", "optimizer_state")) for w in (w1, w2)]
    rest = [w["peak"] - s for w, s in zip((w1, w2), sharded, strict=True)]
    print(f"sharded state {sharded[0]:.0f} -> {sharded[1]:.0f} MiB ({sharded[1] / sharded[0]:.2f}); "
          f"the rest of the peak {rest[0]:.0f} -> {rest[1]:.0f} MiB; "
          f"the embedding is {w2['gathered_embedding_size']:.0f} MiB whole (gathered only in 'w2 gathered')")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=3, help="interleaved repeats per arm (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the throughput part")
    p.add_argument("--memory-only", action="store_true", help="skip the throughput part")
    p.add_argument("--memory-repeats", type=int, default=3, help="alternating rounds of the memory arms (median)")
    p.add_argument("--throughput-only", action="store_true", help="skip the memory part")
    p.add_argument("--allocator", choices=("auto", "glibc", "tcmalloc", "jemalloc"), default="auto",
                   help="host allocator (runtime.allocator): auto is the default path, tcmalloc when installed")
    p.add_argument("--shape", choices=tuple(SHAPES), default="mixed",
                   help="the throughput batch: mixed lengths (default) or the GRPO demo's 32 x (60 + 30)")
    args = p.parse_args()
    from tandem.models import resolve_model
    from tandem.runtime.allocator import reexec_under

    allocator = reexec_under(args.allocator)  # as `tandem train` does; spawned ranks inherit LD_PRELOAD
    print(f"host allocator: {allocator}", flush=True)

    resolve_model(args.model)  # build the cache once, outside any timing
    torch.set_num_threads(args.threads)
    if args.memory_only:
        peaks, mem = measure_memory(args.model, args.memory_repeats)
        print_breakdown(mem)
        print("RESULT " + json.dumps({"model": args.model, "allocator": allocator, **memory_result(peaks, mem)}))
        return
    runs = throughput(args.model, args.steps, SHAPES[args.shape])
    for arm, r in runs.items():
        lo, hi = r["tokens_per_cpu_s_range"]
        cpus = ", ".join(f"{t:.1f}" for t in r["cpu_s"])
        walls = ", ".join(f"{t:.1f}" for t in r["wall_s"])
        print(f"{arm}: {r['tokens_per_cpu_s']:.1f} real tokens per CPU-second (median; {lo:.1f}-{hi:.1f}), "
              f"{r['tokens_per_s']:.1f} per wall second, {r['fed_tokens_per_step']:.0f} fed / "
              f"{r['real_tokens']} real tokens, loss {r['loss']:.6f}; CPU {cpus} s; wall {walls} s")
    tps = {arm: r["tokens_per_cpu_s"] for arm, r in runs.items()}
    wall = {arm: r["tokens_per_s"] for arm, r in runs.items()}
    packing_gain = tps["native_packed"] / tps["native_padded"]
    model_gain = tps["native_padded"] / tps["hf_padded"]
    padding_ratio = runs["hf_padded"]["fed_tokens_per_step"] / runs["hf_padded"]["real_tokens"]
    print(f"packing gain {packing_gain:.2f}x x model gain {model_gain:.2f}x = {packing_gain * model_gain:.2f}x "
          f"(padding ratio {padding_ratio:.2f}: fed / real tokens of a padded step)")
    bf16_gain = tps["native_packed_bf16"] / tps["native_packed"]
    print(f"bf16 mixed precision (param_dtype bfloat16) over fp32, native packed: {bf16_gain:.2f}x")
    through = {
        "model": args.model,
        "allocator": allocator,
        "threads": args.threads,
        "steps": args.steps,
        "shape": args.shape,
        "native_packed_tokens_per_cpu_s": round(tps["native_packed"], 2),
        "native_padded_tokens_per_cpu_s": round(tps["native_padded"], 2),
        "hf_padded_tokens_per_cpu_s": round(tps["hf_padded"], 2),
        "native_packed_bf16_tokens_per_cpu_s": round(tps["native_packed_bf16"], 2),
        "packing_gain": round(packing_gain, 3),
        "model_gain": round(model_gain, 3),
        "bf16_gain": round(bf16_gain, 3),
        "bf16_loss_delta": round(runs["native_packed_bf16"]["loss"] - runs["native_packed"]["loss"], 6),
        "padding_ratio": round(padding_ratio, 3),
        # the earlier keys: packed = native packed, padded = HF padded (medians now, were best-of)
        "packed_tokens_per_cpu_s": round(tps["native_packed"], 2),
        "padded_tokens_per_cpu_s": round(tps["hf_padded"], 2),
        "packed_vs_padded": round(tps["native_packed"] / tps["hf_padded"], 3),
        "packed_vs_padded_wall": round(wall["native_packed"] / wall["hf_padded"], 3),
        "padded_fed_vs_real_tokens": round(padding_ratio, 3),
    }
    if args.throughput_only:
        print("RESULT " + json.dumps(through))
        return
    peaks, mem = measure_memory(args.model, args.memory_repeats)
    print_breakdown(mem)
    result = through | memory_result(peaks, mem) | {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
