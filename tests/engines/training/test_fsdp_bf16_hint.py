"""The FSDP engine says once, on a CPU with bf16 instructions, that fp32 training leaves speed unused."""

from __future__ import annotations

import logging

import pytest

from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine
from tandem.engines.training.fsdp.config import ParallelConfig
from tandem.models import ModelConfig
from tandem.ops import native

HINT = "trainer.fsdp.parallel.param_dtype=bfloat16"


@pytest.mark.parametrize("flags, native_bf16", [
    ("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("flags\t\t: fpu avx2 amx_bf16 amx_tile", True),
    ("Features\t: fp asimd bf16 i8mm", True),
    ("flags\t\t: fpu avx2 avx512f avx512bw", False),  # bf16 products emulated there
])
def test_cpu_bf16_instructions_are_read_from_the_flags(monkeypatch, flags, native_bf16):
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    assert native.cpu_has_native_bf16() is native_bf16


@pytest.mark.parametrize("flags, parallel, hinted", [
    ("flags : avx512_bf16", ParallelConfig(), True),
    ("flags : avx512_bf16", ParallelConfig(param_dtype="bfloat16"), False),  # already on
    ("flags : avx2", ParallelConfig(), False),  # no bf16 instructions: nothing to gain
])
def test_fsdp_engine_hints_at_bf16_where_it_pays(monkeypatch, caplog, flags, parallel, hinted):
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="tandem.engines.training.fsdp.parallel"):
        engine = FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), parallel=parallel))
        engine.close()
    assert any(HINT in r.getMessage() for r in caplog.records) is hinted
