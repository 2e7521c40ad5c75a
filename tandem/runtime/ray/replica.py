"""Inference replicas as Ray actors: `EngineReplica` (the actor) and `RayReplicaClient` (the router's view).

An `EngineReplica` is an async actor hosting the engine server code of the separate placement
(`tandem.runtime.engine_server.EngineServer`), so it serves any registered engine. Its event loop drives
the engine: ``submit`` starts a list of requests in one call, so they join one engine step (batch
composition changes the numerics), and ``result`` awaits one of them. Weight updates arrive as object
refs of flat buckets (``receive_weights``, `tandem.sync.ray_store`) and land between two engine steps.

Ray restarts a replica that dies (``ray.max_replica_restarts``); the new instance starts from the model
files at version 0 and reports a new ``instance`` id, so the router re-syncs it to the run's version
before it takes traffic again. Requests it held fail on the driver side (``RayActorError``) and the
router re-queues them on another replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tandem.core.protocols import GenerationRequest, GenerationResult, NamedTensors
from tandem.engines.registry import EngineSpec
from tandem.runtime.ray import import_ray
from tandem.runtime.replicas import ReplicaDown

__all__ = ["EngineReplica", "RayReplicaClient", "make_replica"]


class EngineReplica:
    """The actor (decorated by `make_replica`). ``spec`` builds the engine; ``threads``: torch intra-op threads."""

    def __init__(self, spec: EngineSpec, index: int, threads: int) -> None:
        from tandem.runtime.engine_server import EngineServer

        torch.set_num_threads(threads)
        self.index, self.instance = index, uuid.uuid4().hex[:12]
        self.server = EngineServer(spec.build())
        self.engine = self.server.engine
        # request id -> a future of its generation task (set by submit; result may arrive first: Ray does
        # not order the calls of an async actor)
        self._running: dict[str, asyncio.Future] = {}

    def _slot(self, request_id: str) -> asyncio.Future:
        slot = self._running.get(request_id)
        if slot is None:
            slot = self._running[request_id] = asyncio.get_running_loop().create_future()
        return slot

    async def submit(self, requests: list[GenerationRequest]) -> None:
        """Start every request now, in this one turn of the actor's loop (one engine step)."""
        for r in requests:
            slot = self._slot(r.request_id)
            if slot.done():
                raise ValueError(f"request_id {r.request_id!r} is already running on replica {self.index}")
            slot.set_result(asyncio.ensure_future(self.engine.agenerate(r)))

    async def result(self, request_id: str) -> GenerationResult:
        """The result of a submitted request (waits for its submit if that call has not run yet)."""
        slot = self._slot(request_id)
        try:
            task = await slot
            return await asyncio.shield(task)
        finally:
            if slot.done() and slot.result().done():
                self._running.pop(request_id, None)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One of the engine server's allowlisted methods (abort, sleep, health, update_weights, ...)."""
        return await self.server.handle(method, *args, **kwargs)

    async def receive_weights(self, wrapped_refs: list[list[Any]], headers: list[str], version: int,
                              verify: bool = False) -> dict[str, Any]:
        """Fetch (zero-copy on this node), check and apply one whole update between two engine steps."""
        from tandem.sync.apply import WeightApplier, call_apply
        from tandem.sync.base import BucketHeader, unflatten_bucket

        arrays = await asyncio.gather(*wrapped_refs[0])
        named = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only shared memory: only read
            for arr, h in zip(arrays, headers, strict=True):
                named += list(unflatten_bucket(torch.from_numpy(arr), BucketHeader.from_json(h)))
        report = call_apply(WeightApplier(self.engine), named, version, verify=verify)
        return {"version": version, "report": report, "instance": self.instance}

    def health(self) -> dict[str, Any]:
        ray = import_ray()
        return self.engine.health() | {"instance": self.instance, "pid": os.getpid(), "replica": self.index,
                                        "node": ray.get_runtime_context().get_node_id(),
                                        "requests_held": len(self._running)}

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def info(self):
        return self.engine.info

    def close(self) -> None:
        self.server.shutdown()


def make_replica(max_restarts: int) -> Any:
    """The Ray actor class of `EngineReplica` (many concurrent calls: every request awaits on its loop)."""
    ray = import_ray()
    return ray.remote(max_restarts=max_restarts, max_task_retries=0, max_concurrency=10_000)(EngineReplica)


class RayReplicaClient:
    """One replica actor as the router sees it (`tandem.runtime.router.ReplicaClient`).

    Thread- and loop-agnostic: every call returns Ray futures (``concurrent.futures.Future``) or blocks
    on Ray, so the router may call it from any thread and any event loop.
    """

    def __init__(self, handle: Any, name: str, *, call_timeout_s: float = 60.0) -> None:
        self.ray = import_ray()
        self.handle, self.name, self.call_timeout_s = handle, name, call_timeout_s

    def submit(self, requests: Sequence[GenerationRequest]) -> list[cf.Future]:
        """Non-blocking: one ``submit`` call starts them together; each ``result`` call awaits one (the
        actor waits for the submit if that arrives second). A dead or restarting actor fails them as
        `ReplicaDown`."""
        started = self.handle.submit.remote(list(requests))
        return [_chain(started, self.handle.result.remote(r.request_id), self.name) for r in requests]

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.handle.call.remote("abort", rid)

    def abort_all(self) -> None:
        self.handle.call.remote("abort_all")  # fire and forget: a dead replica holds nothing to abort

    def health(self) -> dict[str, Any]:
        return self._get(self.handle.health.remote())

    def weight_version(self) -> int:
        return int(self._get(self.handle.weight_version.remote()))

    def sleep(self) -> None:
        self._get(self.handle.call.remote("sleep"))

    def wake_up(self) -> None:
        self._get(self.handle.call.remote("wake_up"))

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Through the object store, as a run's sync does (the tensors are put once, here)."""
        from tandem.sync.base import bucketize, flatten_bucket

        refs, headers = [], []
        for bucket in bucketize(named_tensors, 256 * 1024 * 1024):
            flat, header = flatten_bucket(bucket)
            refs.append(self.ray.put(flat.numpy()))
            headers.append(header.to_json())
        self.receive(refs, headers, version)

    def receive(self, refs: list[Any], headers: list[str], version: int, *, verify: bool = False,
                timeout_s: float | None = None) -> dict[str, Any]:
        return self._get(self.handle.receive_weights.remote([refs], headers, version, verify),
                         timeout_s=timeout_s)

    def close(self) -> None:
        try:
            self._get(self.handle.close.remote(), timeout_s=10)
        except Exception:  # noqa: BLE001 - a dead replica has nothing left to close
            pass
        self.ray.kill(self.handle, no_restart=True)

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        return self.ray.get(ref, timeout=timeout_s or self.call_timeout_s)


def _chain(first: Any, second: Any, name: str) -> cf.Future:
    """``second``'s result as a future that fails if ``first`` (the submit) failed; an actor that died or
    is restarting becomes `ReplicaDown`."""
    ray = import_ray()
    out: cf.Future = cf.Future()
    second_future = second.future()
    first_future = first.future()

    def done(_f: cf.Future) -> None:
        if out.done():
            return
        for f in (first_future, second_future):
            if f.done() and f.exception() is not None:
                error = f.exception()
                if isinstance(error, ray.exceptions.RayActorError):
                    error = ReplicaDown(f"replica {name} is down: {type(error).__name__}")
                try:
                    out.set_exception(error)
                except cf.InvalidStateError:
                    pass
                return
        if second_future.done():
            try:
                out.set_result(second_future.result())
            except cf.InvalidStateError:
                pass

    first_future.add_done_callback(done)
    second_future.add_done_callback(done)
    return out
