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

import logging
import threading
from collections.abc import Callable
from typing import Any

from tandem.kernels.config import QuantConfig
from tandem.sync.apply import WeightApplier
from tandem.sync.base import SyncConfig, SyncError

__all__ = ["EngineReceiver", "build_receiver"]

log = logging.getLogger(__name__)

_MAX_ERRORS = 20  # most recent errors kept for health reporting


class EngineReceiver:
    """Applies every update a transport receiver gets to ``engine``, from a background thread.

    ``on_update(version)`` runs in the receiving thread after each applied update (e.g. to log it).
    ``verify`` (disk only; the other transports take it from the sender): check the engine against
    the manifest's hashes after each update and count a mismatch as an error.
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
        self.updates = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> EngineReceiver:
        if self._thread is not None:
            raise RuntimeError("EngineReceiver already started")
        self._thread = threading.Thread(target=self._loop, name="tandem-sync-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the update in progress (if any); idle waits end at once."""
        self._stop.set()
        if hasattr(self.receiver, "stop_requested"):
            self.receiver.stop_requested = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the sync receiver thread did not stop within %.0fs", timeout_s)
        close = getattr(self.receiver, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> EngineReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def last_error(self) -> str | None:
        return self.errors[-1] if self.errors else None

    # -- receiving ---------------------------------------------------------------------------------

    def serve_once(self) -> int | None:
        """Receive (or poll for) one update and apply it; its version, or None if there was none.

        Raises `SyncError` if the update failed (the engine kept its weights and version).
        """
        poll = getattr(self.receiver, "poll", None)
        if callable(poll):
            version = poll(self.applier, verify=self.verify)
        else:
            version = self.receiver.receive(self.applier)
        if version is not None:
            self.updates += 1
            if self.on_update is not None:
                self.on_update(version)
        return version

    def _loop(self) -> None:
        polling = callable(getattr(self.receiver, "poll", None))
        while not self._stop.is_set():
            try:
                version = self.serve_once()
            except Exception as e:  # noqa: BLE001 - a failed update must not end the engine's receiving
                self._record(e)
                self._stop.wait(0.05)
                continue
            if version is None:
                if not polling:
                    log.info("the sync sender closed; the receiver stops")
                    return
                self._stop.wait(self.poll_interval_s)

    def _record(self, e: Exception) -> None:
        message = f"{type(e).__name__}: {e}"
        self.errors = [*self.errors[-(_MAX_ERRORS - 1) :], message]
        if isinstance(e, SyncError):
            log.warning("weight update failed, engine kept version %s: %s", self.engine.weight_version, message)
        else:
            log.exception("weight receiver error")

    def health(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "updates": self.updates,
            "errors": len(self.errors),
            "last_error": self.last_error,
            "weight_version": self.engine.weight_version,
        }


def build_receiver(cfg: SyncConfig, *, rank: int = 1) -> Any:
    """The engine-side receiver of ``cfg.transport`` (``rank`` in ``1..num_receivers``).

    In-process needs none (raises); Ray receivers are actor methods (see `tandem.sync.ray_store`).
    Broadcast and disk authenticate with ``cfg.resolved_secret()`` (none: nothing is authenticated,
    which a sender that has a secret refuses).
    """
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

