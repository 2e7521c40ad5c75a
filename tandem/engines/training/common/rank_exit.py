"""End a training rank's process without the interpreter's finalization (torch 2.13, gloo).

`dist.destroy_process_group` unregisters the group but does not stop its gloo worker threads: those
are joined only when the last reference to the group goes, and the device mesh holds one while
DTensor's sharding-propagation caches hold the mesh (their specs name it): after the engine is closed
and collected, the mesh stays, until the interpreter tears it down. A worker destroys each finished
collective's work object after it has signalled completion, and releasing a tensor that has a Python
object takes the GIL. If that happens once the main thread has begun finalizing, CPython ends the
worker thread by unwinding it through a ``noexcept`` destructor, and libstdc++ aborts the process:
``terminate called without an active exception``, SIGABRT, after a run whose work all succeeded
(pytorch/pytorch#117762, #190489). It needs the worker to be descheduled between the two steps, so
it shows on a loaded machine: ~1 in 10 runs of tests/sync/test_engine_process.py while its rank 0
starts Ray.

`exit_rank` is what a rank's entry point calls when its work is done: as a normal exit would, it waits
for the non-daemon threads (a checkpoint writer, say), runs the ``atexit`` handlers and flushes the
standard streams; then it leaves with ``os._exit``, which never
starts the finalization the worker threads race with. It is for the end of a process the caller owns
(a spawned or torchrun rank), not for library code.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["exit_rank"]


def exit_rank(code: int = 0) -> None:
    """Join the non-daemon threads, run the ``atexit`` handlers, flush stdout/stderr and end the process
    with ``code`` (never returns)."""
    if not 0 <= code <= 255:
        raise ValueError(f"exit code {code} is outside 0..255")
    try:
        # what the interpreter's shutdown does first: tell idle executors to stop (their workers are
        # non-daemon threads waiting for work), then wait for every non-daemon thread
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # closed or replaced stream: nothing to flush
                pass
        os._exit(code)
