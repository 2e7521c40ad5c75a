"""The Megatron engine (one process on gloo, TP = PP = 1, tiny-llama with tied embeddings) passes the
shared training-engine contract (tests/engines/training/contract.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'tandem-rl[megatron]')"
)

from tandem.engines.training.megatron import MegatronConfig, MegatronEngine, OptimizerConfig  # noqa: E402
from tandem.models import ModelConfig  # noqa: E402

from ..training.contract import (  # noqa: E402
    SMALL_MICRO_BATCH,
    TrainingEngineCase,
    TrainingEngineContract,
    info_fields,
)

MODEL = "tiny-llama"
OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)  # eps: see test_fsdp_engine


def _build(model: str | None = None, *, lr_lambda=None, **overrides) -> MegatronEngine:
    kw = {
        "optimizer": OPT,
        "micro_batch_tokens": SMALL_MICRO_BATCH,
        "vocab_divisible_by": 96,  # 512 -> 576: padded vocabulary columns exist
        **overrides,
    }
    dtype = kw.pop("dtype", "float32")
    config = MegatronConfig(model=ModelConfig(name=model or MODEL, dtype=dtype), **kw)
    return MegatronEngine(config, lr_lambda=lr_lambda)


@pytest.fixture(scope="module")
def case():
    had_group = torch.distributed.is_initialized()
    c = TrainingEngineCase(
        build=_build,
        model=MODEL,
        info=info_fields(
            name="megatron", dtype="float32", deterministic=False, moe_layers=(), max_context=1024,
            vocab_size=512,  # the model's vocabulary, not Megatron's padded one
            can_sleep=torch.cuda.is_available(), routed_experts=False, lora_adapters=False, temperature=1.0,
        ),
        logprob_atol=1e-5,
        step_atol=1e-6,
    )
    yield c
    c.close()
    # the world-size-1 group the first engine created (and Megatron's state) went with the last close
    assert torch.distributed.is_initialized() == had_group


class TestMegatronEngineContract(TrainingEngineContract):
    pass


def test_info_names_megatron_core_and_the_model_dtype(case):
    import importlib.metadata

    assert case.engine.info.version == importlib.metadata.version("megatron-core")
    info = case.new(dtype="bfloat16", temperature=0.0, deterministic=True).info
    assert info.dtype == "bfloat16" and info.deterministic and info.temperature == 1.0  # 0 means greedy: 1.0
