"""GPU check of tandem.kernels in one go: the kernel tests on CUDA, then the timings.

    python bench/gpu/kernels_gpu.py [--size 8192] [--repeats 20] [--skip-tests]
    python bench/gpu/kernels_gpu.py --dry-run      # argument and import check, no CUDA (the CPU test)

1. ``pytest tests/kernels`` on the GPU: with CUDA present the tests run the compiled Triton kernels
   (not the interpreter) against the torch reference, on CUDA and across CPU/CUDA (test_gpu.py),
   bit for bit, including the flush-to-zero-sensitive MX subnormal case.
2. ``bench/kernels.py``: GB/s of each op, Triton and torch reference, and the ratio to a copy kernel
   measured in the same run (aim: Triton ratio >= 0.8; scripts/gpu_check.sh reports the issue's aim,
   >= 0.7 for FP8 block quant/dequant).

``--skip-tests`` leaves step 1 out: scripts/gpu_check.sh runs the kernel tests as parts of their own.

Ends with ``RESULT {json}``: test outcome, the bench result, and the ops below the 0.8 aim.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kernels import run as bench_run  # noqa: E402

AIM = 0.8


def run_tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    return {"passed": proc.returncode == 0, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description="tandem.kernels GPU check")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-tests", action="store_true", help="time the ops only (no pytest run)")
    parser.add_argument("--dry-run", action="store_true", help="validate arguments and imports; no CUDA")
    args = parser.parse_args()
    if args.size % 128:
        parser.error(f"--size {args.size} must be a multiple of 128")
    if args.dry_run:
        import importlib.util

        has_triton = importlib.util.find_spec("triton") is not None
        if has_triton:  # decorating the kernels needs no GPU: this catches a kernel module that cannot load
            import tandem.kernels.triton_kernels  # noqa: F401
        print("RESULT " + json.dumps({"dry": True, "size": args.size, "skip_tests": args.skip_tests,
                                      "triton_kernels_imported": has_triton}))
        return
    if not torch.cuda.is_available():
        print('RESULT {"error": "no CUDA device"}')
        sys.exit(1)
    tests = {"passed": True, "summary": "skipped (--skip-tests)"} if args.skip_tests else run_tests()
    print(f"tests: {tests['summary']}")
    bench = bench_run(args.size, args.repeats, torch.device("cuda"))
    below = {
        name: entry["triton"]["ratio"] for name, entry in bench["ops"].items() if entry["triton"]["ratio"] < AIM
    }
    print("RESULT " + json.dumps({"tests": tests, "below_aim": below, "aim": AIM, "bench": bench}))
    sys.exit(0 if tests["passed"] else 1)


if __name__ == "__main__":
    main()
