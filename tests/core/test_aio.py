"""`run_blocking`: a run stopped by a signal inside a coroutine leaves no "Task exception was never retrieved"."""

import asyncio
import gc
import logging
import os
import signal

import pytest

from tandem.core.aio import run_blocking
from tandem.runtime.preemption import Preempted, StopSignals


class Stop(KeyboardInterrupt):
    pass


async def _raise_in_main_task():
    await asyncio.sleep(0)
    raise Stop("stop")


def _stops(run, make) -> bool:
    """Run and drop the exception (its traceback keeps the task alive until it is gone)."""
    try:
        run(make())
    except Stop:
        return True
    return False


def _never_retrieved(caplog) -> list[str]:
    gc.collect()
    return [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_the_result_and_an_ordinary_exception_pass_through():
    async def double(x):
        await asyncio.sleep(0)
        return 2 * x

    assert run_blocking(double(21)) == 42

    async def bad():
        raise ValueError("bad value")

    with pytest.raises(ValueError, match="bad value"):
        run_blocking(bad())


def test_a_base_exception_in_the_main_task_is_consumed(caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    assert _stops(run_blocking, _raise_in_main_task)
    assert _never_retrieved(caplog) == []


def test_a_base_exception_in_a_child_task_is_consumed(caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")

    async def child(i):
        await asyncio.sleep(0.01 * i)
        if i == 1:
            raise Stop("child")
        await asyncio.sleep(10)

    async def main():
        await asyncio.gather(*(child(i) for i in range(3)))

    # the control: asyncio.run leaves the gathering task's exception unretrieved (what run_blocking fixes)
    assert _stops(asyncio.run, main)
    assert _never_retrieved(caplog), "asyncio.run no longer leaks it: run_blocking may be dropped"
    caplog.clear()
    assert _stops(run_blocking, main)
    assert _never_retrieved(caplog) == []


def test_sigterm_during_a_rollout_phase_stops_cleanly(caplog):
    """`StopSignals` raises `Preempted` in whatever frame runs: here one group's task, gathered by the step."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    finished = []

    async def group(i):
        await asyncio.sleep(0.01 * i)
        if i == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            total = 0
            for k in range(10_000_000):  # synchronous work (a tokenizer call): the handler runs in this frame
                total += k
        else:
            await asyncio.sleep(10)
        finished.append(i)

    async def step():
        await asyncio.gather(*(group(i) for i in range(3)))

    signame = None  # set by the Preempted the run must end with
    with StopSignals(phase=lambda: "rollout") as stops:
        assert stops.installed
        try:
            run_blocking(step())
        except Preempted as e:
            signame = e.signame
    assert signame == "SIGTERM" and finished == []
    assert _never_retrieved(caplog) == []
