"""The engine side of the separate placement: `EngineSpec`, `EngineServer` and the engine process's main.

`EngineSpec` (tandem.engines.registry) names what to build (an import path and that engine's own
config: it imports neither the trainer nor the run config). `EngineServer` holds the engine and, with a sync config, an
`EngineReceiver` thread that takes weight updates from the sync transport (broadcast or disk) and
applies them between two engine steps; ``await server.handle(method, *args)`` runs one of its
allowlisted methods. Neither depends on how calls arrive: `engine_process_main` serves them over the
pipe of a `RemoteEngine`, and a Ray actor can host an `EngineServer` and expose ``handle`` instead.

The process runs one asyncio loop that drives the engine (the embedded engine has no thread of its
own); a blocking ``generate`` becomes concurrent ``agenerate``s there, so an ``abort_all`` or
``health`` from another trainer thread is served between two engine steps.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from tandem.core.protocols import GenerationRequest, GenerationResult, LoRAEngine, ScoringEngine
from tandem.engines.registry import EngineSpec
from tandem.runtime.engine_wire import (
    CONTROL,
    ERROR,
    FATAL,
    MANY,
    OK,
    READY,
    UndecodableFrame,
    decode,
    encode,
    error_payload,
)
from tandem.sync.base import (
    BucketHeader,
    SyncConfig,
    bucketize,
    flatten_bucket,
    tensor_hashes,
    unflatten_bucket,
)

__all__ = ["EngineServer", "EngineSpec", "engine_process_main"]


class EngineServer:
    """An engine and its sync receiver, behind an allowlist of methods (``await handle(name, ...)``).

    Runs in the engine's process, on the asyncio loop that drives the engine.
    """

    METHODS = ("generate", "agenerate", "abort", "abort_all", "score", "update_weights", "load_lora_adapter",
               "named_weights", "sleep", "wake_up", "health", "weight_version", "wait_for_version", "weight_digest",
               "close")

    def __init__(self, engine: Any, receiver: Any = None) -> None:
        self.engine, self.receiver = engine, receiver

    @classmethod
    def start(cls, spec: EngineSpec, sync: SyncConfig | None) -> EngineServer:
        """Build the engine from ``spec`` and, with ``sync``, start its weight receiver thread."""
        engine = spec.build()
        receiver = None
        if sync is not None:
            from tandem.sync.engine_process import EngineReceiver, build_receiver

            receiver = EngineReceiver(engine, build_receiver(sync, rank=1), dequantize=sync.quantize,
                                      poll_interval_s=sync.poll_interval_s,
                                      verify=sync.verify and sync.transport == "disk").start()
        return cls(engine, receiver)

    def info(self) -> dict[str, Any]:
        """What the trainer learns once the engine is built: pid, the engine's `EngineInfo`, weight version."""
        return {"pid": os.getpid(), "info": self.engine.info, "weight_version": int(self.engine.weight_version)}

    async def handle(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in self.METHODS:
            raise ValueError(f"unknown engine method {method!r} (known: {', '.join(self.METHODS)})")
        result = getattr(self, f"_{method}")(*args, **kwargs)
        return await result if asyncio.iscoroutine(result) else result

    async def _generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        # concurrent agenerates, submitted together, form the batch one `generate` would; and the loop
        # keeps serving other calls (abort_all, health) between two steps
        results = await asyncio.gather(*(self.engine.agenerate(r) for r in requests), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def _agenerate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.agenerate(request)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _abort_all(self) -> None:
        self.engine.abort_all()

    def _score(self, sequences, **kwargs: Any) -> list[list[float]]:
        if not self.engine.info.can_score:
            raise ValueError(f"{self.engine.info.name} cannot score sequences (its info.can_score is false)")
        engine: ScoringEngine = self.engine
        return engine.score(sequences, **kwargs)

    def _update_weights(self, buckets: list[tuple[torch.Tensor, BucketHeader]], version: int) -> None:
        named = [nt for flat, header in buckets for nt in unflatten_bucket(flat, header)]  # checks checksums
        self.engine.update_weights(named, version)

    def _load_lora_adapter(self, buckets: list[tuple[torch.Tensor, BucketHeader]], version: int) -> None:
        if not self.engine.info.lora_adapters:
            raise ValueError(f"{self.engine.info.name} cannot load LoRA adapters (its info.lora_adapters is false)")
        engine: LoRAEngine = self.engine
        engine.load_lora_adapter([nt for flat, header in buckets for nt in unflatten_bucket(flat, header)], version)

    def _named_weights(self) -> list[tuple[str, bytes]]:
        from tandem.sync.verify import engine_weights

        out = []
        for bucket in bucketize(engine_weights(self.engine).items(), 256 * 1024 * 1024):
            flat, header = flatten_bucket([(n, t.detach().cpu().contiguous()) for n, t in bucket])
            out.append((header.to_json(), flat.numpy().tobytes()))
        return out

    def _sleep(self) -> None:
        self.engine.sleep()

    def _wake_up(self) -> None:
        self.engine.wake_up()

    def _health(self) -> dict[str, Any]:
        process = {"pid": os.getpid(), "trainer_imported": "tandem.engines.training" in sys.modules,
                   "torch_threads": torch.get_num_threads()}
        sync = self.receiver.health() if self.receiver is not None else None
        return self.engine.health() | {"sync": sync, "process": process}

    def _weight_version(self) -> int:
        return int(self.engine.weight_version)

    async def _wait_for_version(self, version: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.engine.weight_version < version:
            if time.monotonic() > deadline:
                last = self.receiver.last_error if self.receiver is not None else None
                raise TimeoutError(
                    f"the engine holds weight version {self.engine.weight_version}, not {version}, after "
                    f"{timeout_s:.0f}s (sync.timeout_s); last sync receiver error: {last}"
                )
            await asyncio.sleep(0.005)
        return int(self.engine.weight_version)

    def _weight_digest(self) -> dict[str, int]:
        from tandem.sync.verify import engine_weights

        return tensor_hashes(engine_weights(self.engine).items())

    def _close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.stop(timeout_s=5)
            self.receiver = None
        self.engine.close()


# -- the engine process --------------------------------------------------------------------------------


def engine_process_main(fd: int) -> None:
    """Entry point of the engine process: read what to build, build it, report ready, serve until closed.

    The trainer sends, in order: a JSON bootstrap (``sys_path``; ``torch_threads``, its intra-op
    thread count, so that the engine computes as it would in the trainer's process: matmul results
    depend on the thread count) and a pickle of ``(EngineSpec, SyncConfig | None)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    conn = multiprocessing.connection.Connection(fd)
    try:
        boot = json.loads(conn.recv_bytes())
        sys.path[:0] = [p for p in boot["sys_path"] if p not in sys.path]
        torch.set_num_threads(int(boot["torch_threads"]))  # an engine config's num_threads overrides it
        # unrestricted: the trainer that started this process chose the code it runs anyway
        spec, sync = pickle.loads(conn.recv_bytes())
        server = EngineServer.start(spec, sync)
        conn.send_bytes(encode(CONTROL, READY, server.info()))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        try:
            conn.send_bytes(encode(CONTROL, FATAL, error_payload(e)))
        finally:
            os._exit(1)
    try:
        asyncio.run(_serve(server, conn))
    finally:
        server.shutdown()
        conn.close()
        # an abandoned gloo group (a sync that failed mid-transfer) would block interpreter exit until its
        # collective times out; nothing is left to flush here
        os._exit(0)


async def _serve(server: EngineServer, conn) -> None:
    """Read calls in a thread, run each as a task on this loop, reply when it completes."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    send_lock = threading.Lock()
    tasks: set[asyncio.Task] = set()

    def reply(call_id: int, status: int, payload: Any) -> None:
        try:
            frame = encode(call_id, status, payload)
        except Exception as e:  # noqa: BLE001 - e.g. a result that does not pickle: report it instead
            frame = encode(call_id, ERROR, error_payload(e))
        with send_lock:
            conn.send_bytes(frame)

    async def run(call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            result = await server.handle(method, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the caller gets it
            reply(call_id, ERROR, error_payload(e))
            return
        reply(call_id, OK, result)
        if method == "close":
            done.set()

    def start(call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        task = loop.create_task(run(call_id, method, args, kwargs))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def start_many(calls: list[tuple[int, str, tuple]]) -> None:  # one loop turn: they join one engine step
        for call_id, method, args in calls:
            start(call_id, method, args, {})

    def read() -> None:
        while True:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):  # the trainer closed its end or died
                loop.call_soon_threadsafe(done.set)
                return
            try:
                call_id, _status, (method, args, kwargs) = decode(frame)
                if method == MANY:
                    loop.call_soon_threadsafe(start_many, args)
                    continue
                if method in ("update_weights", "load_lora_adapter"):  # raw bucket frames follow the call
                    headers, version = args
                    args = (_receive_buckets(conn, headers), version)
            except UndecodableFrame as e:
                reply(e.call_id, ERROR, ("ValueError", f"the engine process could not decode the call: {e}", ""))
                continue
            loop.call_soon_threadsafe(start, call_id, method, args, kwargs)

    threading.Thread(target=read, name="tandem-engine-calls", daemon=True).start()
    await done.wait()
    for task in list(tasks):
        task.cancel()


def _receive_buckets(conn, headers: list[str]) -> list[tuple[torch.Tensor, BucketHeader]]:
    out = []
    for text in headers:
        header = BucketHeader.from_json(text)
        buf = bytearray(header.nbytes)
        conn.recv_bytes_into(buf)
        out.append((torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8), header))
    return out
