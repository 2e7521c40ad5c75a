"""Ray object store transport: one flat buffer per bucket, zero-copy on the receiving side.

The sender ``ray.put``s each flattened bucket (a numpy ``uint8`` array, so a same-node ``ray.get`` maps
the shared-memory object instead of copying it) and calls each receiver actor's method with the
object refs (wrapped in a list, so Ray does not resolve them early), the JSON headers and the version.
The actor calls `receive_from_refs` with its engine's ``update_weights``; a receiver that raises or
dies fails the sync with `SyncError` and leaves its engine on the previous version.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from tandem.sync.base import BucketHeader, SyncError, flatten_bucket, unflatten_bucket

__all__ = ["RaySender", "receive_from_refs"]

ApplyFn = Callable[[list[tuple[str, torch.Tensor]], int], None]


def _ray():
    try:
        import ray
    except ImportError:
        raise SyncError("transport 'ray' needs Ray: pip install 'tandem-rl[ray]'") from None
    return ray


class RaySender:
    def __init__(self, receivers: Sequence[Any], *, method: str = "receive_weights") -> None:
        self.ray = _ray()
        if not receivers:
            raise ValueError("RaySender needs at least one receiver actor")
        self.receivers, self.method = list(receivers), method

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0, nbytes = time.perf_counter(), 0
        refs, headers = [], []
        for bucket in buckets:
            flat, header = flatten_bucket(bucket)
            refs.append(self.ray.put(flat.numpy()))
            headers.append(header.to_json())
            nbytes += flat.numel()
        calls = [getattr(r, self.method).remote([refs], headers, version) for r in self.receivers]
        try:
            self.ray.get(calls)
        except Exception as e:  # RayActorError, RayTaskError(...)
            raise SyncError(f"ray sync to version {version} failed: {type(e).__name__}: {e}") from e
        finally:
            del refs
        dt = time.perf_counter() - t0
        return {"sync/bytes": float(nbytes), "sync/seconds": dt, "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}

    def close(self) -> None:
        pass


def receive_from_refs(wrapped_refs: list[list[Any]], headers: list[str], version: int, apply: ApplyFn) -> int:
    """Receiver side, inside an actor: fetch (zero-copy), verify and apply one update."""
    ray = _ray()
    arrays = ray.get(wrapped_refs[0])
    named = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only shared memory: we only read it
        for arr, h in zip(arrays, headers, strict=True):
            named += list(unflatten_bucket(torch.from_numpy(arr), BucketHeader.from_json(h)))
    apply(named, version)
    return version
