"""Throughput of every low-precision op, against a memory copy measured in the same run.

    python bench/kernels.py [--size N] [--repeats R]

Each op runs on an ``N x N`` bf16 matrix (weights in 128 x 128 blocks, activations in 1 x 128
groups, MX in 1 x 32, int4 in groups of 128). GB/s counts the bytes the op must read plus write
(codes, scales, outputs). The baseline is ``dst.copy_(src)`` of the same bf16 matrix (read + write),
timed interleaved with each op (copy, op, copy, op, ...), so both see the same machine load;
``ratio`` = op GB/s / the copy GB/s of its own interleaved copies, so 1.0 means memory speed. The
matrix is large enough (8192 x 8192 by default, 128 MiB) that neither fits in a cache: at 2048 x 2048
(8 MiB) a copy runs from L3 at ~140 GB/s, and a single cold copy at ~10.

On a GPU the Triton kernels are timed, and the torch reference next to them. On CPU only the
reference runs: Triton's CPU interpreter is a correctness tool, not a performance path.
Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from tandem import kernels as K


def _timer(device: torch.device) -> Callable[[list[Callable[[], object]], int], list[list[float]]]:
    """``measure(fns, repeats)``: seconds of each call of ``fns``, the calls interleaved in every repeat."""

    def once(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def measure(fns: list[Callable[[], object]], repeats: int) -> list[list[float]]:
        for fn in fns:
            fn()  # warm-up (Triton compiles on first call; first touch of outputs)
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                times[i].append(once(fn))
        return times

    return measure


def _ops(n: int, device: torch.device, backend: str) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, bytes read + written)."""
    w = torch.randn(n, n, device=device).to(torch.bfloat16)
    elems, blocks128 = n * n, (n // 128) ** 2
    q8, s8 = K.quantize_fp8_block(w, backend=backend)
    qmx, smx = K.quantize_mxfp8(w, backend=backend)
    c4, s4, z4 = K.quantize_int4(w, 128, symmetric=False, backend=backend)
    packed = K.pack_int4(c4, backend=backend)
    groups128, groups32 = elems // 128, elems // 32
    return {
        "fp8_block_quant": (lambda: K.quantize_fp8_block(w, backend=backend), 3 * elems + 4 * blocks128),
        "fp8_block_dequant": (lambda: K.dequantize_fp8_block(q8, s8, backend=backend), 3 * elems + 4 * blocks128),
        "fp8_block_fake": (lambda: K.fake_quantize_fp8_block(w, backend=backend), 4 * elems),
        "fp8_act_quant_1x128": (lambda: K.quantize_fp8_activation(w, backend=backend), 3 * elems + 4 * groups128),
        "mxfp8_quant": (lambda: K.quantize_mxfp8(w, backend=backend), 3 * elems + groups32),
        "mxfp8_dequant": (lambda: K.dequantize_mxfp8(qmx, smx, backend=backend), 3 * elems + groups32),
        "int4_sym_fake": (lambda: K.fake_quantize_int4(w, 128, True, backend=backend), 4 * elems),
        "int4_asym_quant": (lambda: K.quantize_int4(w, 128, False, backend=backend), 3 * elems + 5 * groups128),
        "int4_asym_dequant": (
            lambda: K.dequantize_int4(c4, s4, z4, 128, backend=backend),
            3 * elems + 5 * groups128,
        ),
        "int4_pack": (lambda: K.pack_int4(c4, backend=backend), elems + elems // 2),
        "int4_unpack": (lambda: K.unpack_int4(packed, n, backend=backend), elems // 2 + elems),
    }


def run(size: int, repeats: int, device: torch.device) -> dict:
    measure = _timer(device)
    src = torch.randn(size, size, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * src.element_size()
    print(f"device {device.type}, {size} x {size} bf16; each op interleaved with a copy of the same matrix")
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    results: dict[str, dict] = {}
    copies: list[float] = []
    for backend in backends:
        for name, (fn, nbytes) in _ops(size, device, backend).items():
            copy_t, op_t = measure([lambda: dst.copy_(src), fn], repeats)
            copies += copy_t
            seconds, copy_s = statistics.median(op_t), statistics.median(copy_t)
            gbps, copy_gbps = nbytes / seconds / 1e9, copy_bytes / copy_s / 1e9
            entry = results.setdefault(name, {})
            entry[backend] = {"ms": round(seconds * 1e3, 4), "gbps": round(gbps, 2), "copy_gbps": round(copy_gbps, 2),
                              "ratio": round(gbps / copy_gbps, 3),
                              "spread": round((max(op_t) - min(op_t)) / seconds, 3)}
            print(f"  {name:22s} {backend:6s} {seconds * 1e3:9.3f} ms {gbps:9.1f} GB/s  copy {copy_gbps:6.1f} GB/s"
                  f"  ratio {gbps / copy_gbps:.3f}")
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "size": size,
        "copy_gbps": round(copy_bytes / statistics.median(copies) / 1e9, 2),
        "copy_gbps_min_max": [round(copy_bytes / max(copies) / 1e9, 2), round(copy_bytes / min(copies) / 1e9, 2)],
        "threads": torch.get_num_threads(),
        "ops": results,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--size", type=int, default=8192, help="matrix side (multiple of 128)")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    args = parser.parse_args(argv)
    if args.size % 128:
        parser.error(f"--size {args.size} must be a multiple of 128")
    result = run(args.size, args.repeats, torch.device("cuda" if cuda else "cpu"))
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
