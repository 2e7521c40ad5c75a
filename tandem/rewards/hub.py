"""The reward hub: built-in rewards by name, user rewards by import path, scored concurrently.

A reward is one or more weighted *terms*. A single term gives a float reward; several give a dict
reward ``{"score": weighted sum, "<term>": value, ...}`` whose ``score`` is what advantages use.

A user reward is ``module.path:function``, imported and checked at start-up. It takes one `Sample`
(or, with ``batched: true``, a list of samples) and returns a float or a dict with a ``score`` key (or
a list of them); it may be ``async``.

Where the terms run (``reward.isolation``), ``num_workers`` calls at a time:

- ``thread`` (default, cheapest): daemon threads of the Tandem process. **User code runs in the Tandem
  process.** A thread cannot be killed: a call that times out is abandoned (it finishes, or hangs, in
  the background, logged at WARNING) and another thread takes its place, so one hung reward never
  starves the later ones; being a daemon, an abandoned thread never keeps the process from exiting.
- ``process``: worker processes (multiprocessing ``spawn``; never ``fork``, the parent has torch
  threads), started when the hub is built. Each rebuilds the terms from their `RewardTermConfig`s
  (factories return closures, which do not pickle), so only samples and results cross, pickled. A call
  that runs past ``timeout_s`` (timed from when its worker receives it) gets its worker killed (SIGKILL)
  and replaced; a worker that dies (``os._exit``, a segfault) fails its samples with its exit code and
  is replaced; `close` kills them all, and so does interpreter exit for a hub never closed. Measured on
  2 CPU cores: a worker is ready 1.2 s after the hub is built (4 workers: 3 s; each imports torch,
  through `tandem.core`), in the background while the loop generates, and holds ~180 MiB of its own
  memory; 64 samples of the ``math`` reward take 17 ms in 4 threads, 18-20 ms in 4 processes, 25 ms in
  1 (~0.13 ms per call); big fields cost their pickling (a 6 MB routed-experts array: ~10 ms). A
  reward's changes to its sample object stay in the worker, and a script that builds a hub needs the
  ``if __name__ == "__main__":`` guard (spawn imports the main module).

Failure policy: a term that raises, times out or returns NaN/Inf marks its sample FAILED (the reason
goes to ``sample.metadata["reward_error"]``), is counted in the metrics (the loop logs ``reward/errors``
per step) and in `RewardHub.error_counts` by message, is logged (at WARNING the first time a message
occurs, then at DEBUG), and never stops a step (the loop's ``runtime.max_skipped_steps`` stops a run
whose steps are all skipped). A reward that raises ``TimeoutError`` itself has raised; only the hub's
``timeout_s`` counts as a timeout (``reward/timeout``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import inspect
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.util as mp_util
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.core.aio import run_blocking
from tandem.core.sample import Sample, SampleStatus
from tandem.plugins import PluginError, check_arity, load_callable
from tandem.rewards.builtin import BUILTINS
from tandem.rewards.remote import remote

__all__ = ["RewardConfig", "RewardHub", "RewardTermConfig", "builtin_names"]

log = logging.getLogger(__name__)

_FACTORIES: dict[str, Callable[..., Callable[[Sample], Any]]] = {**BUILTINS, "remote": remote}


def builtin_names() -> list[str]:
    return sorted(_FACTORIES)


@dataclass(kw_only=True, slots=True)
class RewardTermConfig:
    """One reward term: a built-in name (with its options in ``kwargs``) or ``module:function``."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = False  # import-path rewards only: the function takes a list of samples

    def __post_init__(self) -> None:
        if self.name not in _FACTORIES and ":" not in self.name:
            raise ValueError(
                f"unknown reward {self.name!r} (choose one of: {', '.join(builtin_names())}, "
                "or an import path 'module:function')"
            )


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The recipe's ``reward:`` section."""

    terms: list[RewardTermConfig] = field(default_factory=lambda: [RewardTermConfig(name="math")])
    timeout_s: float = 30.0
    num_workers: int = 4
    isolation: Literal["thread", "process"] = "thread"  # where terms run (module docstring)

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("terms must hold at least one reward term")
        if self.isolation not in ("thread", "process"):
            raise ValueError(
                f"isolation={self.isolation!r} is not a valid choice (choose one of: thread, process)"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers} must be >= 1")
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward term names repeat: {names}")


def _term_key(name: str) -> str:
    return name.rsplit(":", 1)[-1]


class _Term:
    def __init__(self, cfg: RewardTermConfig) -> None:
        self.cfg = cfg
        self.key = _term_key(cfg.name)
        if cfg.name in _FACTORIES:
            try:
                self.fn = _FACTORIES[cfg.name](**cfg.kwargs)
            except (TypeError, ValueError) as e:
                raise PluginError(f"reward {cfg.name!r}: bad kwargs {cfg.kwargs}: {e}") from None
            self.batched = False
        else:
            self.fn = load_callable(cfg.name, what="reward")
            check_arity(self.fn, 1, name=f"reward {cfg.name!r}")
            self.batched = cfg.batched
        self.is_async = inspect.iscoroutinefunction(self.fn)


def _as_float(value: Any) -> float:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"dict reward {value} has no 'score' key")
        value = value["score"]
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"reward is {v}")
    return v


def _call_sync(fn, arg):
    out = fn(arg)
    if inspect.isawaitable(out):

        async def _await():
            return await out

        return run_blocking(_await())
    return out


class _Timeout(Exception):
    """A term call ran past ``timeout_s``."""


class _Failure(Exception):
    """A term call failed in a worker process (the reward raised, the worker died, the hub was closed);
    ``args[0]`` is the sample's error message."""


class _Died(Exception):
    """The worker process ended (``args[0]``: why, naming the exit code)."""


class _DaemonPool:
    """``num_workers`` daemon threads serving one queue of calls. Unlike a ``ThreadPoolExecutor``'s,
    a daemon thread is not joined at interpreter exit, so one abandoned in a hung call cannot keep the
    process alive; `abandon` starts another in its place, keeping the pool's size."""

    def __init__(self, num_workers: int, name: str) -> None:
        self._num_workers, self._name = num_workers, name
        self._calls: queue.SimpleQueue[tuple[cf.Future, Callable, tuple] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[cf.Future, threading.Thread] = {}
        self._abandoned: set[threading.Thread] = set()
        self._started = self._closed = False
        self.num_abandoned = 0  # threads abandoned so far

    def submit(self, fn: Callable, *args: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward hub is closed")
            if not self._started:  # threads start with the first call: a hub never used costs nothing
                self._started = True
                for _ in range(self._num_workers):
                    self._start_thread()
            self._calls.put((fut, fn, args))
        return fut

    def abandon(self, fut: cf.Future) -> bool:
        """Leave the thread running ``fut`` to finish (or hang) in the background and start another."""
        with self._lock:
            thread = self._running.get(fut)
            if thread is None or thread in self._abandoned or self._closed:
                return False
            self._abandoned.add(thread)
            self.num_abandoned += 1
            self._start_thread()
        return True

    def num_running_abandoned(self) -> int:
        with self._lock:
            return len(self._abandoned)

    def close(self) -> None:
        """Cancel the queued calls; each thread exits after its current call (none is waited for)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._num_workers if self._started else 0):
            self._calls.put(None)

    def _start_thread(self) -> None:
        threading.Thread(target=self._serve, name=self._name, daemon=True).start()

    def _serve(self) -> None:
        me = threading.current_thread()
        while (item := self._calls.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[fut] = me
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
                fut.set_exception(e)
            with self._lock:
                del self._running[fut]
                if me in self._abandoned:  # its replacement serves the queue now
                    self._abandoned.discard(me)
                    return


# -- process isolation --------------------------------------------------------------------------------

_STARTUP_S = 120.0  # longest wait for a new worker process to be ready (it imports torch and the rewards)


def _worker_main(conn: mpc.Connection, term_cfgs: list[RewardTermConfig]) -> None:
    """A reward worker process: build the terms, then answer ``(term index, sample or samples)`` with
    ``("ok", value)`` or ``("raised", type name, message)`` until the hub closes the connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which closes its workers
    try:
        terms = [_Term(c) for c in term_cfgs]
    except Exception as e:  # noqa: BLE001 - reported to the hub, which checked the same terms at start-up
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            index, arg = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", _call_sync(terms[index].fn, arg))
        except Exception as e:  # noqa: BLE001 - a reward bug fails its samples, not the worker
            reply = ("raised", type(e).__name__, str(e))
        try:
            conn.send(reply)
        except OSError:  # the hub is gone
            return
        except Exception as e:  # noqa: BLE001 - e.g. a result that does not pickle
            conn.send(("raised", type(e).__name__, f"{e} (returning the result from the reward worker)"))


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}, exit code {code}"
        except ValueError:
            pass
    return f"exit code {code}"


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, term_cfgs: list[RewardTermConfig]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, term_cfgs), name="tandem-reward-worker")
        self.proc.start()
        child.close()  # the worker's end lives only in the worker: its death reads as EOF here
        self.ready = False

    def call(self, index: int, arg: Any, timeout_s: float) -> tuple:
        """The worker's reply to one term call: ``("ok", value)`` or ``("raised", type name, message)``.
        Raises `_Timeout` after ``timeout_s`` (the worker is still running it) or `_Died` if it ended."""
        if not self.ready:
            reply = self._reply(_STARTUP_S)
            if reply is None or reply[0] != "ready":
                why = "did not start" if reply is None else f"could not build the reward terms: {reply[1]}"
                raise _Died(why)
            self.ready = True
        try:
            self.conn.send((index, arg))  # pickles first, so a sample that does not pickle sends nothing
        except OSError:
            raise _Died(f"died ({_exit_reason(self.exitcode())})") from None
        except Exception as e:  # noqa: BLE001 - the sample does not pickle; the worker is fine
            return ("raised", type(e).__name__, f"{e} (sending the sample to the reward worker process)")
        reply = self._reply(timeout_s)
        if reply is None:
            raise _Timeout
        return reply

    def _reply(self, timeout_s: float) -> tuple | None:
        try:
            ready = mpc.wait([self.conn, self.proc.sentinel], timeout_s)
            if not ready:
                return None
            if self.conn in ready:
                return self.conn.recv()
        except (EOFError, OSError):  # EOF: it died; OSError: `close` closed the pipe meanwhile
            pass
        raise _Died(f"died ({_exit_reason(self.exitcode())})")

    def exitcode(self) -> int | None:
        self.proc.join(5.0)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()


class _Registry:
    """The live worker processes. Once closed (by `close`, by garbage collection, or at interpreter exit
    before multiprocessing joins its children) it kills them all and starts no more."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: set[_Worker] = set()
        self.closed = False

    def start(self, ctx: Any, term_cfgs: list[RewardTermConfig]) -> _Worker | None:
        with self.lock:
            if self.closed:
                return None
            worker = _Worker(ctx, term_cfgs)
            self.workers.add(worker)
            return worker

    def retire(self, worker: _Worker) -> None:
        with self.lock:
            self.workers.discard(worker)
        worker.kill()

    def pids(self) -> list[int]:
        with self.lock:
            return sorted(w.proc.pid for w in self.workers)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            doomed = list(self.workers)
            self.workers.clear()
        for w in doomed:
            w.kill()


class _ProcessPool:
    """``num_workers`` worker processes, each driven by a thread of a `_DaemonPool`: a driver takes an
    idle worker, sends it one term call and waits for the reply up to ``timeout_s``. A worker that runs
    past it is killed and a new one started in its place, as is one that dies."""

    def __init__(self, cfg: RewardConfig, terms: list[_Term]) -> None:
        self._ctx = mp.get_context("spawn")  # not fork: the parent has torch (and its threads)
        self._term_cfgs = [t.cfg for t in terms]
        self._names = [t.cfg.name for t in terms]
        self._timeout_s = cfg.timeout_s
        self._registry = _Registry()
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._drivers = _DaemonPool(cfg.num_workers, "tandem-reward-driver")
        # exitpriority: a hub never closed still kills its workers at exit, before multiprocessing joins
        # its children (an idle worker would wait for work forever)
        self._finalizer = mp_util.Finalize(self, self._registry.close, exitpriority=100)
        for _ in range(cfg.num_workers):  # at once: they start while the loop generates the first batch
            self._idle.put(self._registry.start(self._ctx, self._term_cfgs))

    def worker_pids(self) -> list[int]:
        return self._registry.pids()

    def submit(self, index: int, arg: Any) -> cf.Future:
        return self._drivers.submit(self._call, index, arg)

    def close(self) -> None:
        self._drivers.close()
        self._finalizer()  # kills and joins every worker
        self._idle.put(None)  # wakes a driver waiting for an idle worker; each passes it on

    def _call(self, index: int, arg: Any) -> Any:
        name = self._names[index]
        worker = self._idle.get()
        if worker is None or self._registry.closed:
            self._idle.put(None)
            raise _Failure(f"reward {name!r}: the reward hub was closed")
        try:
            reply = worker.call(index, arg, self._timeout_s)
        except (_Timeout, _Died) as e:
            self._registry.retire(worker)
            worker = self._registry.start(self._ctx, self._term_cfgs)  # None once closed
            if isinstance(e, _Timeout):
                raise
            if worker is None:  # `close` killed it
                raise _Failure(f"reward {name!r}: the reward hub was closed") from None
            raise _Failure(f"reward {name!r}: its worker process {e}") from None
        finally:
            self._idle.put(worker)
        if reply[0] == "raised":
            raise _Failure(f"reward {name!r} raised {reply[1]}: {reply[2]}")
        return reply[1]


class RewardHub:
    """Scores samples with the configured terms, concurrently, in worker threads or processes."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.terms = [_Term(t) for t in cfg.terms]  # imports and checks plugins now, not mid-run
        self._threads: _DaemonPool | None = None
        self._processes: _ProcessPool | None = None
        if cfg.isolation == "process":
            self._processes = _ProcessPool(cfg, self.terms)
        else:
            self._threads = _DaemonPool(cfg.num_workers, "tandem-reward")
        self.error_counts: collections.Counter[str] = collections.Counter()  # message -> failed samples
        self._errors_lock = threading.Lock()

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the live worker processes (process isolation; empty with threads)."""
        return self._processes.worker_pids() if self._processes is not None else []

    def _record_errors(self, failed: dict[int, str]) -> None:
        for message, n in collections.Counter(failed.values()).items():
            with self._errors_lock:
                first = message not in self.error_counts
                self.error_counts[message] += n
                total = self.error_counts[message]
            log.log(logging.WARNING if first else logging.DEBUG, "reward error on %d sample(s) (%d so far): %s",
                    n, total, message)

    def _submit(self, index: int, arg: Any) -> cf.Future:
        if self._processes is not None:
            return self._processes.submit(index, arg)
        return self._threads.submit(_call_sync, self.terms[index].fn, arg)

    def _result(self, fut: cf.Future, term: _Term) -> Any:
        """The call's value; raises `_Timeout`, `_Failure` or the reward's own exception."""
        if self._processes is not None:
            return fut.result()  # the driver bounds the call: timeout_s, then the worker is killed
        if not cf.wait([fut], timeout=self.cfg.timeout_s).done:
            if not fut.cancel() and self._threads.abandon(fut):  # running: leave its thread behind
                n = self._threads.num_abandoned
                log.log(logging.WARNING if n & (n - 1) == 0 else logging.DEBUG,  # at 1, 2, 4, 8, ... of them
                        "reward %r timed out after %ss; its thread keeps running in the background (%d "
                        "abandoned so far, %d still running; daemon threads, they do not keep the process "
                        "from exiting); set reward.isolation: process to make hung rewards killable",
                        term.cfg.name, self.cfg.timeout_s, n, self._threads.num_running_abandoned())
            raise _Timeout
        return fut.result()

    def close(self) -> None:
        """Stop the workers: queued calls are cancelled; worker processes are killed and joined."""
        if self._processes is not None:
            self._processes.close()
        else:
            self._threads.close()

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Set ``reward`` on every sample (FAILED ones get status FAILED); return metrics."""
        t0 = time.perf_counter()
        values: list[dict[str, float]] = [{} for _ in samples]
        failed: dict[int, str] = {}
        n_timeout = 0
        for index, term in enumerate(self.terms):
            live = [i for i in range(len(samples)) if i not in failed]
            futures: list[tuple[list[int], cf.Future]] = []
            if term.batched:
                futures.append((live, self._submit(index, [samples[i] for i in live])))
            else:
                futures += [([i], self._submit(index, samples[i])) for i in live]
            for rows, fut in futures:
                try:
                    out = self._result(fut, term)
                    outs = out if term.batched else [out]
                    if len(outs) != len(rows):
                        raise ValueError(
                            f"batched reward returned {len(outs)} values for {len(rows)} samples"
                        )
                    for i, o in zip(rows, outs, strict=True):
                        values[i][term.key] = _as_float(o)
                except _Timeout:
                    n_timeout += len(rows)
                    for i in rows:
                        failed[i] = f"reward {term.cfg.name!r} timed out after {self.cfg.timeout_s}s"
                except _Failure as e:
                    for i in rows:
                        failed[i] = str(e)
                except Exception as e:  # noqa: BLE001 - a reward bug fails its samples, not the run
                    for i in rows:
                        failed[i] = f"reward {term.cfg.name!r} raised {type(e).__name__}: {e}"
        self._record_errors(failed)
        for i, s in enumerate(samples):
            if i in failed:
                s.status = SampleStatus.FAILED
                s.metadata["reward_error"] = failed[i]
                s.reward = None
                continue
            if len(self.terms) == 1:
                s.reward = values[i][self.terms[0].key]
            else:
                total = sum(t.cfg.weight * values[i][t.key] for t in self.terms)
                s.reward = {"score": total, **values[i]}
        scored = [s.scalar_reward() for i, s in enumerate(samples) if i not in failed]
        metrics = {
            "reward/failed": float(len(failed)),
            "reward/timeout": float(n_timeout),
            "time/reward_s": time.perf_counter() - t0,
        }
        if scored:
            metrics["reward/mean"] = sum(scored) / len(scored)
        for t in self.terms if len(self.terms) > 1 else []:
            vals = [values[i][t.key] for i in range(len(samples)) if i not in failed]
            if vals:
                metrics[f"reward/{t.key}"] = sum(vals) / len(vals)
        return metrics
