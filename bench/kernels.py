"""Throughput of every low-precision op, against a memory copy measured in the same run.

    python bench/kernels.py [--size N] [--repeats R]

Each op runs on an ``N x N`` bf16 matrix (weights in 128 x 128 blocks, activations in 1 x 128
groups, MX in 1 x 32, int4 in groups of 128). GB/s counts the bytes the op must read plus write
(codes, scales, outputs). The baseline is ``dst.copy_(src)`` of the same bf16 matrix (read + write);
``ratio`` = op GB/s / copy GB/s, so 1.0 means the op runs at memory speed.

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


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def measure(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm-up (Triton compiles on first call)
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

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
    copy_s = measure(lambda: dst.copy_(src), repeats)
    copy_gbps = 2 * src.numel() * src.element_size() / copy_s / 1e9
    print(f"device {device.type}, {size} x {size} bf16; copy baseline {copy_gbps:.1f} GB/s (read + write)")
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    results: dict[str, dict] = {}
    for backend in backends:
        for name, (fn, nbytes) in _ops(size, device, backend).items():
            seconds = measure(fn, repeats)
            gbps = nbytes / seconds / 1e9
            entry = results.setdefault(name, {})
            entry[backend] = {"ms": round(seconds * 1e3, 4), "gbps": round(gbps, 2), "ratio": round(gbps / copy_gbps, 3)}
            print(f"  {name:22s} {backend:6s} {seconds * 1e3:9.3f} ms {gbps:9.1f} GB/s  ratio {gbps / copy_gbps:.3f}")
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "size": size,
        "copy_gbps": round(copy_gbps, 2),
        "ops": results,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--size", type=int, default=8192 if cuda else 2048, help="matrix side (multiple of 128)")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    args = parser.parse_args(argv)
    if args.size % 128:
        parser.error(f"--size {args.size} must be a multiple of 128")
    result = run(args.size, args.repeats, torch.device("cuda" if cuda else "cpu"))
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
