"""Fixtures of the agentic rollout tests: the tool-calling tiny model is taught once per test session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny engines run faster on one thread, and steadily on a loaded 2-core machine; the thread count is
    process-wide, so the rest of the suite gets its own back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def taught_calculator_model():
    from tests.rollout.agentic_helpers import taught_model

    return taught_model()
