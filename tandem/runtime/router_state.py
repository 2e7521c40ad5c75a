"""The `Router`'s book-keeping (tandem/runtime/router.py): its config, its record of each replica and of each
attempt of a request, and the small helpers it calls under and around its lock."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.core.protocols import EngineError, GenerationRequest, GenerationResult
from tandem.runtime.replicas import ReplicaClient, ReplicaDown

log = logging.getLogger("tandem.runtime.router")


@dataclass(kw_only=True, slots=True)
class RouterConfig:
    """How the router spreads requests and handles failing replicas (docs/router.md)."""

    failures_to_quarantine: int = 3  # this many failures within failure_window_s take a replica out
    failure_window_s: float = 60.0
    probe_interval_s: float = 5.0  # a quarantined replica's health() is tried this often
    max_requeues: int = 3  # re-queues of one request after failures, then an ERROR result (deaths: not counted)
    down_probe_interval_s: float = 1.0  # a replica found down (ReplicaDown, a restart) is probed this often
    affinity: bool = True  # a session's turns go to the replica that served its first turn
    wait_timeout_s: float = 300.0  # a request finding no eligible replica waits this long, then raises
    max_sessions: int = 100_000  # affinity entries kept (least recently used dropped first)

    def __post_init__(self) -> None:
        for name, low in (("failures_to_quarantine", 1), ("max_requeues", 0), ("max_sessions", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RouterConfig.{name}={value!r} must be an integer >= {low}")
        for name in ("failure_window_s", "probe_interval_s", "wait_timeout_s", "down_probe_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"RouterConfig.{name}={value!r} must be a number > 0")
        if not isinstance(self.affinity, bool):
            raise ValueError(f"RouterConfig.affinity={self.affinity!r} must be true or false")


class _ReplicaFailed(EngineError):
    """A replica lost a request (its future raised)."""


class _ReplicaRestarted(ReplicaDown):
    """A replica answered with weights older than it held: it restarted (a result of the new instance)."""


@dataclass(eq=False, slots=True)
class _Replica:
    """The router's book on one replica (read and written under `Router._lock`)."""

    client: ReplicaClient
    index: int
    weight_version: int
    instance: Any = None  # the health report's instance_id / instance / pid: a change is a restart
    outstanding: int = 0
    served: int = 0
    tokens: int = 0
    tokens_reported: int = 0  # `tokens` at the last metrics() call
    failures: int = 0
    recent_failures: collections.deque = field(default_factory=collections.deque)
    requeued: int = 0
    quarantined: bool = False
    next_probe: float = 0.0
    resyncing: bool = False
    restarts_seen: int = 0
    last_error: str | None = None
    # held around update_weights and resync, so a resync cannot land after (and undo) a newer update
    weights_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.client.name


@dataclass(eq=False, slots=True)
class _Ticket:
    """One attempt of one request on one replica."""

    request: GenerationRequest
    replica: _Replica
    waiter: asyncio.Future  # on the awaiting loop: the result, or the replica's failure
    version: int  # the replica's weight version when chosen (a result from older weights: it restarted)
    submitted: bool = False


def _resolve(waiter: asyncio.Future, result: GenerationResult | None, error: Exception | None) -> None:
    if not waiter.done():  # done: cancelled, nobody waits
        waiter.set_result(result) if error is None else waiter.set_exception(error)


def _instance(report: dict[str, Any]) -> Any:
    """What identifies one incarnation of a replica in its health report (None: it does not say)."""
    return next((report[k] for k in ("instance_id", "instance", "pid") if report.get(k) is not None), None)


def _each(replicas: list[_Replica], fn: Callable[[_Replica], Any]) -> tuple[dict[int, Any], dict[int, Exception]]:
    """``fn`` on every replica, in parallel threads (remote calls overlap, one that waits for its timeout
    holds up no other): results and errors by replica index."""
    results: dict[int, Any] = {}
    errors: dict[int, Exception] = {}

    def call(replica: _Replica) -> None:
        try:
            results[replica.index] = fn(replica)
        except Exception as e:  # noqa: BLE001 - collected; the caller decides
            errors[replica.index] = e

    if len(replicas) == 1:
        call(replicas[0])
    elif replicas:
        with concurrent.futures.ThreadPoolExecutor(len(replicas)) as pool:
            list(pool.map(call, replicas))
    return results, dict(sorted(errors.items()))


def _locked(lock: threading.Lock, fn: Callable, *args: Any) -> Any:
    with lock:
        return fn(*args)


def _quietly(replica: _Replica, fn: Callable[[], Any]) -> Any:
    """Call a best-effort method on a replica that may be gone; None if it raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a dead replica must not stop abort_all / close / health
        log.warning("replica %s: %s failed: %s", replica.name, getattr(fn, "__name__", "call"), e)
        return None
