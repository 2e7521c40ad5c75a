"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated (also triton.language's helpers, at
``import triton``): tests/conftest.py sets it, only without CUDA, before any test module is imported, so
a GPU run of the whole suite keeps compiling real kernels.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # normally already set by tests/conftest.py

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the dev extra)")


@pytest.fixture
def device() -> str:
    return DEVICE
