"""GPU transports: CUDA IPC handles (colocated processes) and cupy NCCL (across processes/nodes).

Both need CUDA; without it they raise `SyncUnavailableError` when constructed (never at import). They
follow the rules of every transport (tandem/sync/base.py): each bucket is flattened into one GPU
buffer with a JSON header, staged on the receiver (on its GPU), applied whole through
`tandem.sync.apply.call_apply`, one version per sync, and the sender learns whether it was applied.
Bucket checksums need a device-to-host copy, so they are off by default here (``hash_buckets``);
device-to-device transfers do not corrupt bytes the way files and sockets can.

* `CudaIpcSender`/`CudaIpcReceiver`: the trainer flattens a bucket into a reused CUDA buffer and passes
  its IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) over an authenticated local
  connection; the receiver maps it, copies it into its staging buffer and acknowledges, after which
  the sender reuses the buffer. No host copies. The connection carries pickled handles between two
  processes of one job, authenticated with a shared key, bound to 127.0.0.1.
* `CupyNcclSender`/`CupyNcclReceiver`: an NCCL communicator built with cupy (its unique id travels
  through a TCPStore) broadcasts control words, headers and flat buckets; receivers report the result
  of applying in the store. For torch.distributed NCCL use `BroadcastSender(device="cuda")`.

NCCL needs one GPU per rank: two ranks on one device fail (NCCL "duplicate GPU"). These run only on a
GPU machine: tests/sync/test_gpu.py and `bench/gpu/sync_gpu.py` exercise them there; CPU CI checks
the construction errors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Client, Listener
from typing import Any

import torch

from tandem.sync.apply import call_apply
from tandem.sync.base import (
    BucketHeader,
    BufferPool,
    SyncError,
    SyncUnavailableError,
    flatten_bucket,
    sync_metrics,
    unflatten_bucket,
)

__all__ = ["CudaIpcReceiver", "CudaIpcSender", "CupyNcclReceiver", "CupyNcclSender", "require_cuda"]

ApplyFn = Callable[..., Any]


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise SyncUnavailableError(f"{what} needs a GPU (CUDA is not available on this machine)")


def _require_cupy_nccl(what: str):
    require_cuda(what)
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError:
        raise SyncUnavailableError(f"{what} needs cupy: pip install cupy-cuda12x") from None
    if not cupy.is_available() or not nccl.available:
        raise SyncUnavailableError(f"{what} needs a CUDA device and NCCL visible to cupy")
    return cupy, nccl


def _on_gpu(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().to(device, non_blocking=True)) for n, t in bucket]


class CudaIpcSender:
    """Trainer side of CUDA IPC; accepts one receiver at ``address`` (port 0 picks a free one)."""

    def __init__(
        self, *, address: tuple[str, int] = ("127.0.0.1", 0), authkey: bytes, hash_buckets: bool = False
    ) -> None:
        require_cuda("transport 'cuda_ipc'")
        self.listener = Listener(address, authkey=authkey)
        self.address = self.listener.address
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.hash_buckets = hash_buckets
        self._pool = BufferPool(self.device)
        self._conn = None

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        from torch.multiprocessing.reductions import reduce_tensor

        t0, nbytes = time.perf_counter(), 0
        if self._conn is None:
            self._conn = self.listener.accept()
        try:
            for bucket in buckets:
                flat, header = flatten_bucket(_on_gpu(bucket, self.device), self._pool, hashed=self.hash_buckets)
                torch.cuda.current_stream(self.device).synchronize()  # the bytes exist before the handle leaves
                self._conn.send(("bucket", version, header.to_json(), reduce_tensor(flat)))
                if self._conn.recv() != ("ack", version):  # the receiver copied it: the buffer is free again
                    raise SyncError("receiver did not acknowledge the bucket")
                nbytes += flat.numel()
            self._conn.send(("commit", version, None, None))
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            self._conn = None
            raise SyncError(f"cuda_ipc sync to version {version} failed: the receiver went away ({e})") from e
        if reply[0] != "applied":
            raise SyncError(f"cuda_ipc sync to version {version} was not applied: {reply[1]}")
        return sync_metrics(nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self.listener.close()
        self._pool.clear()


class CudaIpcReceiver:
    """Engine side of CUDA IPC: stages every bucket on its GPU, then applies the whole update."""

    def __init__(self, *, address: tuple[str, int], authkey: bytes) -> None:
        require_cuda("transport 'cuda_ipc'")
        self.conn = Client(address, authkey=authkey)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._pool = BufferPool(self.device)

    def receive(self, apply: ApplyFn) -> int:
        staged: list[tuple[torch.Tensor, BucketHeader]] = []
        while True:
            kind, version, header, handle = self.conn.recv()
            if kind == "commit":
                break
            rebuild, args = handle
            shared = rebuild(*args)
            flat = self._pool.get(len(staged), shared.numel())
            flat.copy_(shared)
            torch.cuda.current_stream(self.device).synchronize()
            del shared
            staged.append((flat, BucketHeader.from_json(header)))
            self.conn.send(("ack", version))
        try:
            named = [nt for flat, h in staged for nt in unflatten_bucket(flat, h)]
            call_apply(apply, named, version, verify=False)
        except Exception as e:  # noqa: BLE001 - reported to the sender, weights untouched
            self.conn.send(("failed", f"{type(e).__name__}: {e}"))
            raise SyncError(f"sync to version {version} not applied: {e}") from e
        self.conn.send(("applied", None))
        return version


class CupyNcclSender:
    """Trainer side of cupy NCCL (rank 0); hosts the TCPStore that carries the NCCL unique id."""

    def __init__(
        self, *, num_receivers: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0,
        hash_buckets: bool = False,
    ):
        self.cupy, self.nccl = _require_cupy_nccl("transport 'cupy_nccl'")
        import torch.distributed as dist

        self.store = dist.TCPStore(
            host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.port, self.timeout_s, self.num_receivers = self.store.port, timeout_s, num_receivers
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.hash_buckets = hash_buckets
        self._pool = BufferPool(self.device)
        uid = self.nccl.get_unique_id()
        self.store.set("tandem-nccl/uid", json.dumps(list(uid)))
        self.comm = self.nccl.NcclCommunicator(num_receivers + 1, uid, 0)

    def _bcast(self, t: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.comm.bcast(t.data_ptr(), t.numel() * t.element_size(), self.nccl.NCCL_UINT8, 0, stream)

    def _control(self, version: int, header_len: int, nbytes: int) -> None:
        self._bcast(torch.tensor([version, header_len, nbytes], dtype=torch.int64, device=self.device))

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0, nbytes = time.perf_counter(), 0
        for i, bucket in enumerate(buckets):
            flat, header = flatten_bucket(_on_gpu(bucket, self.device), self._pool, i % 2, hashed=self.hash_buckets)
            hdr = header.to_json().encode()
            self._control(version, len(hdr), flat.numel())
            self._bcast(torch.frombuffer(bytearray(hdr), dtype=torch.uint8).to(self.device))
            self._bcast(flat)  # same stream: the next flatten into this slot waits for it
            nbytes += flat.numel()
        self._control(version, -1, 0)
        torch.cuda.current_stream(self.device).synchronize()
        failures = []
        for r in range(1, self.num_receivers + 1):
            key = f"tandem-nccl/applied/{version}/{r}"
            self.store.wait([key], timedelta(seconds=self.timeout_s))
            status = self.store.get(key).decode()
            if status != "ok":
                failures.append(f"receiver {r}: {status}")
        if failures:
            raise SyncError(f"cupy_nccl sync to version {version} was not applied ({'; '.join(failures)})")
        return sync_metrics(nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.clear()


class CupyNcclReceiver:
    """Engine side of cupy NCCL (rank ``1..num_receivers``): stages on its GPU, applies whole."""

    def __init__(self, *, rank: int, num_receivers: int, host: str, port: int, timeout_s: float = 120.0):
        self.cupy, self.nccl = _require_cupy_nccl("transport 'cupy_nccl'")
        import torch.distributed as dist

        self.rank = rank
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._pool = BufferPool(self.device)
        uid = tuple(json.loads(self.store.get("tandem-nccl/uid").decode()))
        self.comm = self.nccl.NcclCommunicator(num_receivers + 1, uid, rank)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        stream = torch.cuda.current_stream(self.device)
        self.comm.bcast(t.data_ptr(), t.numel() * t.element_size(), self.nccl.NCCL_UINT8, 0, stream.cuda_stream)
        return t

    def receive(self, apply: ApplyFn) -> int:
        staged = []
        while True:
            ctrl = self._bcast(torch.empty(3, dtype=torch.int64, device=self.device))
            version, hdr_len, n = (int(x) for x in ctrl.tolist())  # .tolist() waits for the stream
            if hdr_len < 0:
                break
            hdr = self._bcast(torch.empty(hdr_len, dtype=torch.uint8, device=self.device)).cpu()
            flat = self._bcast(self._pool.get(len(staged), n))
            staged.append((flat, BucketHeader.from_json(bytes(hdr.numpy()).decode())))
        torch.cuda.current_stream(self.device).synchronize()
        key = f"tandem-nccl/applied/{version}/{self.rank}"
        try:
            call_apply(apply, [nt for flat, h in staged for nt in unflatten_bucket(flat, h)], version, verify=False)
        except Exception as e:  # noqa: BLE001 - reported to the sender
            self.store.set(key, f"{type(e).__name__}: {e}")
            raise SyncError(f"sync to version {version} not applied: {e}") from e
        self.store.set(key, "ok")
        return version
