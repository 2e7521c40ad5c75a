"""The FSDP engine (one process, tiny-llama with tied embeddings) passes the shared training-engine
contract (tests/engines/training/contract.py), plus the FSDP-specific part of `close`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig, ParallelConfig
from tandem.engines.training.fsdp import parallel as fsdp_parallel
from tandem.models import ModelConfig

from .contract import SMALL_MICRO_BATCH, TrainingEngineCase, TrainingEngineContract, info_fields
from .helpers import TINY, free_port

OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)  # eps: see test_fsdp_engine


def _build(model: str | None = None, *, lr_lambda=None, **overrides) -> FSDPEngine:
    kw = {"optimizer": OPT, "micro_batch_tokens": SMALL_MICRO_BATCH, **overrides}
    return FSDPEngine(FSDPConfig(model=ModelConfig(name=model or TINY), **kw), lr_lambda=lr_lambda)


@pytest.fixture(scope="module")
def case():
    c = TrainingEngineCase(
        build=_build,
        model=TINY,
        info=info_fields(
            name="fsdp", dtype="float32", deterministic=False, moe_layers=(), max_context=1024,
            vocab_size=512,
            can_sleep=torch.cuda.is_available(), routed_experts=False, lora_adapters=False, temperature=1.0,
        ),
        logprob_atol=1e-5,
        step_atol=1e-6,
    )
    yield c
    c.close()


class TestFSDPEngineContract(TrainingEngineContract):
    pass


def test_info_follows_the_config():
    from tandem.engines.training.fsdp import LoRAConfig

    mixed = ParallelConfig(param_dtype="bfloat16")
    info = _build(parallel=mixed, lora=LoRAConfig(rank=2), temperature=0.0).info
    assert info.dtype == "bfloat16" and info.lora_adapters and info.temperature == 1.0  # 0 means greedy: 1.0


def test_close_destroys_only_a_process_group_it_created(monkeypatch):
    """Under torchrun without a group the engine creates one; the last engine on it destroys it at close."""
    port, init = free_port(), dist.init_process_group

    def create(backend, **_):  # torchrun's env:// rendezvous, as a one-rank group
        init(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", create)
    cfg = ParallelConfig(backend="gloo")
    first = fsdp_parallel.init_distributed(cfg, "cpu")
    second = fsdp_parallel.init_distributed(cfg, "cpu")  # joins the engines' group
    assert first.owns_group and second.owns_group and first.sharded
    first.close()
    first.close()
    assert dist.is_initialized()  # the second context still uses it
    second.close()
    assert not dist.is_initialized()
    monkeypatch.undo()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        callers = fsdp_parallel.init_distributed(cfg, "cpu")  # the caller's group: never destroyed here
        assert not callers.owns_group
        callers.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
