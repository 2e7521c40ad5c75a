"""Weight sync: what every transport shares.

The trainer side produces *buckets*: lists of ``(hf_name, full_tensor)`` of bounded byte size
(`TrainingEngine.named_parameters_for_sync`). A transport moves them to the inference side, which
applies them with ``engine.update_weights(named_tensors, version)`` (through `tandem.sync.apply`).
Rules every transport keeps:

* **Whole or nothing.** The receiver stages a complete update and checks it (bucket checksums) before
  applying it, so a failed transfer leaves the engine on its previous weights and version.
* **Versions.** ``version`` is the trainer's count of completed syncs; the engine reports it after
  applying, every generated token says which version produced it, and it never goes backwards.
* **Checksums.** Each bucket travels with the xxh3-64 hash of its bytes; a mismatch is an error.

A bucket crosses process boundaries as one flat ``uint8`` buffer plus a JSON header (names, dtypes,
shapes, byte offsets), never pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from tandem.kernels.config import QuantConfig

__all__ = [
    "ApplyFn",
    "BucketHeader",
    "BufferPool",
    "SyncConfig",
    "SyncError",
    "SyncUnavailableError",
    "bucketize",
    "checksum",
    "flatten_bucket",
    "sync_metrics",
    "tensor_hashes",
    "unflatten_bucket",
]

NamedList = list[tuple[str, torch.Tensor]]
SECRET_ENV = "TANDEM_SYNC_SECRET"
# Engine side of a transport: apply one whole update. May return a report (a JSON-able dict, e.g. the
# `verify` result) that the transport hands back to the sender.
ApplyFn = Callable[[NamedList, int], "dict[str, Any] | None"]


class SyncError(RuntimeError):
    """A weight sync failed; the engine kept its previous weights and version."""


class SyncUnavailableError(SyncError):
    """The transport cannot run on this machine (e.g. it needs a GPU)."""


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """The recipe's ``sync:`` section (see docs/sync.md)."""

    # auto: the placement's own (colocated: inprocess, separate: broadcast, ray: ray); a run resolves it
    transport: Literal["auto", "inprocess", "broadcast", "disk", "ray", "cuda_ipc", "cupy_nccl"] = "auto"
    bucket_bytes: int = 256 * 1024 * 1024
    verify: bool = False  # debug: compare engine weights with the trainer's after each sync (xxh3)
    # broadcast / cupy_nccl: rendezvous of the dedicated group (trainer rank 0 + engine processes)
    host: str = "127.0.0.1"
    port: int = 0
    num_receivers: int = 1  # engine processes in the group (their ranks are 1..num_receivers)
    timeout_s: float = 120.0
    # disk
    directory: str = ""
    delta: bool = False
    keep_versions: int = 2
    poll_interval_s: float = 0.5  # how often an engine-side disk receiver looks for a new version
    # failover (docs/sync.md, "Failover"): a failed broadcast is sent again ``retries`` times (same
    # version); then, with ``fallback``, that version and every later one go through that transport
    # (disk: ``directory``; the engine process listens on both from the start)
    retries: int = 1
    fallback: Literal["disk"] | None = None
    # LoRA: send merged full weights, or the adapter alone (to engines that load adapters)
    lora_mode: Literal["merged", "adapter"] = "merged"
    # colocated with lora_mode adapter: the engine holds the trainer's frozen base tensors instead of a copy of
    # its own (one base in the process, not two; tandem.sync.inprocess.share_frozen_base); false: its own copy
    share_frozen_base: bool = True
    # quantize on send through tandem.kernels: use the trainer's QAT config so the engine gets the
    # bits of the trainer's fake-quantized forward; None sends the trainer's dtype
    quantize: QuantConfig | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # broadcast / disk: the secret a sender and its receivers share (HMAC-SHA256 of the rendezvous and of
    # every update, docs/sync.md "Security"). Empty: $TANDEM_SYNC_SECRET, else a run makes a random one
    # per run and hands it to the engine process it starts. Never written into a saved config.
    secret: str = field(default="", repr=False)

    def resolved_secret(self) -> str:
        """``secret``, else ``$TANDEM_SYNC_SECRET`` ("" if neither is set)."""
        return self.secret or os.environ.get(SECRET_ENV, "")

    def to_config_dict(self) -> dict[str, Any]:
        """The section as a recipe writes it, without the secret (config.yaml, `tandem config`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "secret"}

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} must be >= 1024")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
        if self.transport == "disk" and not self.directory:
            raise ValueError("transport 'disk' needs sync.directory")
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions={self.keep_versions} must be >= 1")
        if self.num_receivers < 1:
            raise ValueError(f"num_receivers={self.num_receivers} must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 picks a free port)")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s={self.poll_interval_s} must be > 0")
        if self.retries < 0:
            raise ValueError(f"retries={self.retries} must be >= 0 (0: no retry)")
        if self.fallback is not None:
            self._check_fallback()

    def _check_fallback(self) -> None:
        """Refuse a fallback that cannot work (``auto`` is checked again once the run resolves it)."""
        fallback, transport = self.fallback, self.transport
        if fallback == transport:
            raise ValueError(f"fallback={fallback!r} is the transport itself (transport={transport!r}): a fallback "
                             "must be another transport (e.g. transport: broadcast, fallback: disk)")
        if transport not in ("auto", "broadcast"):
            why = {"inprocess": "in-process sync copies into an engine in the trainer's own process, the colocated "
                                "placement: nothing to fall back from, and no engine-side disk receiver",
                   "disk": "disk has no other engine-side transport to fall back to here",
                   "ray": "Ray replicas receive through the object store only"}.get(
                       transport, "its engine side has no disk receiver beside it")
            raise ValueError(f"fallback={fallback!r} does not work with transport={transport!r} ({why}); a fallback "
                             "backs up transport: broadcast (runtime.placement: separate)")
        if fallback == "disk" and not self.directory:
            raise ValueError(f"fallback='disk' needs sync.directory (where transport={transport!r} falls back to)")


def _byte_view(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def checksum(tensors: Iterable[torch.Tensor] | torch.Tensor) -> int:
    """xxh3-64 over the raw bytes of one tensor or a sequence of tensors (in order).

    xxhash releases the GIL and runs at ~25-40 GB/s here, several times memcpy speed.
    """
    h = xxhash.xxh3_64()
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        h.update(_byte_view(t))
    return h.intdigest()


def tensor_hashes(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """``{name: xxh3-64 of its bytes}``: the per-tensor digest `verify` compares."""
    return {name: checksum(t) for name, t in named}


def sync_metrics(nbytes: int, seconds: float, **extra: float) -> dict[str, float]:
    """The metrics every sender returns: ``sync/bytes``, ``sync/seconds``, ``sync/gbps`` and extras."""
    out = {"sync/bytes": float(nbytes), "sync/seconds": seconds, "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9}
    return out | {f"sync/{k}": float(v) for k, v in extra.items()}


@dataclass(kw_only=True, slots=True)
class BucketHeader:
    """Where each tensor of a flattened bucket lives; JSON-serialisable."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int
    checksum: int

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__slots__})

    @classmethod
    def from_json(cls, text: str) -> BucketHeader:
        return cls(**json.loads(text))


_ALIGN = 64
UNHASHED = -1  # BucketHeader.checksum of a bucket sent without one


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BufferPool:
    """Reusable ``uint8`` buffers, one per slot, grown when a bigger one is needed.

    A fresh multi-hundred-MB buffer costs a page fault per 4 KiB page on first touch (measured: it
    halves gloo's throughput); keeping the buffers between syncs avoids that, at the price of holding
    them (one model-sized staging area on the receiver, two buckets on the sender).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[int, torch.Tensor] = {}

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = buf
        return buf[:nbytes]

    def clear(self) -> None:
        self._buffers.clear()


def _layout(bucket: NamedList) -> tuple[list[int], list[int], int]:
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += -(-n // _ALIGN) * _ALIGN  # aligned, so every tensor can be viewed in place
    return sizes, offsets, off


def flatten_bucket(
    bucket: NamedList, out: BufferPool | None = None, slot: int = 0, *, hashed: bool = True
) -> tuple[torch.Tensor, BucketHeader]:
    """One contiguous ``uint8`` buffer holding every tensor's bytes, and its header.

    With ``out`` the buffer comes from that pool's ``slot`` (reused; valid until the slot is reused),
    otherwise it is newly allocated. Padding bytes are zeroed so the checksum is deterministic.
    ``hashed=False`` leaves the checksum out (``-1``; receivers then skip the check): for GPU
    buffers, whose hash needs a host copy.
    """
    sizes, offsets, total = _layout(bucket)
    device = out.device if out is not None else torch.device("cpu")
    flat = out.get(slot, total) if out is not None else torch.empty(total, dtype=torch.uint8, device=device)
    # On CPU the copies go through numpy: a single-threaded memcpy that releases the GIL. torch's
    # copy_ would use every OpenMP thread, and next to a transfer in flight (gloo's threads, the
    # receiving process) libgomp's spinning threads made flattening 10-30x slower (measured).
    host = flat.numpy() if flat.device.type == "cpu" else None
    for (_, t), o, n in zip(bucket, offsets, sizes, strict=True):
        if n and host is not None:
            np.copyto(host[o : o + n], _byte_view(t))
        elif n:
            flat[o : o + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        pad_end = o + (-(-n // _ALIGN) * _ALIGN)
        if pad_end > o + n:
            flat[o + n : pad_end].zero_()
    header = BucketHeader(
        names=[name for name, _ in bucket],
        dtypes=[_dtype_name(t.dtype) for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
        offsets=offsets,
        nbytes=total,
        checksum=checksum(flat) if hashed else UNHASHED,
    )
    return flat, header


def unflatten_bucket(
    flat: torch.Tensor, header: BucketHeader, *, verify: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a flat bucket, as views of ``flat`` (no copy)."""
    if flat.numel() != header.nbytes:
        raise SyncError(f"bucket holds {flat.numel()} bytes, header says {header.nbytes}")
    if verify:
        check_bucket(flat, header)
    for name, dt, shape, off in zip(header.names, header.dtypes, header.shapes, header.offsets, strict=True):
        dtype = getattr(torch, dt)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        yield name, flat[off : off + n].view(dtype).view(shape)


def check_bucket(flat: torch.Tensor, header: BucketHeader) -> None:
    """Raise `SyncError` if ``flat`` does not hash to the header's checksum (unless it has none)."""
    if header.checksum != UNHASHED and checksum(flat) != header.checksum:
        first = header.names[0] if header.names else "<empty>"
        raise SyncError(f"bucket checksum mismatch (first tensor {first!r}): corrupted in transfer")


def bucketize(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[NamedList]:
    """Group named tensors into buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    bucket: NamedList = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
