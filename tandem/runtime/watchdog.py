"""Runs that stop making progress fail, loudly: the progress watchdog and the skipped-step limit.

* `Watchdog`: no step completed for ``runtime.watchdog_s`` seconds (0: off) is an error naming the
  phase the loop is in (and the phases of its helper threads, e.g. the one-step-off rollout). The
  watchdog thread records the error, dumps every thread's stack to stderr and calls ``on_expire``
  (the loop interrupts its own thread, `tandem.runtime.preemption`); waits the loop polls (the
  fully-async queue, the one-step-off rollout) raise it too.
* `SkipCounter`: ``runtime.max_skipped_steps`` consecutive steps that trained on nothing (no sample
  survived the filters, ``train/no_samples``) or whose update the trainer refused (NaN/Inf loss or
  gradient, ``train/skipped_step``) fail the run with the reason: the filters' drop counts and the
  errors the samples carry (reward errors, generation errors). A step skipped only because every group
  had one reward for all its samples (``filter/dropped_zero_std_group``) does not count and ends a
  streak: that is a run with nothing left to learn (e.g. every answer correct), not a broken one.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tandem.core.sample import Sample

__all__ = ["Background", "SkipCounter", "SkippedStepsError", "Stalled", "Watchdog", "failure_messages"]

log = logging.getLogger(__name__)


class Stalled(RuntimeError):
    """No step completed within ``runtime.watchdog_s``; the message names the phase that was stuck."""


class SkippedStepsError(RuntimeError):
    """``runtime.max_skipped_steps`` consecutive steps were skipped; the message says why."""


class Watchdog:
    """``with Watchdog(timeout_s, on_expire=...)``: ``phase(step, name)`` on every phase (from any thread),
    ``step_done()`` after every step; once expired, ``expired`` holds the message."""

    def __init__(self, timeout_s: float, *, on_expire: Callable[[], None] = lambda: None) -> None:
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self.expired: str | None = None
        self._last = time.monotonic()
        self._owner = threading.get_ident()
        self._phases: dict[int, tuple[str, int, str]] = {}  # thread id -> (thread name, step, phase)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self._owner = threading.get_ident()
        self._last = time.monotonic()
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="tandem-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (e.g. before the checkpoint a stop signal asks for, which may take a while)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def phase(self, step: int, name: str) -> None:
        t = threading.current_thread()
        if t.ident not in self._phases and len(self._phases) > 8:  # forget helper threads that ended
            alive = {a.ident for a in threading.enumerate()}
            self._phases = {k: v for k, v in self._phases.items() if k in alive}
        self._phases[t.ident] = (t.name, step, name)

    def current_phase(self) -> str | None:
        """The phase of the thread that runs the loop (None before its first phase)."""
        entry = self._phases.get(self._owner)
        return entry[2] if entry else None

    def step_done(self) -> None:
        self._last = time.monotonic()

    def describe(self, idle_s: float) -> str:
        loop = self._phases.get(self._owner)
        where = f"step {loop[1]}, phase {loop[2]!r}" if loop else "before the first phase"
        alive = {t.ident for t in threading.enumerate()}
        helpers = [f"{name}: step {step}, phase {phase!r}" for ident, (name, step, phase) in self._phases.items()
                   if ident != self._owner and ident in alive]
        extra = f" (helper threads: {'; '.join(helpers)})" if helpers else ""
        return (f"no training step completed for {idle_s:.0f}s (runtime.watchdog_s={self.timeout_s:g}): stuck in "
                f"{where}{extra}")

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            self.expired = self.describe(idle)
            log.error("%s; every thread's stack follows on stderr", self.expired)
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            except (ValueError, OSError):  # no usable stderr (e.g. captured to a non-file)
                pass
            self.on_expire()
            return


def failure_messages(samples: Sequence[Sample]) -> collections.Counter:
    """``{message: samples}`` of the errors the samples carry (reward errors, generation errors)."""
    out: collections.Counter = collections.Counter()
    for s in samples:
        for key in ("reward_error", "error"):
            if s.metadata.get(key):
                out[str(s.metadata[key])] += 1
    return out


class SkipCounter:
    """Fails the run after ``max_skipped`` consecutive skipped steps (0: never); see the module docstring."""

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped = max_skipped
        self.streak: list[int] = []
        self._failures: dict[int, collections.Counter] = {}
        self._lock = threading.Lock()

    def note_samples(self, step: int, samples: Sequence[Sample]) -> dict[str, float]:
        """Remember the errors among a step's samples (any thread); returns ``reward/errors``."""
        failures = failure_messages(samples)
        with self._lock:
            self._failures[step] = failures
        return {"reward/errors": float(sum(1 for s in samples if s.metadata.get("reward_error")))}

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """After a step: extend or end the streak; raise `SkippedStepsError` when it reaches the limit."""
        with self._lock:
            failures = self._failures.pop(step, collections.Counter())
            for old in [k for k in self._failures if k < step]:
                del self._failures[old]
        if not self.counts(metrics):
            self.streak = []
            return
        self.streak.append(step)
        if self.max_skipped and len(self.streak) >= self.max_skipped:
            raise SkippedStepsError(
                f"{len(self.streak)} consecutive steps were skipped (steps {self.streak[0]}..{self.streak[-1]}, "
                f"runtime.max_skipped_steps={self.max_skipped}): {self.reason(metrics, failures)}"
            )

    @staticmethod
    def counts(metrics: dict[str, Any]) -> bool:
        if not metrics.get("train/skipped_step"):
            return False
        if not metrics.get("train/no_samples"):
            return True  # the trainer refused the update (NaN/Inf)
        drops = {k: v for k, v in metrics.items() if k.startswith("filter/dropped_") and v}
        return set(drops) != {"filter/dropped_zero_std_group"}

    @staticmethod
    def reason(metrics: dict[str, Any], failures: collections.Counter) -> str:
        if not metrics.get("train/no_samples"):
            return (f"the trainer refused the update: loss={metrics.get('train/loss')}, "
                    f"grad_norm={metrics.get('train/grad_norm')} (NaN/Inf)")
        drops = {k.removeprefix("filter/dropped_"): int(v) for k, v in metrics.items()
                 if k.startswith("filter/dropped_") and v}
        text = "no sample survived the filters"
        if drops:
            text += " (dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) + ")"
        if failures:
            top = "; ".join(f"{msg} ({n} samples)" for msg, n in failures.most_common(3))
            text += f"; errors: {top}"
        return text


class Background:
    """``fn(*args)`` in a daemon thread (a pool's worker would keep a hung process from exiting);
    `result` waits for it, calling ``poll`` between slices (to let the watchdog or a signal stop the wait)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str) -> None:
        self._future: cf.Future = cf.Future()
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self._future.set_exception(e)

    def done(self) -> bool:
        return self._future.done()

    def result(self, *, poll: Callable[[], None] = lambda: None, interval_s: float = 0.2) -> Any:
        while True:
            try:
                return self._future.result(timeout=interval_s)
            except cf.TimeoutError:
                poll()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the %s thread did not end within %.0fs; leaving it behind", self._thread.name, timeout_s)
