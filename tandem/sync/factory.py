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
    against the manifest themselves).
    """
    sender: WeightSync
    if cfg.transport in ("auto", "inprocess"):  # auto outside a run: the colocated default
        if engine is None:
            raise ValueError("sync.transport='inprocess' needs the inference engine (engine=)")
        from tandem.sync.inprocess import InProcessSync

        sender = InProcessSync(engine, verify=cfg.verify, dequantize=cfg.quantize)
    elif cfg.transport == "broadcast":
        from tandem.sync.broadcast import BroadcastSender

        sender = BroadcastSender(
            num_receivers=cfg.num_receivers, host=cfg.host, port=cfg.port, timeout_s=cfg.timeout_s, verify=cfg.verify
        )
    elif cfg.transport == "disk":
        from tandem.sync.disk import DiskSender

        sender = DiskSender(cfg.directory, delta=cfg.delta, keep_versions=cfg.keep_versions)
    elif cfg.transport == "ray":
        from tandem.sync.ray_store import RaySender

        sender = RaySender(list(receivers), verify=cfg.verify)
    elif cfg.transport == "cuda_ipc":
        from tandem.sync.cuda import CudaIpcSender

        if authkey is None:
            raise ValueError("sync.transport='cuda_ipc' needs the authkey shared with the engine process")
        sender = CudaIpcSender(address=(cfg.host, cfg.port), authkey=authkey)
    elif cfg.transport == "cupy_nccl":
        from tandem.sync.cuda import CupyNcclSender

        sender = CupyNcclSender(num_receivers=cfg.num_receivers, host=cfg.host, port=cfg.port, timeout_s=cfg.timeout_s)
    else:  # the config's Literal makes this unreachable from a recipe
        raise ValueError(f"unknown sync.transport={cfg.transport!r}")
    if cfg.quantize is not None:
        from tandem.sync.quantize import QuantizedSender

        sender = QuantizedSender(sender, cfg.quantize)
    return sender
