"""`Router`: one `InferenceEngine` in front of N inference replicas (docs/router.md).

With N replicas the loop's engine is a `Router`. A request goes to the replica with the fewest outstanding
requests (ties: round-robin), a session's turns to one replica; the requests one event-loop turn sends to
a replica leave in one ``submit`` (they join one engine step). A request whose replica fails is re-queued
elsewhere; a replica failing repeatedly is quarantined and probed back; no request goes to a replica whose
weights are older than ``min_version``. Replicas are reached through `ReplicaClient` (no Ray here):
`LocalReplica` wraps an in-process engine, a Ray client an actor handle.

    router = Router([LocalReplica(e, name=f"r{i}") for i, e in enumerate(engines)], info=engines[0].info)
    results = router.generate(requests)  # or: await router.agenerate(request) from any event loop

The router is used from several threads and event loops over its life (``asyncio.run`` per step in sync
mode, a long-lived producer loop in fully-async mode): its state sits behind one ``threading.Lock``,
nothing is bound to a loop, and a monitor thread does the blocking work (probes, the ``resync`` callback).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tandem.core.aio import run_blocking
from tandem.core.protocols import (
    EngineAsleepError,
    EngineClosedError,
    EngineError,
    EngineInfo,
    GenerationRequest,
    GenerationResult,
    NamedTensors,
)
from tandem.runtime.replicas import (
    LocalReplica,
    ReplicaClient,
    ReplicaDown,
    ReplicaFuture,
    abort_result,
    error_result,
)
from tandem.runtime.router_state import (
    RouterConfig,
    _each,
    _instance,
    _locked,
    _quietly,
    _Replica,
    _ReplicaFailed,
    _ReplicaRestarted,
    _resolve,
    _Ticket,
)

__all__ = ["LocalReplica", "ReplicaClient", "ReplicaDown", "ReplicaFuture", "Router", "RouterConfig"]  # clients: replicas.py

log = logging.getLogger(__name__)

_WAIT_POLL_S = 0.005  # how often a request waiting for an eligible replica looks again
_MONITOR_IDLE_S = 0.5  # the monitor's longest sleep (it also wakes on quarantine, min_version, waiting)
_HEALTH_TOTALS = ("running", "waiting", "generated_tokens", "prompt_tokens_computed", "steps", "spec_passes",
                  "spec_drafted", "spec_accepted", "spec_emitted")


class Router:
    """An `InferenceEngine` spreading requests over replicas (module docstring, docs/router.md).

    ``info``: the replicas' engine's `EngineInfo`; the router's own drops ``can_score``,
    ``exposes_weights`` and ``lora_adapters`` (their methods are not routed). ``resync(client, version)``
    brings a replica to ``version`` (blocking; called on the monitor thread) before a replica below
    ``min_version`` takes traffic again; without it such a replica is skipped.
    """

    def __init__(self, replicas: Sequence[ReplicaClient], *, info: EngineInfo, config: RouterConfig | None = None,
                 resync: Callable[[ReplicaClient, int], None] | None = None) -> None:
        names = [r.name for r in replicas]
        if not replicas or len(set(names)) != len(names):
            raise ValueError(f"Router needs at least one replica, each with its own name; got {names}")
        self.config = config or RouterConfig()
        self._info = dataclasses.replace(info, can_score=False, exposes_weights=False, lora_adapters=False)
        self._resync = resync
        self._lock = threading.Lock()
        self._replicas = [_Replica(client=c, index=i, weight_version=c.weight_version()) for i, c in enumerate(replicas)]
        for replica in self._replicas:
            replica.instance = _instance(replica.client.health())
        self._latest_version = max(r.weight_version for r in self._replicas)
        self._min_version = 0
        self._sessions: collections.OrderedDict[str, _Replica] = collections.OrderedDict()
        self._active: dict[str, _Ticket | None] = {}  # request id -> its attempt (None: choosing a replica)
        self._aborted: set[str] = set()
        self._pending: dict[asyncio.AbstractEventLoop, list[_Ticket]] = {}  # submitted at the end of the turn
        self._cursor = 0  # round-robin among equally loaded replicas
        self._requeued = 0
        self._sleeping = self._closed = False
        self._metrics_at = time.monotonic()
        self._wake = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="tandem-router-monitor", daemon=True)
        self._monitor.start()

    # -- the InferenceEngine protocol ---------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def weight_version(self) -> int:
        """The oldest weights a request may be served with now: the minimum over replicas in rotation."""
        with self._lock:
            return self._weight_version()

    def _weight_version(self) -> int:
        live = [r for r in self._replicas if not r.quarantined] or self._replicas
        return min(r.weight_version for r in live)

    @property
    def min_version(self) -> int:
        """No request goes to a replica whose weight version is below this (the run's staleness bound)."""
        return self._min_version

    @min_version.setter
    def min_version(self, version: int) -> None:
        self._min_version = int(version)
        self._wake.set()  # stale replicas get re-synced now

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking generation, results in request order (the agenerates run on a private loop)."""
        self._refuse_if_unable()

        async def run_all() -> list[GenerationResult]:
            return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run_blocking(run_all())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from a loop: run beside it
            return pool.submit(run_blocking, run_all()).result()

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Generate on the least loaded eligible replica; re-queue it if that replica fails.

        Cancelling the awaiting task aborts the request on its replica.
        """
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"requests must be GenerationRequest objects, got {type(request).__name__}")
        self._refuse_if_unable()
        request_id = request.request_id
        with self._lock:
            if request_id in self._active:
                return error_result(request, f"request_id {request_id!r} is already in flight")
            self._active[request_id] = None
        try:
            return await self._serve(request)
        finally:
            with self._lock:
                self._active.pop(request_id, None)
                self._aborted.discard(request_id)

    async def _serve(self, request: GenerationRequest) -> GenerationResult:
        tried: list[str] = []
        down = 0  # of the tries, replicas that died or restarted holding it
        while True:
            replica = await self._choose(request, tried)
            if replica is None:
                return abort_result(request)
            ticket = self._enqueue(request, replica)
            try:
                return await ticket.waiter
            except asyncio.CancelledError:
                self._cancel(ticket)
                raise
            except Exception as e:  # noqa: BLE001 - the replica failed while holding it: re-queue
                tried.append(replica.name)
                if isinstance(e, ReplicaDown):  # a death, not this request's fault: it waits for a live one
                    down += 1
                with self._lock:
                    if request.request_id in self._aborted:
                        return abort_result(request)
                    if len(tried) - down > self.config.max_requeues:
                        return error_result(request, f"request failed on replicas {', '.join(tried)} "
                                                      f"(max_requeues={self.config.max_requeues}); last error: {e}")
                    replica.requeued += 1
                    self._requeued += 1
                log.warning("request %s failed on replica %s (%s); re-queued", request.request_id, replica.name, e)

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is: on its replica, about to be submitted, or waiting for one."""
        with self._lock:
            if request_id not in self._active:
                return
            self._aborted.add(request_id)
            ticket = self._active[request_id]
            holder = ticket.replica if ticket is not None and ticket.submitted else None
        if holder is not None:  # otherwise _flush / _choose sees it in _aborted
            holder.client.abort([request_id])

    def abort_all(self) -> None:
        with self._lock:
            self._aborted.update(self._active)
        for replica in self._replicas:
            _quietly(replica, replica.client.abort_all)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Every replica in rotation gets these weights (in parallel). A replica that fails is
        quarantined (the resync callback brings it back); if all fail, the first error is raised."""
        items = list(named_tensors)
        targets = self._live()
        _, errors = _each(targets, lambda r: _locked(r.weights_lock, r.client.update_weights, items, version))
        if targets and len(errors) == len(targets):
            raise next(iter(errors.values()))
        with self._lock:
            self._latest_version = max(self._latest_version, int(version))
            for replica in targets:
                if replica.index in errors:
                    self._record_failure(replica, errors[replica.index], quarantine=True)
                else:
                    replica.weight_version = int(version)

    def note_weight_version(self, name: str, version: int) -> None:
        """Record that replica ``name`` now holds ``version``: for a weight sync that reaches the replicas
        outside `update_weights` (e.g. through the object store), before raising ``min_version``."""
        with self._lock:
            replica = next((r for r in self._replicas if r.name == name), None)
            if replica is None:
                raise ValueError(f"no replica named {name!r}; replicas: {[r.name for r in self._replicas]}")
            replica.weight_version = int(version)
            self._latest_version = max(self._latest_version, int(version))

    def sleep(self) -> None:
        with self._lock:
            busy = len(self._active)
        if busy:
            raise EngineAsleepError(f"sleep() with {busy} request(s) in flight: finish or abort them first")
        self._raise_first(_each(self._live(), lambda r: r.client.sleep())[1])
        self._sleeping = True

    def wake_up(self) -> None:
        self._raise_first(_each(self._live(), lambda r: r.client.wake_up())[1])
        self._sleeping = False

    def health(self) -> dict[str, Any]:
        """The router's view of every replica, with each live replica's own health report (``engine``)
        and their counters summed (``running``, ``generated_tokens``, ...)."""
        with self._lock:
            rows = [self._row(r) for r in self._replicas]
            version, in_rotation = self._weight_version(), sum(not r.quarantined for r in self._replicas)
            requeued = self._requeued
        engines, _ = _each([r for r in self._replicas if not rows[r.index]["quarantined"]], lambda r: r.client.health())
        for row, replica in zip(rows, self._replicas, strict=True):
            row["engine"] = engines.get(replica.index)  # None: quarantined, or its health() failed
        reports = [report for report in engines.values() if isinstance(report, dict)]
        totals = {k: sum(int(report.get(k) or 0) for report in reports) for k in _HEALTH_TOTALS}
        status = ("closed" if self._closed else "sleeping" if self._sleeping
                  else "ok" if in_rotation else "unavailable")
        return {"status": status, "weight_version": version, "min_version": self._min_version,
                "num_replicas": len(rows), "in_rotation": in_rotation, "requeued": requeued, **totals,
                "replicas": rows}

    def metrics(self) -> dict[str, float]:
        """Flat metrics for the loop's tracker; ``tokens_per_s`` covers the time since the last call."""
        now = time.monotonic()
        with self._lock:
            elapsed, self._metrics_at = max(now - self._metrics_at, 1e-9), now
            out: dict[str, float] = {}
            for r in self._replicas:
                prefix = f"router/{r.name}/"
                out[prefix + "tokens_per_s"] = (r.tokens - r.tokens_reported) / elapsed
                r.tokens_reported = r.tokens
                for key in ("outstanding", "served", "failures", "requeued", "restarts_seen", "weight_version"):
                    out[prefix + key] = float(getattr(r, key))
                out[prefix + "quarantined"] = float(r.quarantined)
            out["router/requeued"] = float(self._requeued)
            out["router/quarantined"] = float(sum(r.quarantined for r in self._replicas))
            out["router/restarts_seen"] = float(sum(r.restarts_seen for r in self._replicas))
            out["router/weight_version"] = float(self._weight_version())
        return out

    def close(self) -> None:
        """Stop the monitor and close every replica (in-flight requests end as their replica ends them)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._monitor.join(timeout=60)
        for replica in self._replicas:
            _quietly(replica, replica.client.close)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- choosing and submitting ----------------------------------------------------------------------------

    def _refuse_if_unable(self) -> None:
        if self._closed:
            raise EngineClosedError("the router is closed")
        if self._sleeping:
            raise EngineAsleepError("the engine is asleep: call wake_up() before generating")

    async def _choose(self, request: GenerationRequest, tried: list[str]) -> _Replica | None:
        """An eligible replica (its outstanding count already raised), waiting up to ``wait_timeout_s``
        for one; None if the request was aborted meanwhile."""
        deadline, waited = time.monotonic() + self.config.wait_timeout_s, False
        while True:
            self._refuse_if_unable()
            with self._lock:
                if request.request_id in self._aborted:
                    return None
                replica = self._pick(request, tried)
                if replica is not None:
                    replica.outstanding += 1  # the next choice in this loop turn sees it
                    return replica
                why = "; ".join(self._unavailable(r) for r in self._replicas)
            if time.monotonic() > deadline:
                raise EngineError(f"no replica could take request {request.request_id!r} within "
                                  f"wait_timeout_s={self.config.wait_timeout_s}: {why}")
            if not waited:  # the monitor looks at stale replicas now, not at its next tick
                self._wake.set()
                waited = True
            await asyncio.sleep(_WAIT_POLL_S)

    def _eligible(self, r: _Replica) -> bool:
        return not r.quarantined and not r.resyncing and r.weight_version >= self._min_version

    def _unavailable(self, r: _Replica) -> str:
        if r.quarantined:
            return f"{r.name} quarantined (last error: {r.last_error})"
        if r.weight_version < self._min_version:
            action = "re-syncing" if self._resync else "no resync callback"
            return f"{r.name} at weight version {r.weight_version} < min_version {self._min_version} ({action})"
        return f"{r.name} {'re-syncing' if r.resyncing else 'available'}"

    def _pick(self, request: GenerationRequest, tried: list[str]) -> _Replica | None:
        """Least outstanding requests, round-robin among ties; a session's home while it is eligible;
        replicas this request already failed on only when no other is eligible (lock held)."""
        eligible = [r for r in self._replicas if self._eligible(r)]
        if not eligible:
            return None
        session = request.session_id if self.config.affinity else None
        home = self._sessions.get(session) if session is not None else None
        if home is not None and home in eligible and home.name not in tried:
            self._sessions.move_to_end(session)
            return home
        fresh = [r for r in eligible if r.name not in tried] or eligible
        low = min(r.outstanding for r in fresh)
        count = len(self._replicas)
        best = min((r for r in fresh if r.outstanding == low), key=lambda r: (r.index - self._cursor) % count)
        self._cursor = best.index + 1
        if session is not None:
            self._sessions[session] = best
            self._sessions.move_to_end(session)
            if len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        return best

    def _enqueue(self, request: GenerationRequest, replica: _Replica) -> _Ticket:
        """Queue the request for its replica; the first request of this loop turn schedules the flush,
        so every request the turn sends to one replica goes in one ``submit`` (one engine step)."""
        loop = asyncio.get_running_loop()
        ticket = _Ticket(request=request, replica=replica, waiter=loop.create_future(), version=replica.weight_version)
        with self._lock:
            self._active[request.request_id] = ticket
            batch = self._pending.setdefault(loop, [])
            batch.append(ticket)
            first = len(batch) == 1
        if first:
            loop.call_soon(self._flush, loop)
        return ticket

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            tickets = self._pending.pop(loop, [])
            live = [t for t in tickets if not t.waiter.done()]  # a cancelled one never leaves
            for t in tickets:
                if t.waiter.done():
                    t.replica.outstanding -= 1
                t.submitted = True
        by_replica: dict[int, list[_Ticket]] = {}
        for t in live:
            by_replica.setdefault(t.replica.index, []).append(t)
        for group in by_replica.values():
            self._submit(group[0].replica, group)

    def _submit(self, replica: _Replica, tickets: list[_Ticket]) -> None:
        try:
            futures = replica.client.submit([t.request for t in tickets])
            if len(futures) != len(tickets):
                raise _ReplicaFailed(f"submit returned {len(futures)} futures for {len(tickets)} requests")
        except Exception as e:  # noqa: BLE001 - a replica that cannot take requests failed them all
            for t in tickets:
                self._settle(t, None, e)
            return
        for ticket, future in zip(tickets, futures, strict=True):
            future.add_done_callback(functools.partial(self._on_done, ticket))
        with self._lock:
            aborted = [t.request.request_id for t in tickets if t.request.request_id in self._aborted]
        if aborted:  # aborted between the choice and the submit
            replica.client.abort(aborted)

    def _on_done(self, ticket: _Ticket, future: ReplicaFuture) -> None:
        """The replica finished with the request (any thread)."""
        try:
            result, error = future.result(), None
        except BaseException as e:  # noqa: BLE001 - CancelledError included: the replica lost it
            result, error = None, e if isinstance(e, Exception) else _ReplicaFailed(f"replica future {e!r}")
        self._settle(ticket, result, error)

    def _settle(self, ticket: _Ticket, result: GenerationResult | None, error: Exception | None) -> None:
        replica = ticket.replica
        with self._lock:
            replica.outstanding -= 1
            if error is None:
                error = self._check_versions(ticket, result)
            if error is None:
                replica.served += 1
                replica.tokens += sum(len(c.token_ids) for c in result.completions)
            else:
                self._record_failure(replica, error, down=isinstance(error, ReplicaDown))
        try:
            ticket.waiter.get_loop().call_soon_threadsafe(_resolve, ticket.waiter, result, error)
        except RuntimeError:  # the awaiting loop is gone: nobody waits for it
            pass

    def _check_versions(self, ticket: _Ticket, result: GenerationResult) -> Exception | None:
        """Learn the replica's version from a result. Tokens from weights older than the replica held when
        chosen mean it restarted (initial weights): counted, and below ``min_version`` the result is
        discarded and the request re-queued (lock held)."""
        versions = [v for c in result.completions for v in c.weight_versions]
        if not versions:
            return None
        replica = ticket.replica
        if min(versions) >= ticket.version:
            replica.weight_version = max(replica.weight_version, max(versions))
            return None
        replica.restarts_seen += int(replica.weight_version > min(versions))  # once per restart
        replica.weight_version, replica.instance = min(versions), None  # the probe learns the new instance
        self._wake.set()
        if min(versions) >= self._min_version:
            return None
        return _ReplicaRestarted(f"replica {replica.name} served weight version {min(versions)} after being at "
                                 f"{ticket.version}: it restarted")

    def _cancel(self, ticket: _Ticket) -> None:
        """The awaiting task was cancelled: abort the request on its replica (or it is never submitted)."""
        with self._lock:
            submitted = ticket.submitted
        if submitted:
            ticket.replica.client.abort([ticket.request.request_id])

    # -- failures, probes, re-syncs ---------------------------------------------------------------------------

    def _record_failure(self, replica: _Replica, error: BaseException, *, quarantine: bool = False,
                        down: bool = False) -> None:
        """Count a failure; the ``failures_to_quarantine``-th within the window quarantines, a replica
        found down (``down``) at once, probed back sooner (lock held)."""
        now = time.monotonic()
        replica.failures += 1
        replica.last_error = f"{type(error).__name__}: {error}"
        window = replica.recent_failures
        window.append(now)
        while window and window[0] < now - self.config.failure_window_s:
            window.popleft()
        if not replica.quarantined and (quarantine or down or len(window) >= self.config.failures_to_quarantine):
            replica.quarantined = True
            replica.next_probe = now + (self.config.down_probe_interval_s if down else self.config.probe_interval_s)
            window.clear()
            log.warning("replica %s quarantined: %s", replica.name, replica.last_error)
            self._wake.set()

    def _monitor_loop(self) -> None:
        """Probe quarantined replicas when due; bring replicas below ``min_version`` up to date."""
        while not self._closed:
            self._wake.wait(timeout=self._next_wake())
            self._wake.clear()
            if self._closed:
                return
            now = time.monotonic()
            with self._lock:
                due = [r for r in self._replicas if r.quarantined and r.next_probe <= now]
                behind = [r for r in self._replicas if not r.quarantined and r.weight_version < self._min_version]
            for work, replicas in ((self._probe, due), (self._catch_up, behind)):  # each in parallel
                for index, error in _each(replicas, work)[1].items():
                    log.error("router monitor: %s(%s) failed: %r", work.__name__, self._replicas[index].name, error)

    def _next_wake(self) -> float:
        with self._lock:
            probes = [r.next_probe for r in self._replicas if r.quarantined]
        return max(0.0, min([_MONITOR_IDLE_S, *(p - time.monotonic() for p in probes)]))

    def _probe(self, replica: _Replica) -> None:
        """A quarantined replica answering ``health()`` again returns to rotation, re-synced first if it is
        below ``min_version`` (without a resync callback it returns and is skipped until it catches up)."""
        try:
            report = replica.client.health()
            version = replica.client.weight_version()
            if report.get("status") not in ("ok", "sleeping"):
                raise _ReplicaFailed(f"health status {report.get('status')!r}")
        except Exception as e:  # noqa: BLE001 - still down: try again later
            with self._lock:
                replica.last_error = f"probe: {type(e).__name__}: {e}"
                replica.next_probe = time.monotonic() + self.config.probe_interval_s
            return
        with self._lock:
            instance = _instance(report)
            restarted = version < replica.weight_version or (
                None not in (instance, replica.instance) and instance != replica.instance)
            replica.restarts_seen += int(restarted)
            replica.instance, replica.weight_version = instance, version
        if version < self._min_version and self._resync is not None and not self._catch_up(replica):
            with self._lock:
                replica.next_probe = time.monotonic() + self.config.probe_interval_s
            return
        with self._lock:
            replica.quarantined = False
            replica.recent_failures.clear()
        log.info("replica %s back in rotation at weight version %d", replica.name, replica.weight_version)

    def _catch_up(self, replica: _Replica) -> bool:
        """Bring a replica below ``min_version`` to the newest version via ``resync``; whether it is
        now eligible by version. A failed resync quarantines it (the probe retries)."""
        try:
            with replica.weights_lock:
                version = self._resync_if_behind(replica)
        except Exception as e:  # noqa: BLE001 - kept out of rotation until a probe succeeds
            with self._lock:
                self._record_failure(replica, e, quarantine=True)
            return False
        finally:
            with self._lock:
                replica.resyncing = False
        with self._lock:
            replica.weight_version = version
        return version >= self._min_version

    def _resync_if_behind(self, replica: _Replica) -> int:
        """The replica's version, after a resync to the newest version if it is below ``min_version``."""
        version = replica.client.weight_version()  # an update may have landed (through us or not)
        if version < self._min_version and self._resync is not None:
            with self._lock:
                replica.resyncing = True
            target = max(self._min_version, self._latest_version)
            log.info("re-syncing replica %s from weight version %d to %d", replica.name, version, target)
            self._resync(replica.client, target)
            version = replica.client.weight_version()
        return version

    # -- small helpers ------------------------------------------------------------------------------------------

    def _live(self) -> list[_Replica]:
        with self._lock:
            return [r for r in self._replicas if not r.quarantined]

    @staticmethod
    def _raise_first(errors: dict[int, Exception]) -> None:
        if errors:
            raise next(iter(errors.values()))

    def _row(self, r: _Replica) -> dict[str, Any]:
        return {"name": r.name, "outstanding": r.outstanding, "served": r.served, "tokens": r.tokens,
                "failures": r.failures, "requeued": r.requeued, "quarantined": r.quarantined,
                "restarts_seen": r.restarts_seen, "weight_version": r.weight_version, "last_error": r.last_error}
