#!/usr/bin/env bash
# One-command GPU check of Tandem (docs/gpu.md): the gpu-marked tests and the bench/gpu measurements,
# within TANDEM_GPU_BUDGET_S seconds (default 480), results in OUT_DIR/gpu_check.json + gpu_check.log.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--only PART,...] [--list]
#
# OUT_DIR defaults to $OUT (the folder the device tool returns), else ./gpu_check_out. Nothing is
# installed: the repo goes on PYTHONPATH and runs on the machine's own torch / Triton / transformers
# (a lent GPU machine has no package registry). PYTHON picks the interpreter (default: python3).
# Exit code 0 unless the orchestration itself broke; each part's outcome is in the JSON.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# models built on the spot (tiny test models, the random SmolLM2-shaped one) go to a scratch cache
export TANDEM_CACHE_DIR="${TANDEM_CACHE_DIR:-${TMPDIR:-/tmp}/tandem-gpu-check-cache}"

exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
