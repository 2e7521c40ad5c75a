"""Shared test set-up: GPU tests skip without CUDA; torch uses the machine's cores deterministically."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without CUDA the Triton kernels run in Triton's CPU interpreter. TRITON_INTERPRET is read when a
# kernel is decorated, including triton.language's own helpers at `import triton`: it must be set
# before anything in the session (a test of another package, torch.compile) first imports triton.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
