"""Choosing between the torch reference and the Triton kernel, and shared argument checks.

Triton is imported only here, lazily, when a kernel is actually requested, so ``import
tandem.kernels`` works without triton and without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Smallest block amax used to build a scale: an all-zero block still gets a finite, non-zero scale.
# A power of two, so it is the same number in fp32, bf16 and in every kernel (~1.16e-10).
AMAX_FLOOR = 2.0**-33
E4M3_MAX = 448.0


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor, backend: Backend) -> bool:
    """Whether to run the Triton kernel for tensor ``x`` under ``backend``."""
    if backend == "torch":
        return False
    if backend == "auto":
        return x.is_cuda and triton_available() and not interpreter_on()
    if backend != "triton":
        raise ValueError(f"backend={backend!r} is not one of auto, torch, triton")
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package (pip install 'tandem-rl[dev]')")
    if not x.is_cuda and not interpreter_on():
        raise ValueError(
            f"backend='triton' on a {x.device.type} tensor needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return True


def kernels() -> ModuleType:
    """The Triton kernel module (imports triton)."""
    from tandem.kernels import triton_kernels

    return triton_kernels


def check_float(x: torch.Tensor, name: str, min_dim: int = 1) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; expected one of float32, bfloat16, float16")
    if x.dim() < min_dim:
        raise ValueError(f"{name} has {x.dim()} dimensions; expected at least {min_dim}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")


def check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype} is not one of float32, bfloat16, float16")


def check_codes(q: torch.Tensor, name: str) -> None:
    if q.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{name} has dtype {q.dtype}; expected uint8 (or float8_e4m3fn) codes")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` -> ``[R, K]`` with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
