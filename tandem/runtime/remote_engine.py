"""An inference engine in its own process, seen from the trainer: `RemoteEngine`.

The separate placement (``runtime.placement: separate``) runs the inference engine in a child process:

    spec = EngineSpec(factory="tandem.engines.inference.torch:TorchEngine", config=engine_config)
    engine = RemoteEngine(spec, sync=receiver_sync_config)  # satisfies core.protocols.InferenceEngine
    engine.generate(requests)  # forwarded; results come back as the protocol's dataclasses

The child (`tandem.runtime.engine_server`) builds the engine from ``spec`` and, with ``sync``, a
receiver thread that applies the weight updates the trainer's sender sends (broadcast or disk).

**The connection.** Parent and child talk over a socket pair that only these two processes hold (no
port, nothing another local user can connect to), in the frames of `tandem.runtime.engine_wire`:
allowlisted pickles for calls and results, raw checksummed buckets for `update_weights`.

**Concurrency.** Any number of trainer threads and coroutines may call at once: calls are numbered and
a reader thread routes each result to its caller, so concurrent `agenerate` calls (fully-async mode)
share the engine's running batch.

**Failure.** If the child dies, every pending and later call raises `EngineProcessError` naming its pid
and exit status (``abort``/``abort_all``/``close`` become no-ops: nothing is left to abort). An exchange
with the engine outside the connection (a weight sync over the transport, whose collectives would wait
for a dead peer until ``sync.timeout_s``) runs under `run_while_alive`, which raises the same error as
soon as the process is gone. A child that cannot start reports its traceback. The child exits when the
trainer closes it or when the trainer's end of the connection closes (the trainer died).

**Seams for Ray.** `EngineSpec` (what to build) and `EngineServer` (the engine, its sync receiver and
the allowlisted methods) do not depend on the connection: an actor can host an `EngineServer` and
expose ``handle``, and a Ray client then replaces `RemoteEngine`'s connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import json
import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.core.protocols import EngineInfo, GenerationRequest, GenerationResult, NamedTensors
from tandem.engines.registry import EngineSpec
from tandem.runtime.engine_wire import (
    FATAL,
    MANY,
    OK,
    READY,
    EngineCallError,
    EngineProcessError,
    UndecodableFrame,
    decode,
    encode,
    plain_request,
    rebuild_error,
)
from tandem.sync.base import BucketHeader, SyncConfig, bucketize, flatten_bucket, unflatten_bucket

__all__ = ["EngineCallError", "EngineProcessError", "EngineSpec", "RemoteEngine"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_BUCKET_BYTES = 256 * 1024 * 1024  # update_weights over the connection: bucket size
_DEATH_POLL_S = 0.05  # run_while_alive: how often it looks at the engine process
_EXIT_GRACE_S = 2.0  # an exchange failed: how long a dying engine process may take to be reaped

# A fresh interpreter (as multiprocessing's spawn, but without re-running the trainer's main module,
# which could import the trainer or, in a script without a main guard, start the run again).
_CHILD_CODE = "import sys; from tandem.runtime.engine_server import engine_process_main; engine_process_main(int(sys.argv[1]))"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the tandem package


class RemoteEngine:
    """An `InferenceEngine` whose engine runs in a spawned process (see the module docstring).

    ``sync``: the engine side's sync config (transport, and for broadcast the sender's real port); the
    child then applies every update the trainer's sender sends. Construction returns at once; calls wait
    for the child to be ready (`wait_ready` waits explicitly, up to ``start_timeout_s``).
    """

    def __init__(self, spec: EngineSpec, *, sync: SyncConfig | None = None, start_timeout_s: float = 600.0) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s={start_timeout_s} must be > 0")
        self.spec, self.config = spec, spec.config
        self.start_timeout_s = start_timeout_s
        parent_end, child_end = socket.socketpair()
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(child_end.fileno())],
                                          pass_fds=(child_end.fileno(),), env=env)
        finally:
            child_end.close()  # only the child holds its end: its death reads as EOF here
        self._conn = multiprocessing.connection.Connection(parent_end.detach())
        # the child finds what the trainer finds, and computes with the trainer's thread count (as a
        # colocated engine would: matmul results depend on it)
        boot = {"sys_path": sys.path, "torch_threads": torch.get_num_threads()}
        self._conn.send_bytes(json.dumps(boot).encode())
        self._conn.send_bytes(pickle.dumps((spec, sync), protocol=5))
        self._send_lock = threading.Lock()
        self._batch_lock = threading.Lock()
        self._agenerate_batches: dict[asyncio.AbstractEventLoop, list] = {}
        self._pending_lock = threading.Lock()
        self._pending: dict[int, tuple[cf.Future, str]] = {}
        self._ids = itertools.count()
        self._ready = threading.Event()
        self._info: dict[str, Any] = {}
        self._failure: str | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="tandem-engine-replies", daemon=True)
        self._reader.start()

    # -- process state ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The engine process's exit status (negative: killed by that signal); None while it runs."""
        return self._proc.poll()

    @property
    def alive(self) -> bool:
        return self._failure is None and self._proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the engine is built (raises `EngineProcessError` if it failed or timed out)."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        if not self._ready.wait(timeout_s):
            self._fail(f"the engine process (pid {self.pid}) did not start within {timeout_s:.0f}s")
            self._kill()
        if self._failure is not None:
            raise EngineProcessError(self._failure)

    def raise_if_dead(self) -> None:
        """Raise `EngineProcessError` if the engine process is gone (a clearer cause than a failed sync)."""
        if self._failure is None and self._proc.poll() is not None:
            self._fail(self._death_message())
        if self._failure is not None:
            raise EngineProcessError(self._failure)

    def run_while_alive(self, fn: Callable[[], T], *, what: str) -> T:
        """``fn()``, run in a helper thread; raises `EngineProcessError` as soon as the engine process dies.

        For an exchange with the engine outside this connection (a weight sync over the transport): a
        collective with a dead peer waits until its own timeout (``sync.timeout_s``). Then ``fn``'s
        thread (a daemon, named after ``what``) is left to that timeout and its outcome discarded. An
        error of ``fn`` whose cause is a dying engine process is reported as the process's death.
        """
        self.raise_if_dead()
        future: cf.Future = cf.Future()

        def target() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)

        threading.Thread(target=target, name=f"tandem-{what.replace(' ', '-')}", daemon=True).start()
        while True:
            try:
                return future.result(timeout=_DEATH_POLL_S)
            except cf.TimeoutError:
                self.raise_if_dead()
            except Exception:
                try:  # a failed exchange is often the first sign of a death: give the process time to go
                    self._proc.wait(timeout=_EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
                self.raise_if_dead()
                raise

    # -- the InferenceEngine protocol ------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """The engine's `EngineInfo`, as the engine process reported it when it was built. Its capability
        flags hold here too: every method the engine has is forwarded."""
        self.wait_ready()
        return self._info["info"]

    @property
    def weight_version(self) -> int:
        return self._call("weight_version").result()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking generation, results in request order (the engine process batches them)."""
        return self._call("generate", [plain_request(r) for r in requests]).result()

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """One request; concurrent calls share the engine's batch. Cancelling aborts it in the engine.

        Calls made in one turn of the event loop (a step's groups, started together) travel in one frame
        and start together in the engine process, so they join the engine's batch in the same step, as
        one ``generate`` call or a colocated engine would (batch composition changes the numerics)."""
        future = self._queue_agenerate(plain_request(request))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if self.alive:
                self._call("abort", request.request_id)  # not awaited: the engine finishes it as ABORT
            raise

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._call("abort", request_id).result()

    def abort_all(self) -> None:
        if self.alive:
            self._call("abort_all").result()

    def score(self, sequences, *, temperature: float = 1.0, max_tokens: int = 8192) -> list[list[float]]:
        """The engine's teacher-forced log-probs (`ScoringEngine`; where ``info.can_score``)."""
        items = [(list(map(int, ids)), int(p)) for ids, p in sequences]
        return self._call("score", items, temperature=temperature, max_tokens=max_tokens).result()

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy HF-named tensors into the engine's weights, sent over the connection as flat checksummed
        buckets. The run's syncs go through the sync transport instead; this is the protocol's direct
        path (tests, tools)."""
        self._send_tensors("update_weights", named_tensors, version)

    def load_lora_adapter(self, named_tensors: NamedTensors, version: int) -> None:
        """`LoRAEngine` (where ``info.lora_adapters``): adapter tensors, sent like `update_weights`."""
        self._send_tensors("load_lora_adapter", named_tensors, version)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """`WeightsView` (where ``info.exposes_weights``): a copy of the engine's weights by HF name, sent
        back as checksummed flat buckets."""
        out: dict[str, torch.Tensor] = {}
        for header_json, data in self._call("named_weights").result():
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            out.update(unflatten_bucket(flat, BucketHeader.from_json(header_json)))
        return out

    def _send_tensors(self, method: str, named_tensors: NamedTensors, version: int) -> None:
        flats, headers = [], []
        for bucket in bucketize(named_tensors, _BUCKET_BYTES):
            flat, header = flatten_bucket(bucket)
            flats.append(memoryview(flat.numpy()))
            headers.append(header.to_json())
        self._call(method, headers, int(version), _frames=flats).result()

    def sleep(self) -> None:
        self._call("sleep").result()

    def wake_up(self) -> None:
        self._call("wake_up").result()

    def health(self) -> dict[str, Any]:
        """The engine's health, plus ``sync`` (its weight receiver) and ``process``; a dead engine
        process reports ``status: dead`` and why."""
        if not self.alive:
            try:
                self.raise_if_dead()
            except EngineProcessError as e:
                return {"status": "closed" if self._closing else "dead", "error": str(e), "pid": self.pid,
                        "returncode": self._proc.poll()}
        return self._call("health").result()

    # -- beyond the protocol ---------------------------------------------------------------------------

    def wait_for_version(self, version: int, timeout_s: float) -> int:
        """Block until the engine holds weight ``version`` (a transport that applies asynchronously,
        like disk, returns before the engine has it); raises `TimeoutError` naming the last sync error."""
        return self._call("wait_for_version", int(version), float(timeout_s)).result()

    def weight_digest(self) -> dict[str, int]:
        """xxh3-64 of every engine weight by HF name (`tandem.sync.base.tensor_hashes`)."""
        return self._call("weight_digest").result()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine process (in-flight requests end as ABORT); idempotent."""
        if self._closing:
            return
        self._closing = True
        try:
            if self.alive and self._ready.is_set():
                self._call("close", _closing=True).result(timeout=timeout_s)
        except (EngineProcessError, cf.TimeoutError, EngineCallError):
            log.warning("the engine process did not close cleanly; killing it")
        finally:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
            self._conn.close()
            self._reader.join(timeout=5)

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait(timeout=10)

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------------------

    def _queue_agenerate(self, request: GenerationRequest) -> cf.Future:
        """The request's reply future; the frame goes out when this loop turn's calls are all queued."""
        loop = asyncio.get_running_loop()
        future: cf.Future = cf.Future()
        with self._batch_lock:
            batch = self._agenerate_batches.get(loop)
            if batch is None:
                batch = self._agenerate_batches[loop] = []
                loop.call_soon(self._flush_agenerate, loop)
            batch.append((request, future))
        return future

    def _flush_agenerate(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._batch_lock:
            batch = self._agenerate_batches.pop(loop, [])
        if not batch:
            return
        try:
            self._call_many("agenerate", [((request,), future) for request, future in batch])
        except BaseException as e:  # noqa: BLE001 - every queued caller gets the failure
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)

    def _call_many(self, method: str, calls: Sequence[tuple[tuple, cf.Future]]) -> None:
        """Send several calls of ``method`` in one frame; each reply resolves its own future."""
        if self._closing:
            raise EngineProcessError(f"{method}(): the engine process was closed")
        self.wait_ready()
        with self._pending_lock:
            if self._failure is not None:
                raise EngineProcessError(self._failure)
            ids = [next(self._ids) for _ in calls]
            for call_id, (_, future) in zip(ids, calls, strict=True):
                self._pending[call_id] = (future, method)
        try:
            frame = encode(ids[0], OK, (MANY, [(i, method, args) for i, (args, _) in zip(ids, calls, strict=True)], {}))
            with self._send_lock:
                self._conn.send_bytes(frame)
        except (OSError, EOFError) as e:
            with self._pending_lock:
                for call_id in ids:
                    self._pending.pop(call_id, None)
            self.raise_if_dead()
            raise EngineProcessError(f"{method}(): the connection to the engine process failed: {e}") from e

    def _call(self, method: str, *args: Any, _frames: Sequence[memoryview] = (), _closing: bool = False,
              **kwargs: Any) -> cf.Future:
        if self._closing and not _closing:
            raise EngineProcessError(f"{method}(): the engine process was closed")
        self.wait_ready()
        future: cf.Future = cf.Future()
        with self._pending_lock:
            if self._failure is not None:
                raise EngineProcessError(self._failure)
            call_id = next(self._ids)
            self._pending[call_id] = (future, method)
        try:
            frame = encode(call_id, OK, (method, args, kwargs))
            with self._send_lock:
                self._conn.send_bytes(frame)
                for f in _frames:
                    self._conn.send_bytes(f)
        except (OSError, EOFError) as e:
            with self._pending_lock:
                self._pending.pop(call_id, None)
            self.raise_if_dead()
            raise EngineProcessError(f"{method}(): the connection to the engine process failed: {e}") from e
        return future

    def _read(self) -> None:
        """Route every reply to its caller; on EOF fail whatever is pending."""
        try:
            while True:
                try:
                    call_id, status, payload = decode(self._conn.recv_bytes())
                except UndecodableFrame as e:
                    self._resolve(e.call_id, EngineCallError(f"the engine's reply could not be decoded: {e}"))
                    continue
                if status == READY:
                    self._info = payload
                    self._ready.set()
                elif status == FATAL:
                    self._fail(f"the engine process failed to start: {payload[0]}: {payload[1]}\n{payload[2]}")
                elif status == OK:
                    self._resolve(call_id, payload)
                else:
                    method = self._pending.get(call_id, (None, "?"))[1]
                    self._resolve(call_id, rebuild_error(payload, method, self.pid))
        except (EOFError, OSError):
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._fail(f"{self.spec.factory} engine process was closed" if self._closing else self._death_message())

    def _resolve(self, call_id: int, outcome: Any) -> None:
        with self._pending_lock:
            future, _ = self._pending.pop(call_id, (None, None))
        if future is None:
            return
        try:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        except cf.InvalidStateError:  # the caller cancelled (an agenerate task was cancelled)
            pass

    def _fail(self, reason: str) -> None:
        """Mark the process failed and fail every pending call (later calls raise at once)."""
        with self._pending_lock:
            if self._failure is None:
                self._failure = reason
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                try:
                    future.set_exception(EngineProcessError(self._failure))
                except cf.InvalidStateError:
                    pass
        self._ready.set()

    def _death_message(self) -> str:
        code = self._proc.poll()
        if code is None:
            how = "closed its connection"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return (f"the inference engine process (pid {self.pid}) {how}; its rollouts and weights are gone, so "
                "the run cannot continue (see the engine's log above for the cause)")
