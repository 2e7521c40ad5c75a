"""Inference replicas as the router sees them: the `ReplicaClient` interface and `LocalReplica`.

A `ReplicaClient` is one replica (a Ray actor, an engine process, an engine in this process) reached by
the `tandem.runtime.router.Router`; see docs/router.md for the threading and event-loop rules every
client meets. `LocalReplica` runs an in-process engine on a private event loop in its own thread, so the
requests of one ``submit`` join one engine step whichever thread or loop called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from tandem.core.protocols import (
    Completion,
    EngineClosedError,
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    NamedTensors,
    SamplingParams,
)

__all__ = ["LocalReplica", "ReplicaClient", "ReplicaDown", "ReplicaFuture", "abort_result", "error_result"]

ReplicaFuture = concurrent.futures.Future | asyncio.Future


class ReplicaDown(EngineError):
    """The replica is dead or restarting (not: it refused the request). A client's futures raise it for
    the requests such a replica held; the router takes the replica out of rotation at once, re-queues
    them without spending their ``max_requeues``, and probes the replica back."""


@runtime_checkable
class ReplicaClient(Protocol):
    """One inference replica as the router sees it. Threading rules (docs/router.md has the details):

    - ``submit``: called on the event-loop thread of the caller of `Router.agenerate` (any loop, any thread),
      from a ``loop.call_soon`` callback. Must not block: start the requests together (one engine step) and
      return one future per request, in order: a ``concurrent.futures.Future`` or an ``asyncio.Future`` of
      the calling loop, resolving to the `GenerationResult` (a bad request is an ERROR result) and raising
      only if the replica failed or died holding the request. ``submit`` raising fails every request.
    - ``abort``/``abort_all``: any thread, event-loop threads included; fire and forget. An abort after the
      ``submit`` of the same id must reach it even if not started yet (it resolves as ABORT).
    - ``health``/``weight_version``: the monitor thread and `Router.health`; raise (better: time out) when
      unreachable. A change of the report's ``instance_id``, ``instance`` or ``pid`` is a restart.
    - ``update_weights``/``sleep``/``wake_up``/``close``: block until done, from a router worker thread.
    """

    name: str

    def submit(self, requests: list[GenerationRequest]) -> list[ReplicaFuture]: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def abort_all(self) -> None: ...
    def health(self) -> dict[str, Any]: ...
    def weight_version(self) -> int: ...
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def close(self) -> None: ...


def abort_result(request: GenerationRequest) -> GenerationResult:
    """What an engine returns for a request aborted before it produced a token (one per sample)."""
    n = request.sampling.n if isinstance(request.sampling, SamplingParams) else 1
    empty = [Completion(token_ids=[], log_probs=[], finish_reason=FinishReason.ABORT) for _ in range(max(1, n))]
    return GenerationResult(request_id=request.request_id, prompt_token_ids=_prompt(request), completions=empty)


def error_result(request: GenerationRequest, message: str) -> GenerationResult:
    """A request-level ERROR result naming ``message``."""
    completion = Completion(token_ids=[], log_probs=[], finish_reason=FinishReason.ERROR, error=message)
    return GenerationResult(request_id=request.request_id, prompt_token_ids=_prompt(request),
                            completions=[completion], error=message)


def _prompt(request: GenerationRequest) -> list[int]:
    ids = request.prompt_token_ids
    return list(ids) if isinstance(ids, list | tuple) else []


class LocalReplica:
    """A `ReplicaClient` over an in-process engine, with its own event loop in its own thread.

    Why a private loop: an engine's ``agenerate`` steps the batch on the loop that awaits it, while the
    router's callers come and go on different loops and threads. One loop per replica gives the engine
    one driver whoever calls, lets N replicas step in parallel as N actors would, and makes ``submit``
    safe from any thread: it hands the requests to the replica loop in one callback, which starts them
    in the same loop turn, so they join one engine step.
    """

    def __init__(self, engine: InferenceEngine, *, name: str = "local") -> None:
        self.engine = engine
        self.name = name
        self._queued: dict[str, GenerationRequest] = {}  # handed over, not yet in the engine (loop thread)
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tandem-replica-{name}", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, requests: list[GenerationRequest]) -> list[ReplicaFuture]:
        if self._closed:
            raise EngineClosedError(f"replica {self.name} is closed")
        futures = [concurrent.futures.Future() for _ in requests]
        self._loop.call_soon_threadsafe(self._start, list(requests), futures)
        return futures

    def _start(self, requests: list[GenerationRequest], futures: list[concurrent.futures.Future]) -> None:
        for request, future in zip(requests, futures, strict=True):
            self._queued[request.request_id] = request
            task = self._loop.create_task(self._run(request, future))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, request: GenerationRequest, future: concurrent.futures.Future) -> None:
        try:
            if self._queued.pop(request.request_id, None) is None:  # aborted before it reached the engine
                result = abort_result(request)
            else:  # no await between the check above and the engine taking the request
                result = await self.engine.agenerate(request)
        except asyncio.CancelledError:  # close() ended it
            future.set_exception(EngineClosedError(f"replica {self.name} closed"))
            raise
        except Exception as e:  # noqa: BLE001 - the router sees it as this replica failing
            future.set_exception(e)
        else:
            future.set_result(result)

    def abort(self, request_ids: list[str]) -> None:
        self._call_soon(self._abort, list(request_ids))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._queued.pop(request_id, None) is None:
                self.engine.abort(request_id)

    def abort_all(self) -> None:
        self._call_soon(self._abort_all)

    def _abort_all(self) -> None:
        self._queued.clear()
        self.engine.abort_all()

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        """Close the engine (in-flight requests resolve as ABORT), then stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        asyncio.run_coroutine_threadsafe(self._cancel_tasks(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._loop.close()

    async def _cancel_tasks(self) -> None:
        """Let requests the engine just aborted deliver their results, then end every task on the loop
        (the engine's driver included)."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)
        others = asyncio.all_tasks() - {asyncio.current_task()}
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
