"""Host memory of building a sharded FSDP engine: the weights read as they are sharded vs the whole model first.

Each run is a fresh world of ``--world`` processes (gloo, one rank each, under the allocator `tandem train` picks,
``runtime.allocator: auto``) that builds an `FSDPEngine` on SmolLM2-135M-Instruct (fp32) with
``trainer.fsdp.parallel.sharded_load`` on (``sharded``: fsdp/deferred.py) or off (``whole``: load, then
shard), then computes the log-probs of one fixed batch. Per rank: the peak resident memory (VmHWM) before the
build (imports, process group) and after it, its rise, the resident memory after the build, the build's seconds,
and a checksum of the log-probs (both sides must give the same numbers). The sides alternate over ``--repeats``
(``sharded`` first in odd rounds); medians and spreads of the per-rank maxima.

    python bench/sharded_load.py                  # world 2, 3 repeats (~2 min on 2 cores)
    python bench/sharded_load.py --world 1 --qlora  # a QLoRA base quantized as it is read, one process

Ends with ``RESULT {json}``: ``sharded_peak_rise_mib``, ``whole_peak_rise_mib``, ``load_peak_rise_ratio``
(sharded over whole), ``sharded_build_s``, ``whole_build_s``, ``logprobs_equal``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def _model_folder() -> Path:
    from tandem.models import resolve_model

    return resolve_model(MODEL)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def child(mode: str, qlora: bool) -> None:
    """One rank of one world (RANK / WORLD_SIZE / MASTER_* in the environment); prints one JSON line."""
    from tandem.runtime.allocator import reexec_under

    allocator = reexec_under("auto")
    import torch
    import torch.distributed as dist

    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, ParallelConfig
    from tandem.models import ModelConfig

    torch.set_num_threads(1)
    if int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("gloo")
    before = _status_mib("VmHWM")
    t0 = time.perf_counter()
    lora = None
    if qlora:  # rank 16 on every linear layer, the base in FP8 (recipes/smollm2-135m/addition-grpo-qlora.yaml)
        from tandem.engines.training.fsdp import LoRAConfig
        from tandem.kernels import QuantConfig

        lora = LoRAConfig(rank=16, alpha=32.0, quantize_base=QuantConfig(format="fp8_block"), target_modules=(
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    engine = FSDPEngine(FSDPConfig(model=ModelConfig(name=MODEL), micro_batch_tokens=512, lora=lora,
                                   parallel=ParallelConfig(sharded_load=mode == "sharded")))
    build_s = time.perf_counter() - t0
    after, rss = _status_mib("VmHWM"), _status_mib("VmRSS")
    g = torch.Generator().manual_seed(0)  # the same rows on every rank (each runs the same micro-batches)
    batch = TrainBatch.from_samples([Sample(tokens=torch.randint(3, 49152, (48,), generator=g).tolist(),
                                            response_length=32, loss_mask=[1] * 32, index=i) for i in range(4)])
    logp = engine.forward_logprobs(batch).log_probs
    checksum = float(logp.double().sum())
    deferred = engine.deferred_bytes
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps({"mode": mode, "rank": int(os.environ["RANK"]), "allocator": allocator, "before_mib": before,
                      "after_mib": after, "rise_mib": after - before, "rss_mib": rss, "build_s": build_s,
                      "deferred_mib": deferred / 2**20, "checksum": checksum}), flush=True)
    from tandem.engines.training.common.rank_exit import exit_rank

    exit_rank(0)  # a rank's end without the finalization gloo's worker threads can abort (rank_exit.py)


def world(mode: str, size: int, qlora: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", mode, *(["--qlora"] if qlora else [])], env=env, stdout=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"{mode} rank exited with {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", choices=("sharded", "whole"))
    p.add_argument("--qlora", action="store_true", help="a QLoRA policy (FP8 base; quantized as read in any world)")
    args = p.parse_args()
    if args.child:
        child(args.child, args.qlora)
        return
    runs: dict[str, list[list[dict]]] = {"sharded": [], "whole": []}
    for rep in range(args.repeats):
        for mode in (("sharded", "whole") if rep % 2 == 0 else ("whole", "sharded")):
            ranks = world(mode, args.world, args.qlora)
            runs[mode].append(ranks)
            print(f"round {rep + 1} {mode}: " + "; ".join(
                f"rank {r['rank']} peak {r['before_mib']:.0f} -> {r['after_mib']:.0f} MiB (+{r['rise_mib']:.0f}), "
                f"rss {r['rss_mib']:.0f}, build {r['build_s']:.2f} s, read deferred {r['deferred_mib']:.0f} MiB"
                for r in ranks), flush=True)
    med = {}
    for mode, rounds in runs.items():
        rise = [max(r["rise_mib"] for r in ranks) for ranks in rounds]
        peak = [max(r["after_mib"] for r in ranks) for ranks in rounds]
        rss = [max(r["rss_mib"] for r in ranks) for ranks in rounds]
        build = [max(r["build_s"] for r in ranks) for ranks in rounds]
        med[mode] = {"peak_rise_mib": round(statistics.median(rise), 1), "peak_mib": round(statistics.median(peak), 1),
                     "rss_after_build_mib": round(statistics.median(rss), 1), "build_s": round(statistics.median(build), 2),
                     "rise_range": [round(min(rise), 1), round(max(rise), 1)],
                     "build_range": [round(min(build), 2), round(max(build), 2)]}
        print(f"{mode}: {med[mode]}", flush=True)
    sums = {mode: {r["checksum"] for ranks in rounds for r in ranks} for mode, rounds in runs.items()}
    result = {"model": MODEL, "world": args.world, "repeats": args.repeats, "dtype": "float32", "qlora": args.qlora,
              "allocator": runs["sharded"][0][0]["allocator"],
              "sharded_peak_rise_mib": med["sharded"]["peak_rise_mib"], "whole_peak_rise_mib": med["whole"]["peak_rise_mib"],
              "load_peak_rise_ratio": round(med["sharded"]["peak_rise_mib"] / med["whole"]["peak_rise_mib"], 3),
              "sharded_build_s": med["sharded"]["build_s"], "whole_build_s": med["whole"]["build_s"],
              "logprobs_equal": len(sums["sharded"] | sums["whole"]) == 1,
              # what the world's ranks read of the deferred matrices together (whole: every rank reads the files)
              "sharded_node_read_mib": round(sum(r["deferred_mib"] for r in runs["sharded"][0]), 1),
              "checkpoint_mib": round(sum(f.stat().st_size for f in _model_folder().glob("*.safetensors")) / 2**20, 1),
              "medians": med}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
