"""GPU transports: CUDA IPC handles (colocated processes) and cupy NCCL (across processes/nodes).

Both need CUDA; without it they raise `SyncUnavailableError` when constructed (never at import). They
follow the same rules as every transport (tandem/sync/base.py): buckets flattened into one buffer with
a JSON header and checksum, staged on the receiver, applied whole, one version per sync.

* `CudaIpcSender`/`CudaIpcReceiver`: the trainer flattens a bucket into a CUDA buffer and passes its
  IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) over an authenticated local
  connection; the receiver maps it, copies it into its staging buffer and acknowledges, after which the
  sender frees it. Zero host copies. The connection carries pickled handles between the two processes
  of one job, authenticated with a shared key; it binds 127.0.0.1.
* `CupyNcclSender`/`CupyNcclReceiver`: an NCCL communicator built with cupy (its unique id travels
  through a TCPStore) broadcasts each flat bucket; the control/header/commit protocol is the one of
  tandem/sync/broadcast.py.

These run only on a GPU machine: `bench/gpu/sync_gpu.py` exercises them there; CPU CI checks the
construction errors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Client, Listener

import torch

from tandem.sync.base import BucketHeader, SyncError, SyncUnavailableError, flatten_bucket, unflatten_bucket

__all__ = ["CudaIpcReceiver", "CudaIpcSender", "CupyNcclReceiver", "CupyNcclSender", "require_cuda"]

ApplyFn = Callable[[list[tuple[str, torch.Tensor]], int], None]


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


class CudaIpcSender:
    def __init__(self, *, address: tuple[str, int] = ("127.0.0.1", 0), authkey: bytes) -> None:
        require_cuda("transport 'cuda_ipc'")
        self.listener = Listener(address, authkey=authkey)
        self.address = self.listener.address
        self._conn = None

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        from torch.multiprocessing.reductions import reduce_tensor

        t0, nbytes = time.perf_counter(), 0
        if self._conn is None:
            self._conn = self.listener.accept()
        try:
            for bucket in buckets:
                flat, header = flatten_bucket([(n, t.detach().cpu()) for n, t in bucket])
                dev = flat.cuda()
                self._conn.send(("bucket", version, header.to_json(), reduce_tensor(dev)))
                if self._conn.recv() != ("ack", version):
                    raise SyncError("receiver did not acknowledge the bucket")
                nbytes += flat.numel()
                del dev
            self._conn.send(("commit", version, None, None))
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            self._conn = None
            raise SyncError(f"cuda_ipc sync to version {version} failed: the receiver went away ({e})") from e
        if reply[0] != "applied":
            raise SyncError(f"cuda_ipc sync to version {version} was not applied: {reply[1]}")
        dt = time.perf_counter() - t0
        return {"sync/bytes": float(nbytes), "sync/seconds": dt, "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self.listener.close()


class CudaIpcReceiver:
    def __init__(self, *, address: tuple[str, int], authkey: bytes) -> None:
        require_cuda("transport 'cuda_ipc'")
        self.conn = Client(address, authkey=authkey)

    def receive(self, apply: ApplyFn) -> int:
        staged: list[tuple[torch.Tensor, BucketHeader]] = []
        while True:
            kind, version, header, handle = self.conn.recv()
            if kind == "commit":
                break
            rebuild, args = handle
            dev = rebuild(*args)
            staged.append((dev.clone(), BucketHeader.from_json(header)))
            self.conn.send(("ack", version))
        try:
            named = [nt for flat, h in staged for nt in unflatten_bucket(flat.cpu(), h)]
            apply(named, version)
        except Exception as e:  # noqa: BLE001 - reported to the sender
            self.conn.send(("failed", f"{type(e).__name__}: {e}"))
            raise SyncError(f"sync to version {version} not applied: {e}") from e
        self.conn.send(("applied", None))
        return version


class CupyNcclSender:
    def __init__(
        self, *, num_receivers: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0
    ):
        self.cupy, self.nccl = _require_cupy_nccl("transport 'cupy_nccl'")
        import torch.distributed as dist

        self.store = dist.TCPStore(
            host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.port = self.store.port
        uid = self.nccl.get_unique_id()
        self.store.set("tandem-nccl/uid", json.dumps(list(uid)))
        self.comm = self.nccl.NcclCommunicator(num_receivers + 1, uid, 0)

    def _bcast(self, t: torch.Tensor) -> None:
        arr = self.cupy.asarray(t)
        self.comm.bcast(arr.data.ptr, arr.nbytes, self.nccl.NCCL_UINT8, 0, self.cupy.cuda.Stream.null.ptr)

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0, nbytes = time.perf_counter(), 0
        for bucket in buckets:
            flat, header = flatten_bucket([(n, t.detach().cpu()) for n, t in bucket])
            hdr = header.to_json().encode()
            ctrl = torch.tensor([version, len(hdr), flat.numel()], dtype=torch.int64).view(torch.uint8).cuda()
            self._bcast(ctrl)
            self._bcast(torch.frombuffer(bytearray(hdr), dtype=torch.uint8).cuda())
            self._bcast(flat.cuda())
            nbytes += flat.numel()
        self._bcast(torch.tensor([version, -1, 0], dtype=torch.int64).view(torch.uint8).cuda())
        torch.cuda.synchronize()
        key = f"tandem-nccl/applied/{version}"
        self.store.wait([key], timedelta(seconds=120))
        status = self.store.get(key).decode()
        if status != "ok":
            raise SyncError(f"cupy_nccl sync to version {version} was not applied: {status}")
        dt = time.perf_counter() - t0
        return {"sync/bytes": float(nbytes), "sync/seconds": dt, "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}

    def close(self) -> None:
        pass


class CupyNcclReceiver:
    def __init__(self, *, rank: int, num_receivers: int, host: str, port: int, timeout_s: float = 120.0):
        self.cupy, self.nccl = _require_cupy_nccl("transport 'cupy_nccl'")
        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        uid = tuple(json.loads(self.store.get("tandem-nccl/uid").decode()))
        self.comm = self.nccl.NcclCommunicator(num_receivers + 1, uid, rank)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        arr = self.cupy.asarray(t)
        self.comm.bcast(arr.data.ptr, arr.nbytes, self.nccl.NCCL_UINT8, 0, self.cupy.cuda.Stream.null.ptr)
        torch.cuda.synchronize()
        return t

    def receive(self, apply: ApplyFn) -> int:
        staged = []
        while True:
            ctrl = self._bcast(torch.empty(24, dtype=torch.uint8, device="cuda")).cpu().view(torch.int64)
            version, hdr_len, n = (int(x) for x in ctrl)
            if hdr_len < 0:
                break
            hdr = self._bcast(torch.empty(hdr_len, dtype=torch.uint8, device="cuda")).cpu()
            flat = self._bcast(torch.empty(n, dtype=torch.uint8, device="cuda")).cpu()
            staged.append((flat, BucketHeader.from_json(bytes(hdr.numpy()).decode())))
        try:
            apply([nt for flat, h in staged for nt in unflatten_bucket(flat, h)], version)
        except Exception as e:  # noqa: BLE001 - reported to the sender
            self.store.set(f"tandem-nccl/applied/{version}", f"{type(e).__name__}: {e}")
            raise SyncError(f"sync to version {version} not applied: {e}") from e
        self.store.set(f"tandem-nccl/applied/{version}", "ok")
        return version
