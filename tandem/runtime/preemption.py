"""SIGINT / SIGTERM (a preemption, Ctrl-C) stop a run at a step boundary with a checkpoint.

`StopSignals` is entered by `Run.train` in the main thread. On the first signal:

* while the loop only waits for or makes rollouts (phases other than ``COMMIT_PHASES``), the step in
  flight is abandoned at once: the handler raises `Preempted` in the loop's thread. Nothing the
  trainer holds has changed yet in such a phase, so the last completed step is intact;
* while the trainer computes, trains, syncs or saves (``COMMIT_PHASES``), the step is finished first
  and the loop stops after it (`check_after_step`).

The loop then saves a checkpoint of the last completed step (`Run.train`) and re-raises `Preempted`
(a `KeyboardInterrupt`: code that does not handle it ends as after Ctrl-C); ``tandem train`` prints
where it stopped and exits with 128 + the signal number. A second signal exits at once (``os._exit``),
without a checkpoint. The watchdog uses the same path to interrupt a stuck loop (`interrupt`).
Outside the main thread no handler is installed: the loop's polled waits still stop it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["COMMIT_PHASES", "Interrupted", "Preempted", "StopSignals", "StuckInterrupt"]

log = logging.getLogger(__name__)

# the trainer is in the middle of a step (possibly a collective): finish it before stopping
COMMIT_PHASES = frozenset({"logprobs", "train", "sync", "finish"})
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised in the loop's thread to stop it from outside the step (a signal, the watchdog)."""


class Preempted(Interrupted):
    """The run was stopped by a signal; ``checkpoint`` is the checkpoint saved for ``step`` (if any)."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame
        self.step: int | None = None
        self.checkpoint: Path | None = None

    @property
    def exit_code(self) -> int:
        return 128 + int(getattr(signal, self.signame))

    def __str__(self) -> str:
        where = f" after step {self.step}" if self.step is not None else ""
        saved = f"; saved checkpoint {self.checkpoint}" if self.checkpoint else ""
        return f"stopped by {self.signame}{where}{saved}"


class StuckInterrupt(Interrupted):
    """The watchdog expired (the loop turns it into `Stalled`)."""


class StopSignals:
    """``with StopSignals(phase=...)``: install the handlers (main thread only), restore them on exit.

    ``phase()`` returns the loop thread's current phase (None: between steps).
    """

    def __init__(self, *, phase: Callable[[], str | None]) -> None:
        self.phase = phase
        self.requested: str | None = None
        self.stuck = False
        self._previous: dict[int, object] = {}
        self._main = threading.main_thread().ident

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _abandonable(self) -> bool:
        return self.phase() not in COMMIT_PHASES

    def _handle(self, signum: int, frame) -> None:
        if self.stuck:
            raise StuckInterrupt()
        name = signal.Signals(signum).name
        if self.requested is not None:
            print(f"tandem: second signal ({name}): exiting at once, without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.requested = name
        if self._abandonable():
            log.warning("%s: abandoning the step in flight (phase %r) to save the last completed step",
                        name, self.phase())
            raise Preempted(name)
        log.warning("%s: finishing the step in flight (phase %r), then saving and stopping; a second signal "
                    "exits at once", name, self.phase())

    def interrupt(self) -> None:
        """Interrupt the loop's thread (the watchdog's ``on_expire``); a no-op without handlers."""
        self.stuck = True
        if self.installed and self._main is not None:
            signal.pthread_kill(self._main, signal.SIGINT)

    def check(self) -> None:
        """For the loop's polled waits: raise if a signal asks to stop and the step can be abandoned."""
        if self.stuck:
            raise StuckInterrupt()
        if self.requested is not None and self._abandonable():
            raise Preempted(self.requested)

    def check_after_step(self) -> None:
        """After a completed step: stop if a signal arrived during it."""
        if self.requested is not None:
            raise Preempted(self.requested)
