"""Host-memory allocator of a Tandem process: tcmalloc / jemalloc when present, glibc malloc settings.

**Which allocator** (``runtime.allocator``, default ``auto``). PyTorch's CPU tensors come from
``malloc``, and glibc's malloc keeps what a training step frees fragmented and resident (below). A
size-class allocator does not: measured on the LoRA recipe of SmolLM2-135M (3 steps, same session,
docs/benchmarks.md "Host allocator"), glibc peaked at 7.8-8.2 GiB RSS for 3.6-3.9 GiB of live tensors,
jemalloc at 5.4 GiB, tcmalloc at 5.2 GiB (its anonymous peak equal to the live one) and with 20-35%
shorter steps. ``auto`` takes tcmalloc, else jemalloc, else glibc; naming one that is not installed is
an error. An allocator must be loaded before the interpreter starts, so `reexec_under` restarts the
process (``os.execve`` of the same command line) with ``LD_PRELOAD`` naming the library, as PyTorch's
own CPU launcher does (``python -m torch.backends.xeon.run_cpu --enable-tcmalloc``); ``tandem train``
does so right after reading the recipe. A library use of `tandem.runtime.loop.Run` cannot switch:
it logs the allocator in use and how to preload one. The libraries are looked up in
``$TANDEM_ALLOCATOR_DIRS`` (``os.pathsep``-separated) when set, else in ``<venv>/lib/tandem-allocators``
(where ``make`` puts Debian's libtcmalloc-minimal4, scripts/fetch_allocator.sh) and the system's
library folders (``apt install libtcmalloc-minimal4`` or ``libjemalloc2``).

**tcmalloc keeps what a step freed** (``TCMALLOC_RELEASE_RATE=0``, set by the restart unless the environment
already names a rate). At its own default rate gperftools' tcmalloc hands freed pages back to the system a
few at a time as spans are freed; an RL process frees and re-allocates the same few GiB of activations every
step, so the pages it handed back fault in again at the next step, and the re-grown heap can land higher
than the first. Measured on the recipes of bench/lora.py (`bench/tcmalloc_release.py`, 3 runs of 3 steps per
recipe and rate, alternating, 2026-12-06): peak RSS at rate 0 / rate 1 full 5,039 / 5,057 MiB, LoRA 3,586 /
3,845 (rate 1 ranged 3,578-3,848: the RSS fell by 1.4 GiB after the first step and re-grew past it), QLoRA
3,304 / 3,511; 30-42% fewer minor page faults; seconds per step 0.91x / 0.92x / 0.99x. Memory still goes
back where Tandem asks for it (`release_free_memory`).

**glibc's mmap threshold** (``runtime.malloc_mmap_threshold``, glibc only):

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
from pathlib import Path

__all__ = ["ALLOCATORS", "DEFAULT_CHOICE", "ENV", "TCMALLOC_RELEASE_ENV", "AllocatorError", "active_allocator",
           "find_allocator", "reexec_under",
           "note_allocator", "release_free_memory", "resolve_allocator", "set_mmap_threshold"]

log = logging.getLogger(__name__)

ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own environment name for the same setting
TCMALLOC_RELEASE_ENV = "TCMALLOC_RELEASE_RATE"  # gperftools: how eagerly freed pages go back to the system
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_MAX = 32 << 20  # glibc refuses a threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)

# preference order of ``auto``; file names of the shared libraries (Debian's packages)
ALLOCATORS = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "jemalloc": ("libjemalloc.so.2",)}
DEFAULT_CHOICE = "auto"  # runtime.allocator's default (`tandem train` reads it before the config is built)
DIRS_ENV = "TANDEM_ALLOCATOR_DIRS"
_REEXEC_ENV = "TANDEM_ALLOCATOR_REEXEC"  # set in the restarted process: never restart twice
_SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class AllocatorError(ValueError):
    """A named allocator that is not installed."""


def search_dirs() -> list[Path]:
    env = os.environ.get(DIRS_ENV)
    if env is not None:
        return [Path(d) for d in env.split(os.pathsep) if d]
    return [Path(sys.prefix) / "lib" / "tandem-allocators", *map(Path, _SYSTEM_DIRS)]


def find_allocator(name: str) -> Path | None:
    """The shared library of allocator ``name`` (``tcmalloc``/``jemalloc``), or None when not installed."""
    for d in search_dirs():
        for lib in ALLOCATORS[name]:
            if (d / lib).is_file():
                return d / lib
    return None


def active_allocator() -> str:
    """``tcmalloc``, ``jemalloc`` (loaded into this process) or ``glibc``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    for name, libs in ALLOCATORS.items():
        if any(lib.split(".so")[0] + ".so" in maps for lib in libs):
            return name
    return "glibc"


def resolve_allocator(choice: str) -> tuple[str, Path | None]:
    """``(allocator, library)`` that ``runtime.allocator = choice`` means on this machine.

    ``auto``: the first of tcmalloc, jemalloc found, else ``("glibc", None)``. A named one that is not
    installed raises `AllocatorError` naming where it was looked for and how to install it.
    """
    if choice == "glibc" or not sys.platform.startswith("linux"):
        return "glibc", None
    if choice == "auto":
        for name in ALLOCATORS:
            path = find_allocator(name)
            if path is not None:
                return name, path
        return "glibc", None
    if choice not in ALLOCATORS:
        raise AllocatorError(f"runtime.allocator={choice!r}: one of auto, glibc, {', '.join(ALLOCATORS)}")
    path = find_allocator(choice)
    if path is None:
        raise AllocatorError(
            f"runtime.allocator={choice}: none of {', '.join(ALLOCATORS[choice])} in "
            f"{', '.join(map(str, search_dirs()))} (install it: `make allocator` fetches tcmalloc into the "
            f"venv, or apt install {'libtcmalloc-minimal4' if choice == 'tcmalloc' else 'libjemalloc2'}; "
            "or set runtime.allocator=auto/glibc)"
        )
    return choice, path


def reexec_under(choice: str) -> str:
    """Restart this process under the allocator ``runtime.allocator = choice`` means, if it is not loaded.

    Returns the allocator in use when no restart is needed (``os.execve`` does not return otherwise). The
    restart runs the same interpreter with the same arguments (``sys.orig_argv``) and ``LD_PRELOAD``
    extended by the library; it happens once at most (a marker in the environment).
    """
    name, path = resolve_allocator(choice)
    active = active_allocator()
    if name == active or path is None:
        return active
    if os.environ.get(_REEXEC_ENV):
        log.warning("runtime.allocator: %s was preloaded (%s) but is not in use; running on %s", name, path, active)
        return active
    preload = " ".join(p for p in (str(path), os.environ.get("LD_PRELOAD", "")) if p)
    log.info("restarting under %s (runtime.allocator=%s): LD_PRELOAD=%s", name, choice, path)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, "LD_PRELOAD": preload, _REEXEC_ENV: "1"}
    if name == "tcmalloc":
        env.setdefault(TCMALLOC_RELEASE_ENV, "0")  # keep freed memory for the next step (module docstring)
    os.execve(sys.executable, list(sys.orig_argv), env)
    raise AssertionError("unreachable")  # pragma: no cover


def note_allocator(choice: str, mmap_threshold: int = 0) -> str:
    """Log the allocator this process runs on (a library use cannot switch: say how to) and apply
    ``mmap_threshold`` when it is glibc's; returns the allocator in use."""
    active = active_allocator()
    wanted, path = resolve_allocator(choice)
    if wanted != active and path is not None:
        log.info("host allocator: %s; %s is installed but not loaded (`tandem train` preloads it; a library "
                 "use needs LD_PRELOAD=%s before Python starts)", active, wanted, path)
    else:
        log.info("host allocator: %s", active)
    if mmap_threshold and active != "glibc":
        log.warning("runtime.malloc_mmap_threshold=%d applies to glibc malloc only; %s is in use: ignored",
                    mmap_threshold, active)
    elif mmap_threshold:
        set_mmap_threshold(mmap_threshold)
    return active


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc malloc's mmap threshold at ``nbytes`` for this process and its future children.

    Returns True when it was set; False when ``nbytes`` is 0 (keep glibc's dynamic threshold) or the C
    library is not glibc. A value outside ``0 .. 32 MiB`` raises ValueError naming the limit.
    """
    if not 0 <= nbytes <= _MAX:
        raise ValueError(f"malloc_mmap_threshold={nbytes} must be in [0, {_MAX}] bytes (0: glibc's default)")
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return False
    libc = _glibc()  # glibc only: musl's mallopt ignores this option
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused; freed host memory may stay resident", nbytes)
        return False
    os.environ[ENV] = str(int(nbytes))
    return True


def release_free_memory() -> bool:
    """Hand the memory the allocator holds free back to the system (``madvise``); live memory is untouched.

    For the end of a one-off phase that freed much more than the steady state reuses in the same shapes,
    such as a data-parallel rank that loaded whole models and kept only its shards: tcmalloc keeps the freed
    spans resident and splits them for later requests of other sizes, so the untouched rest of each span
    stays in RSS for the whole run. Measured on SmolLM2-135M at world 2 (FSDP, docs/benchmarks.md): ~310 MiB
    free after the build; the training peak per rank 1,341 -> 1,309 MiB over 7 steps with the release.
    tcmalloc: ``MallocExtension_ReleaseFreeMemory``; jemalloc: purge every arena; glibc: ``malloc_trim(0)``.
    Returns whether a release call was made. Costs a page fault per page reused later (once, not per step).
    """
    if not sys.platform.startswith("linux"):
        return False
    active = active_allocator()
    try:
        if active == "tcmalloc":
            ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
        elif active == "jemalloc":
            mallctl = ctypes.CDLL(None).mallctl
            # MALLCTL_ARENAS_ALL (4096): every arena
            mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
        elif (libc := _glibc()) is not None:
            libc.malloc_trim(ctypes.c_size_t(0))
        else:
            return False
    except (OSError, AttributeError):
        return False
    return True
