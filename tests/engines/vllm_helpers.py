"""Shared pieces of the vLLM adapter tests: a tiny model vLLM's CPU kernels accept, engine factories.

vLLM's CPU attention supports head sizes 32, 64, 80, ... but the registry's tiny models use 16, so the
tests build `tiny-llama` with ``head_dim = 32`` (same tokenizer, vocabulary 512, fixed-seed weights),
cached under the Tandem cache like a registry model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tandem.models import ModelConfig, cache_dir

VLLM_HEAD_DIM = 32
MAX_MODEL_LEN = 256
KV_CACHE_BYTES = 64 << 20  # a few thousand tokens of the tiny model: enough, and cheap to allocate


def require_vllm() -> None:
    """Skip the calling module, with the reason, if vLLM does not import here."""
    from tandem.engines.inference.vllm.engine import vllm_available

    reason = vllm_available()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def vllm_tiny_model() -> Path:
    """The folder of tiny-llama with head_dim 32 (built once, under a lock, then reused)."""
    import transformers

    root = cache_dir() / "test-models"
    target = root / f"tiny-llama-hd{VLLM_HEAD_DIM}-{transformers.__version__}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
        try:
            _build(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _build(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.models import tiny

    tiny.build_tokenizer(out)
    config = tiny.tiny_config("llama", len(AutoTokenizer.from_pretrained(str(out))))
    config.head_dim = VLLM_HEAD_DIM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 2
    model.generation_config.eos_token_id = 2
    model.save_pretrained(str(out))


def make_vllm_engine(backend: str = "inprocess", *, model: str | None = None, dtype: str = "float32", **kw):
    from tandem.engines.inference.vllm import VLLMEngine, VLLMEngineConfig

    kwargs = {"kv_cache_memory_bytes": KV_CACHE_BYTES, **kw.pop("engine_kwargs", {})}
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    name = model or str(vllm_tiny_model())
    return VLLMEngine(VLLMEngineConfig(model=ModelConfig(name=name, dtype=dtype), backend=backend,
                                       engine_kwargs=kwargs, **kw))
