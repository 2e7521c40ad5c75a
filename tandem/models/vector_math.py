"""A thread's first call into MKL's vector math can be inaccurate: warm each intra-op thread once.

PyTorch's CPU wheel computes ``cos``, ``sin``, ``exp``, ``log``, ``tanh`` (and a few more) of float32 and
float64 tensors with MKL's vector math library (VML), in high-accuracy mode, splitting a tensor over the
intra-op (OpenMP) threads in parts of at least 2,048 elements. Measured here (torch 2.13.0, MKL 2024.2,
Intel Xeon with AVX-512; 2026-12-05): the *first* VML call an OpenMP worker thread makes sometimes returns
results of reduced accuracy, up to 1.5e-4 absolute error in ``cos`` where the high-accuracy mode is within
1e-7; the same call repeated at once is exact, and later calls of any VML function on that thread are
exact. In a fresh engine process (``runtime.placement: separate``) the first forward's rotary table was
off on the worker thread's half of the rows in roughly one run in eight, so that step's log-probs differed
from the trainer's by up to 3e-3 and the exact contract failed (tests/engines/test_torch_engine_lora.py,
the ``separate`` case, flaked at that rate). It is a race: a single-threaded call first does not prevent
it, and a fresh interpreter that computes only the table does not show it.

`warm_vector_math()` makes every thread of the calling thread's intra-op team run VML functions once on
throwaway data (a 16 KiB-per-thread buffer; measured 0.2-0.5 ms for a new Python thread, ~20 ms for the
process's first, which includes MKL's own start-up; 2-7 us once warm), the first time a thread computes with a
given thread count. The model's rotary embedding calls it before its ``cos``/``sin`` on the CPU, so the engine's
steps, its scoring and the trainer's forwards (each in whatever Python thread runs them: every such thread
has its own OpenMP team) start from warmed threads.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["warm_vector_math"]

_PART = 2048  # torch's grain for these unary kernels: a tensor of 2 x _PART x threads gives each thread a part
_warmed = threading.local()  # .threads: the intra-op thread count this Python thread's team was warmed at


def warm_vector_math(device: torch.device | str = "cpu") -> None:
    """Run MKL's vector math once on every intra-op thread of this thread's team (once per thread count);
    a no-op for computations on any other ``device`` than the CPU."""
    if torch.device(device).type != "cpu":
        return
    threads = torch.get_num_threads()
    if getattr(_warmed, "threads", 0) == threads:
        return
    with torch.inference_mode():
        x = torch.full((2 * _PART * max(threads, 1),), 0.5, dtype=torch.float32, device="cpu")
        for fn in (torch.cos, torch.sin, torch.exp, torch.log, torch.tanh):
            fn(x)
        torch.cos(x.double())
    _warmed.threads = threads
