"""bench/gpu/sglang.py (the SGLang adapter's GPU measurement) runs end to end in its CPU smoke mode.

The adapter launches the embedded engine serving SGLang's API (``--launch embedded``) instead of real
SGLang, which does not install here: this proves the script's logic (every contract check, the sections,
the RESULT line), not SGLang.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = 15  # 7 on the dense model, 8 on the MoE (routed experts)


def test_cpu_smoke_of_the_sglang_gpu_bench_passes_every_contract_check():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "sglang.py"), "--device", "cpu", "--launch",
                           "embedded", "--model", "tiny-llama", "--moe-model", "tiny-qwen3-moe", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["contract_failed"] == [], result["checks"]
    assert result["contract_passed"] == result["contract_total"] >= CHECKS
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["launch"] == "embedded" and result["device"] == "cpu"
    assert math.isfinite(result["logprob_gap_max"]) and math.isfinite(result["logprob_gap_mean"])
    assert result["logprob_gap_max"] == 0.0  # deterministic embedded server vs deterministic FSDP trainer
    assert result["sync_s_per_gb_disk"] > 0 and result["sync_s_per_gb_distributed"] > 0
    assert result["sglang_tokens_per_s"] > 0
    assert result["vllm_tokens_per_s"] is None or result["vllm_tokens_per_s"] > 0
