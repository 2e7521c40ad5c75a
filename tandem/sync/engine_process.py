"""Engine side of a separate-process sync: a receiver loop in a background thread of the engine's process.

    engine = TorchEngine(config)
    receiver = BroadcastReceiver(rank=1, num_receivers=1, host=trainer_host, port=port)
    with EngineReceiver(engine, receiver):
        serve(engine)  # generate as usual; updates land between two engine steps

`EngineReceiver` runs ``receiver.receive(applier)`` (blocking transports: broadcast, CUDA IPC, cupy
NCCL) or ``receiver.poll(applier)`` every ``poll_interval_s`` (disk) in a daemon thread, where
``applier`` is a `WeightApplier` (version rule, LoRA routing, dequantize-on-load, verify) around the
engine's ``update_weights``. The embedded `TorchEngine` takes updates from another thread: its
``update_weights`` waits for the step lock, so an update lands between two steps and in-flight
requests continue on the new weights (their ``weight_versions`` record the switch).

A failed update (corrupted bucket, rejected by the engine, sender died) is logged and counted; the
engine keeps its weights and version and the loop waits for the next one. For Ray, an actor that hosts
an engine calls `tandem.sync.ray_store.receive_from_refs` with a `WeightApplier` instead (no thread).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from tandem.kernels.config import QuantConfig
from tandem.sync.apply import WeightApplier
from tandem.sync.base import SyncConfig, SyncError
from tandem.sync.failover import FailoverReceiver

__all__ = ["EngineReceiver", "build_receiver"]

log = logging.getLogger(__name__)

_MAX_ERRORS = 20  # most recent errors kept for health reporting


class EngineReceiver:
    """Applies every update a transport receiver gets to ``engine``, from a background thread.

    ``on_update(version)`` runs in the receiving thread after each applied update (e.g. to log it).
    ``verify`` (disk only; the other transports take it from the sender): check the engine against
    the manifest's hashes after each update and count a mismatch as an error.

    A `FailoverReceiver` (``sync.fallback``, `tandem.sync.failover`) gets one thread per transport, both
    applying through the same `WeightApplier` (one update at a time, versions never backwards); the
    counts and errors are the sum of both, ``health()["transports"]`` has each one's.
    """

    def __init__(
        self,
        engine: Any,
        receiver: Any,
        *,
        dequantize: QuantConfig | None = None,
        poll_interval_s: float = 0.5,
        verify: bool = False,
        on_update: Callable[[int], None] | None = None,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s={poll_interval_s} must be > 0")
        self.engine, self.receiver = engine, receiver
        self.applier = WeightApplier(engine, dequantize=dequantize)
        self.poll_interval_s, self.verify, self.on_update = poll_interval_s, verify, on_update
        parts = receiver.parts(verify) if isinstance(receiver, FailoverReceiver) else [("sync", receiver, verify)]
        self._channels = [_Channel(name, rx, v) for name, rx, v in parts]
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> EngineReceiver:
        if self._threads:
            raise RuntimeError("EngineReceiver already started")
        for channel in self._channels:
            suffix = "" if len(self._channels) == 1 else f"-{channel.name}"
            thread = threading.Thread(target=self._loop, args=(channel,), name=f"tandem-sync-receiver{suffix}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the update in progress (if any); idle waits end at once."""
        self._stop.set()
        for channel in self._channels:
            if hasattr(channel.receiver, "stop_requested"):
                channel.receiver.stop_requested = True
        for thread in self._threads:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("the sync receiver thread %s did not stop within %.0fs", thread.name, timeout_s)
        for channel in self._channels:
            close = getattr(channel.receiver, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> EngineReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def updates(self) -> int:
        return sum(c.updates for c in self._channels)

    @property
    def last_error(self) -> str | None:
        return self.errors[-1] if self.errors else None

    # -- receiving ---------------------------------------------------------------------------------

    def serve_once(self, transport: str | None = None) -> int | None:
        """Receive (or poll for) one update and apply it; its version, or None if there was none.

        ``transport``: which receiver of a failover pair (its name; default: the first, the primary).
        Raises `SyncError` if the update failed (the engine kept its weights and version).
        """
        channel = self._channels[0] if transport is None else next(c for c in self._channels if c.name == transport)
        return self._serve(channel)

    def _serve(self, channel: _Channel) -> int | None:
        poll = getattr(channel.receiver, "poll", None)
        if callable(poll):
            version = poll(self.applier, verify=channel.verify)
        else:
            version = channel.receiver.receive(self.applier)
        if version is not None:
            channel.updates += 1
            if self.on_update is not None:
                self.on_update(version)
        return version

    def _loop(self, channel: _Channel) -> None:
        polling = callable(getattr(channel.receiver, "poll", None))
        while not self._stop.is_set():
            try:
                version = self._serve(channel)
            except Exception as e:  # noqa: BLE001 - a failed update must not end the engine's receiving
                self._record(channel, e)
                self._stop.wait(0.05)
                continue
            if version is None:
                if not polling:
                    log.info("the %s sender closed; the receiver stops", channel.name)
                    return
                self._stop.wait(self.poll_interval_s)

    def _record(self, channel: _Channel, e: Exception) -> None:
        message = f"{type(e).__name__}: {e}"
        if len(self._channels) > 1:
            message = f"{channel.name}: {message}"
        with self._lock:
            channel.errors += 1
            self.errors = [*self.errors[-(_MAX_ERRORS - 1) :], message]
        if isinstance(e, SyncError):
            log.warning("weight update failed, engine kept version %s: %s", self.engine.weight_version, message)
        else:
            log.exception("weight receiver error")

    def health(self) -> dict[str, Any]:
        out = {
            "running": self.running,
            "updates": self.updates,
            "errors": len(self.errors),
            "last_error": self.last_error,
            "weight_version": self.engine.weight_version,
        }
        if len(self._channels) > 1:
            out["transports"] = {c.name: {"updates": c.updates, "errors": c.errors} for c in self._channels}
        return out


class _Channel:
    """One transport's receiver inside an `EngineReceiver`, with its counts."""

    def __init__(self, name: str, receiver: Any, verify: bool) -> None:
        self.name, self.receiver, self.verify = name, receiver, verify
        self.updates = self.errors = 0


def build_receiver(cfg: SyncConfig, *, rank: int = 1) -> Any:
    """The engine-side receiver of ``cfg.transport`` (``rank`` in ``1..num_receivers``).

    In-process needs none (raises); Ray receivers are actor methods (see `tandem.sync.ray_store`).
    Broadcast and disk authenticate with ``cfg.resolved_secret()`` (none: nothing is authenticated,
    which a sender that has a secret refuses). With ``cfg.fallback`` a `FailoverReceiver` holds the
    receivers of both transports (an `EngineReceiver` serves each from its own thread).
    """
    if cfg.fallback is not None:
        primary = build_receiver(dataclasses.replace(cfg, fallback=None), rank=rank)
        fallback = build_receiver(dataclasses.replace(cfg, transport=cfg.fallback, fallback=None), rank=rank)
        return FailoverReceiver(primary, fallback, names=(cfg.transport, cfg.fallback),
                                fallback_verify=cfg.verify and cfg.fallback == "disk")
    secret = cfg.resolved_secret() or None
    if cfg.transport == "broadcast":
        from tandem.sync.broadcast import BroadcastReceiver

        if cfg.port == 0:
            raise ValueError("sync.port=0: an engine process must be told the sender's port")
        return BroadcastReceiver(
            rank=rank, num_receivers=cfg.num_receivers, host=cfg.host, port=cfg.port, timeout_s=cfg.timeout_s,
            secret=secret,
        )
    if cfg.transport == "disk":
        from tandem.sync.disk import DiskReceiver

        return DiskReceiver(cfg.directory, secret=secret)
    if cfg.transport == "cupy_nccl":
        from tandem.sync.cuda import CupyNcclReceiver

        return CupyNcclReceiver(
            rank=rank, num_receivers=cfg.num_receivers, host=cfg.host, port=cfg.port, timeout_s=cfg.timeout_s
        )
    raise ValueError(
        f"sync.transport={cfg.transport!r} has no engine-process receiver "
        "(inprocess: the engine is in the trainer's process; ray: an actor method calls receive_from_refs; "
        "cuda_ipc: build CudaIpcReceiver with the sender's address and key)"
    )

