"""Host-memory allocator settings of a Tandem process (glibc malloc).

PyTorch's CPU tensors come from ``malloc``. glibc serves a request of at least ``M_MMAP_THRESHOLD``
bytes (128 KiB at start) with its own ``mmap`` and unmaps it on ``free``; smaller ones come from the
heap arenas, whose free space stays resident. But the threshold is dynamic: every time a mmap'd
chunk is freed, glibc raises the threshold to that chunk's size (up to 32 MiB on 64-bit). After the
first training step has freed its logits chunks, every activation of a small model (a few MiB each)
lands in the arenas, and what a step frees there stays in the process: measured on SmolLM2-135M
(LoRA recipe, docs/benchmarks.md "LoRA and QLoRA"), the first training step left 4.7 GiB free but
resident inside malloc, and the process's peak RSS was 8.2 GiB for 3.8 GiB of live tensors.

A fixed threshold (``mallopt(M_MMAP_THRESHOLD, n)``, which also turns the dynamic adjustment off)
returns every freed tensor of ``n`` bytes or more to the system at once: with ``n`` = 1 MiB the same
run peaks at 5.3 GiB. The price is a page fault per page of every new large tensor (each temporary
of each op) instead of reusing warm heap memory: the LoRA step took 1.5x as long (30 s vs 20 s), full
fine-tuning 1.3x. So it is off by default; ``runtime.malloc_mmap_threshold`` sets ``n`` for a run
that must fit a memory limit (0: glibc's dynamic default). Measured alternatives (same run):
``n`` = 8 MiB: 7.1 GiB at 1.2x; 32 MiB: 8.0 GiB; ``malloc_trim(0)`` after every backward: 7.2 GiB at
1.25x; ``MALLOC_ARENA_MAX=1``: no change (the retained memory is in the main arena: fragmentation
between micro-batches of different sizes, not per-thread arenas).

The setting is also exported as ``MALLOC_MMAP_THRESHOLD_`` so that processes this one starts (a
separate engine, Ray workers started from here, torch's spawned ranks) read it at their own start.
Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

__all__ = ["ENV", "set_mmap_threshold"]

log = logging.getLogger(__name__)

ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own environment name for the same setting
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_MAX = 32 << 20  # glibc refuses a threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc malloc's mmap threshold at ``nbytes`` for this process and its future children.

    Returns True when it was set; False when ``nbytes`` is 0 (keep glibc's dynamic threshold) or the C
    library is not glibc. A value outside ``0 .. 32 MiB`` raises ValueError naming the limit.
    """
    if not 0 <= nbytes <= _MAX:
        raise ValueError(f"malloc_mmap_threshold={nbytes} must be in [0, {_MAX}] bytes (0: glibc's default)")
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl's mallopt ignores this option)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; freed host memory may stay resident", nbytes)
        return False
    os.environ[ENV] = str(int(nbytes))
    return True
