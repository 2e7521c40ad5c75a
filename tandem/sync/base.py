"""Weight sync: what every transport shares.

The trainer side produces *buckets*: lists of ``(hf_name, full_tensor)`` of bounded byte size
(`TrainingEngine.named_parameters_for_sync`). A transport moves them to the inference side, which
applies them with ``engine.update_weights(named_tensors, version)``. Rules every transport keeps:

* **Whole or nothing.** The receiver stages a complete update and checks it (bucket checksums) before
  applying it, so a failed transfer leaves the engine on its previous weights and version.
* **One version per sync.** ``version`` is the trainer's count of completed syncs; the engine reports
  it after applying, and every generated token says which version produced it.
* **Checksums.** Each bucket travels with the xxh3-64 hash of its bytes; a mismatch is an error.

A bucket crosses process boundaries as one flat ``uint8`` buffer plus a JSON header (names, dtypes,
shapes, byte offsets), never pickle.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import xxhash

__all__ = [
    "BucketHeader",
    "SyncConfig",
    "SyncError",
    "SyncUnavailableError",
    "checksum",
    "flatten_bucket",
    "unflatten_bucket",
]


class SyncError(RuntimeError):
    """A weight sync failed; the engine kept its previous weights and version."""


class SyncUnavailableError(SyncError):
    """The transport cannot run on this machine (e.g. it needs a GPU)."""


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """The recipe's ``sync:`` section."""

    transport: Literal["inprocess", "broadcast", "disk", "ray", "cuda_ipc", "cupy_nccl"] = "inprocess"
    bucket_bytes: int = 256 * 1024 * 1024
    verify: bool = False  # debug: compare engine weights with the trainer's after each sync
    # broadcast: rendezvous of the dedicated gloo/NCCL group (trainer rank 0 + engine processes)
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 120.0
    # disk
    directory: str = ""
    delta: bool = False
    keep_versions: int = 2
    # LoRA: send merged full weights, or the adapter alone (to engines that load adapters)
    lora_mode: Literal["merged", "adapter"] = "merged"
    # quantize on send through tandem.kernels (e.g. "fp8_block"); None sends the trainer's dtype
    quantize: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} must be >= 1024")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
        if self.transport == "disk" and not self.directory:
            raise ValueError("transport 'disk' needs sync.directory")
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions={self.keep_versions} must be >= 1")


def _byte_view(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def checksum(tensors: Iterable[torch.Tensor] | torch.Tensor) -> int:
    """xxh3-64 over the raw bytes of one tensor or a sequence of tensors (in order)."""
    h = xxhash.xxh3_64()
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        h.update(_byte_view(t))
    return h.intdigest()


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, BucketHeader]:
    """One contiguous ``uint8`` buffer holding every tensor's bytes, and its header."""
    sizes = [t.numel() * t.element_size() for _, t in bucket]
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += -(-n // _ALIGN) * _ALIGN  # aligned, so every tensor can be viewed in place
    flat = torch.zeros(off, dtype=torch.uint8)
    for (_, t), o, n in zip(bucket, offsets, sizes, strict=True):
        if n:
            flat[o : o + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    header = BucketHeader(
        names=[name for name, _ in bucket],
        dtypes=[_dtype_name(t.dtype) for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
        offsets=offsets,
        nbytes=off,
        checksum=checksum(flat),
    )
    return flat, header


def unflatten_bucket(
    flat: torch.Tensor, header: BucketHeader, *, verify: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a flat bucket, as views of ``flat`` (no copy)."""
    if flat.numel() != header.nbytes:
        raise SyncError(f"bucket holds {flat.numel()} bytes, header says {header.nbytes}")
    if verify and checksum(flat) != header.checksum:
        raise SyncError(f"bucket checksum mismatch (first tensor {header.names[0]!r}): corrupted in transfer")
    for name, dt, shape, off in zip(header.names, header.dtypes, header.shapes, header.offsets, strict=True):
        dtype = getattr(torch, dt)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        yield name, flat[off : off + n].view(dtype).view(shape)


def bucketize(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group named tensors into buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
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
