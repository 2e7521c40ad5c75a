"""GPU check of the weight-sync transports: their tests on CUDA, then their bandwidth.

    python bench/gpu/sync_gpu.py [--repeats 5] [--dtype float32] [--skip-tests]
    python bench/gpu/sync_gpu.py --dry-run      # argument and import check, no CUDA (the CPU test)

1. ``pytest tests/sync/test_gpu.py``: CUDA IPC between two processes on one GPU (bit-exact, rejected
   update leaves the engine untouched); torch.distributed NCCL and cupy NCCL when there are >= 2 GPUs
   (NCCL needs one GPU per rank).
2. Bandwidth on SmolLM2-135M-shaped weights (272 tensors, 538 MB in fp32) from GPU 0 into a receiver
   process's GPU buffers, each next to its limit measured in the same run:
   CUDA IPC vs a device-to-device copy (``dst.copy_(src)``, bytes written per second);
   NCCL broadcast (``BroadcastSender(device="cuda")``) and cupy NCCL vs a raw ``torch.distributed``
   NCCL broadcast of the same bytes, GPU 0 -> GPU 1 (skipped with one GPU).

``--skip-tests`` leaves step 1 out (scripts/gpu_check.sh runs the ``gpu`` tests as a part of their own).
With one GPU the NCCL figures are absent and ``nccl`` in the result says why.

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M


def smollm2_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.self_attn.{n}.weight", s) for n, s in
                   (("q_proj", (HIDDEN, HIDDEN)), ("k_proj", (KV, HIDDEN)), ("v_proj", (KV, HIDDEN)),
                    ("o_proj", (HIDDEN, HIDDEN)))]
        shapes += [(f"{p}.mlp.{n}.weight", s) for n, s in
                   (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))]
        shapes += [(f"{p}.input_layernorm.weight", (HIDDEN,)), (f"{p}.post_attention_layernorm.weight", (HIDDEN,))]
    return [*shapes, ("model.norm.weight", (HIDDEN,))]


class GpuSink:
    """A receiver's weights on its GPU: what an engine's ``update_weights`` does (check, then copy)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.weights = {n: torch.zeros(s, dtype=dtype, device="cuda") for n, s in smollm2_shapes()}
        self.weight_version = 0

    def update_weights(self, named, version: int) -> None:
        for n, t in named:
            if self.weights[n].shape != t.shape:
                raise ValueError(f"{n}: shape {tuple(t.shape)}")
        for n, t in named:
            self.weights[n].copy_(t)
        torch.cuda.synchronize()
        self.weight_version = version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests/sync/test_gpu.py", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    return {"passed": proc.returncode == 0, "summary": summary}


# -- receiver processes ----------------------------------------------------------------------------------


def _receiver(kind: str, args: dict, syncs: int, done) -> None:
    from tandem.sync import WeightApplier

    torch.cuda.set_device(args.get("device_index", 0))
    sink = GpuSink(getattr(torch, args["dtype"]))
    if kind == "ipc":
        from tandem.sync.cuda import CudaIpcReceiver

        rx = CudaIpcReceiver(address=tuple(args["address"]), authkey=args["authkey"])
    elif kind == "nccl":
        from tandem.sync.broadcast import BroadcastReceiver

        rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=args["port"], device="cuda")
    elif kind == "cupy":
        from tandem.sync.cuda import CupyNcclReceiver

        rx = CupyNcclReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=args["port"])
    else:  # raw torch.distributed NCCL broadcast, the baseline of both NCCL transports
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args['port']}", rank=1, world_size=2)
        buf = torch.empty(args["nbytes"], dtype=torch.uint8, device="cuda")
        for _ in range(syncs):
            dist.broadcast(buf, 0)
        torch.cuda.synchronize()
        dist.destroy_process_group()
        done.put("ok")
        return
    applier = WeightApplier(sink)
    for _ in range(syncs):
        rx.receive(applier)
    done.put("ok")


def _spawn(kind: str, args: dict, syncs: int):
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(kind, args, syncs, done))
    proc.start()
    return proc, done


# -- measurements ------------------------------------------------------------------------------------------


def _weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {n: torch.randn(s, generator=g, device="cuda").to(dtype) for n, s in smollm2_shapes()}


def _buckets(weights, bucket_bytes: int):
    from tandem.sync import bucketize

    return bucketize(weights.items(), bucket_bytes)


def time_transport(kind: str, weights, args: dict, repeats: int, bucket_bytes: int) -> float:
    """Seconds of the best of ``repeats`` syncs (after one warm-up) into a receiver process."""
    args = {**args, "dtype": str(next(iter(weights.values())).dtype).removeprefix("torch.")}
    syncs = repeats + 1
    if kind == "ipc":
        from tandem.sync.cuda import CudaIpcSender

        key = secrets.token_bytes(16)
        sender = CudaIpcSender(authkey=key)
        proc, done = _spawn(kind, {**args, "address": list(sender.address), "authkey": key}, syncs)
    else:
        port = _free_port()
        proc, done = _spawn(kind, {**args, "port": port, "device_index": 1}, syncs)
        if kind == "nccl":
            from tandem.sync.broadcast import BroadcastSender

            sender = BroadcastSender(num_receivers=1, port=port, device="cuda")
        elif kind == "cupy":
            from tandem.sync.cuda import CupyNcclSender

            sender = CupyNcclSender(num_receivers=1, port=port)
        else:
            import torch.distributed as dist

            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
            flat = torch.ones(args["nbytes"], dtype=torch.uint8, device="cuda")
            best = _best(lambda: dist.broadcast(flat, 0), repeats)
            dist.destroy_process_group()
            proc.join(120)
            return best
    version = iter(range(1, syncs + 1))
    best = _best(lambda: sender.send(_buckets(weights, bucket_bytes), next(version)), repeats)
    done.get(timeout=120)
    proc.join(120)
    sender.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description="weight-sync GPU check")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--skip-tests", action="store_true", help="measure only (no pytest run)")
    parser.add_argument("--dry-run", action="store_true", help="validate arguments and imports; no CUDA")
    args = parser.parse_args()
    if args.repeats < 1 or args.bucket_mb < 1:
        parser.error("--repeats and --bucket-mb must be >= 1")
    if args.dry_run:
        from tandem.sync import WeightApplier, bucketize  # noqa: F401
        from tandem.sync.broadcast import BroadcastReceiver, BroadcastSender  # noqa: F401
        from tandem.sync.cuda import CudaIpcReceiver, CudaIpcSender, CupyNcclReceiver, CupyNcclSender  # noqa: F401

        shapes = smollm2_shapes()
        nbytes = sum(4 * torch.Size(s).numel() for _, s in shapes)
        print("RESULT " + json.dumps({"dry": True, "tensors": len(shapes), "model_mb_fp32": round(nbytes / 1e6, 1)}))
        return
    if not torch.cuda.is_available():
        print('RESULT {"error": "no CUDA device"}')
        sys.exit(1)
    tests = {"passed": True, "summary": "skipped (--skip-tests)"} if args.skip_tests else run_tests()
    print(f"tests: {tests['summary']}")
    torch.cuda.set_device(0)
    weights = _weights(getattr(torch, args.dtype))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    bucket = args.bucket_mb << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rates = {"d2d_copy": nbytes / _best(lambda: dst.copy_(src), args.repeats)}
    rates["cuda_ipc"] = nbytes / time_transport("ipc", weights, {}, args.repeats, bucket)
    if torch.cuda.device_count() >= 2:
        for kind in ("raw_nccl", "nccl", "cupy"):
            try:
                rates[kind] = nbytes / time_transport(kind, weights, {"nbytes": nbytes}, args.repeats, bucket)
            except Exception as e:  # noqa: BLE001 - e.g. cupy missing: report it and go on
                rates[kind] = float("nan")
                print(f"{kind}: {type(e).__name__}: {e}")
    for name, rate in rates.items():
        print(f"  {name:>10}: {rate / 1e9:8.2f} GB/s")
    result = {
        "tests": tests,
        "gpus": torch.cuda.device_count(),
        "model_mb": nbytes / 1e6,
        "dtype": args.dtype,
        **{f"{k}_gbps": round(v / 1e9, 3) for k, v in rates.items()},
        "cuda_ipc_vs_d2d_copy": round(rates["cuda_ipc"] / rates["d2d_copy"], 3),
    }
    if torch.cuda.device_count() < 2:
        result["nccl"] = "not measured: 1 GPU (NCCL needs one GPU per rank)"
    if "raw_nccl" in rates:
        result["nccl_vs_raw_nccl"] = round(rates["nccl"] / rates["raw_nccl"], 3)
        result["cupy_vs_raw_nccl"] = round(rates["cupy"] / rates["raw_nccl"], 3)
    print("RESULT " + json.dumps(result))
    sys.exit(0 if tests["passed"] else 1)


if __name__ == "__main__":
    main()
