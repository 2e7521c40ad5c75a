"""Build the trainer-side sender of a ``sync:`` config (the engine side: `engine_process.build_receiver`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.core.protocols import WeightSync
from tandem.sync.base import SyncConfig

__all__ = ["build_sender"]


def build_sender(
    cfg: SyncConfig, *, engine: Any = None, receivers: Sequence[Any] = (), authkey: bytes | None = None
) -> WeightSync:
    """The `WeightSync` for ``cfg``: ``engine`` for in-process, ``receivers`` (Ray actors) for ray,
    ``authkey`` (shared with the engine process) for cuda_ipc.

    Quantize-on-send (``cfg.quantize``) wraps the transport; ``cfg.verify`` turns on the
    after-sync comparison where the transport can report back (all but disk, whose receivers verify
    against the manifest themselves). A broadcast sender is wrapped in a `FailoverSender` when
    ``cfg.retries`` or ``cfg.fallback`` asks for it (docs/sync.md, "Failover"); a fallback directory is
    emptied of earlier versions first.
    """
    sender = _transport(cfg, cfg.transport, engine=engine, receivers=receivers, authkey=authkey)
    if cfg.transport in RETRIED and (cfg.retries > 0 or cfg.fallback is not None):
        from tandem.sync.failover import FailoverSender, clear_versions

        fallback = None
        if cfg.fallback is not None:
            if cfg.fallback == "disk":
                clear_versions(cfg.directory)
            try:
                fallback = _transport(cfg, cfg.fallback)
            except BaseException:
                sender.close()
                raise
        sender = FailoverSender(sender, fallback, retries=cfg.retries)
    if cfg.quantize is not None:
        from tandem.sync.quantize import QuantizedSender

        sender = QuantizedSender(sender, cfg.quantize)
    return sender


# the transports whose sends are retried (``sync.retries``) and may fall back (``sync.fallback``). Not
# disk: its sender only writes files (a failure there is the file system's, which an immediate retry rarely
# fixes) and its receivers already retry a failed read at every poll; not the GPU transports (untested here)
RETRIED = ("broadcast",)


def _transport(
    cfg: SyncConfig, transport: str, *, engine: Any = None, receivers: Sequence[Any] = (), authkey: bytes | None = None
) -> WeightSync:
    sender: WeightSync
    if transport in ("auto", "inprocess"):  # auto outside a run: the colocated default
        if engine is None:
            raise ValueError("sync.transport='inprocess' needs the inference engine (engine=)")
        from tandem.sync.inprocess import InProcessSync

        sender = InProcessSync(engine, verify=cfg.verify, dequantize=cfg.quantize)
    elif transport == "broadcast":
        from tandem.sync.broadcast import BroadcastSender

        sender = BroadcastSender(
            num_receivers=cfg.num_receivers, host=cfg.host, port=cfg.port, timeout_s=cfg.timeout_s, verify=cfg.verify
        )
    elif transport == "disk":
        from tandem.sync.disk import DiskSender

        sender = DiskSender(cfg.directory, delta=cfg.delta, keep_versions=cfg.keep_versions)
    elif transport == "ray":
        from tandem.sync.ray_store import RaySender

        sender = RaySender(list(receivers), verify=cfg.verify)
    elif transport == "cuda_ipc":
        from tandem.sync.cuda import CudaIpcSender

        if authkey is None:
            raise ValueError("sync.transport='cuda_ipc' needs the authkey shared with the engine process")
        sender = CudaIpcSender(address=(cfg.host, cfg.port), authkey=authkey)
    elif transport == "cupy_nccl":
        from tandem.sync.cuda import CupyNcclSender

        sender = CupyNcclSender(num_receivers=cfg.num_receivers, host=cfg.host, port=cfg.port, timeout_s=cfg.timeout_s)
    else:  # the config's Literal makes this unreachable from a recipe
        raise ValueError(f"unknown sync.transport={transport!r}")
    return sender
