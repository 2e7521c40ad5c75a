"""`run_blocking`: ``asyncio.run`` for code that a signal handler may interrupt.

When a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, a run's ``Preempted``) is
raised inside a task that another task gathers, it propagates out of the event loop at once; the gathering
task only ends with it while `asyncio.run` shuts the loop down, and nobody retrieves it there: asyncio then
logs "Task exception was never retrieved" with a traceback when the task is collected. A run stopped by
SIGTERM in the middle of a rollout printed such a traceback on stderr although it stopped correctly.

`run_blocking` runs the loop as ``asyncio.run`` does (a fresh loop; async generators closed at the end), and
when the run ends with a ``KeyboardInterrupt`` or ``SystemExit`` it cancels the tasks still pending, waits for
them, and retrieves the exception of every task it saw, before it re-raises. An ``Exception`` ends the run as
under ``asyncio.run`` (it reaches the step's task through the gather, which the caller's result retrieves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_blocking"]

T = TypeVar("T")


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new event loop in this thread and return its result."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        main = loop.create_task(coro)
        try:
            return loop.run_until_complete(main)
        except (KeyboardInterrupt, SystemExit):  # the two a task re-raises out of the loop (asyncio.Task)
            _settle(loop, main)
            raise


def _settle(loop: asyncio.AbstractEventLoop, main: asyncio.Task) -> None:
    """Cancel and wait for the loop's pending tasks, then mark every seen task's exception retrieved."""
    seen = {main}
    for _ in range(100):  # each pass may end early: a task that ends with a KeyboardInterrupt re-raises it
        pending = {t for t in asyncio.all_tasks(loop) if not t.done()}
        if not pending:
            break
        seen |= pending
        for task in pending:
            task.cancel()
        try:
            loop.run_until_complete(asyncio.wait(pending))
        except BaseException:  # noqa: BLE001 - the caller re-raises the first one
            pass
    for task in seen:
        if task.done() and not task.cancelled():
            task.exception()
