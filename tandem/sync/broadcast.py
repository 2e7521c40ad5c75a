"""torch.distributed broadcast: trainer rank 0 -> engine processes, in a dedicated process group.

The group is separate from the trainer's own (FSDP) group: a `TCPStore` hosted by the sender plus a
gloo `ProcessGroupGloo` (NCCL on GPU follows the same protocol with CUDA buffers). Per sync the sender
streams buckets; for each it broadcasts a control word, a JSON header and the flat bucket. The next
bucket is prepared (gathered from shards, flattened) while the current one is on the wire.

Control words (int64 ``[magic, version, kind, n]``): ``kind >= 0`` a bucket whose header has ``kind``
bytes and whose body has ``n`` bytes; ``COMMIT`` ends an update; ``ABORT`` cancels it (the sender's
producer failed). After ``COMMIT`` every receiver checks checksums, applies the staged update, and
all-reduces a status (MIN): the sender learns that every engine applied it, or raises `SyncError`
with the receivers' reasons (they post them in the store). A failed update is never half-applied.

If a peer dies the group breaks: the sender raises `SyncError` and the next `send` re-forms the group
(a new *generation*, under a fresh store prefix), waiting for receivers to reconnect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.sync.base import BucketHeader, SyncError, flatten_bucket, unflatten_bucket

__all__ = ["BroadcastReceiver", "BroadcastSender"]

log = logging.getLogger(__name__)

MAGIC = 0x54414E44  # "TAND"
COMMIT, ABORT = -1, -2
ApplyFn = Callable[[list[tuple[str, torch.Tensor]], int], None]


def _bcast(pg, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def _allreduce_min(pg, tensor: torch.Tensor) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    pg.allreduce([tensor], opts).wait()


class _Group:
    """A gloo group of one sender (rank 0) and ``num_receivers`` receivers, for one generation."""

    def __init__(self, store: dist.Store, generation: int, rank: int, size: int, timeout_s: float) -> None:
        prefixed = dist.PrefixStore(f"tandem-sync/g{generation}/", store)
        self.store = prefixed
        self.generation = generation
        self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))


class BroadcastSender:
    """Trainer side. Hosts the rendezvous store on ``host:port`` (port 0 picks a free one)."""

    def __init__(
        self, *, num_receivers: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0
    ):
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be >= 1")
        self.num_receivers, self.timeout_s = num_receivers, timeout_s
        self.store = dist.TCPStore(
            host,
            port,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self.host, self.port = host, self.store.port
        self._generation = 0
        self._group: _Group | None = None

    def _connect(self) -> _Group:
        if self._group is None:
            self._generation += 1
            self.store.set("tandem-sync/generation", str(self._generation))
            self._group = _Group(self.store, self._generation, 0, self.num_receivers + 1, self.timeout_s)
        return self._group

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Stream ``buckets`` to every receiver as update ``version``; raise `SyncError` on failure."""
        t0 = time.perf_counter()
        nbytes = 0
        try:
            group = self._connect()
            pending: list = []  # (work, buffer): the buffer must live until its broadcast completed
            it = iter(buckets)
            while True:
                try:
                    bucket = next(it)
                except StopIteration:
                    break
                except Exception:
                    self._control(group, version, ABORT, 0)
                    raise
                flat, header = flatten_bucket(bucket)
                hdr = torch.frombuffer(bytearray(header.to_json().encode()), dtype=torch.uint8)
                for work, _buf in pending:
                    work.wait()
                self._control(group, version, hdr.numel(), flat.numel())
                _bcast(group.pg, hdr).wait()
                pending = [(_bcast(group.pg, flat), flat)]
                nbytes += flat.numel()
            for work, _buf in pending:
                work.wait()
            self._control(group, version, COMMIT, 0)
            status = torch.ones(1, dtype=torch.int64)
            _allreduce_min(group.pg, status)
        except SyncError:
            raise
        except Exception as e:
            self._group = None  # the group is broken; the next send re-forms it
            raise SyncError(f"broadcast sync to version {version} failed: {type(e).__name__}: {e}") from e
        if int(status.item()) != 1:
            reasons = []
            for r in range(1, self.num_receivers + 1):
                key = f"error/{version}/{r}"
                if group.store.check([key]):
                    reasons.append(f"receiver {r}: {group.store.get(key).decode()}")
            raise SyncError(
                f"sync to version {version} was not applied ({'; '.join(reasons) or 'no reason given'})"
            )
        dt = time.perf_counter() - t0
        return {"sync/bytes": float(nbytes), "sync/seconds": dt, "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}

    @staticmethod
    def _control(group: _Group, version: int, kind: int, n: int) -> None:
        _bcast(group.pg, torch.tensor([MAGIC, version, kind, n], dtype=torch.int64)).wait()

    def close(self) -> None:
        self._group = None


class BroadcastReceiver:
    """Engine side: joins the sender's store, receives whole updates and applies them."""

    def __init__(self, *, rank: int, num_receivers: int, host: str, port: int, timeout_s: float = 120.0):
        if not 1 <= rank <= num_receivers:
            raise ValueError(f"receiver rank={rank} must be in [1, {num_receivers}]")
        self.rank, self.size, self.timeout_s = rank, num_receivers + 1, timeout_s
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self._group: _Group | None = None
        self._seen_generation = 0
        self.corrupt_next_bucket = False  # fault injection for tests: flip a byte after receiving

    def _connect(self) -> _Group:
        if self._group is None:
            deadline = time.monotonic() + self.timeout_s
            while True:
                gen = int(self.store.get("tandem-sync/generation").decode())
                if gen > self._seen_generation:
                    break
                if time.monotonic() > deadline:
                    raise SyncError("timed out waiting for the sender to re-form the sync group")
                time.sleep(0.05)
            self._seen_generation = gen
            self._group = _Group(self.store, gen, self.rank, self.size, self.timeout_s)
        return self._group

    def receive(self, apply: ApplyFn) -> int:
        """Block until one update arrives; stage, verify and ``apply(named_tensors, version)`` it.

        Returns the applied version. On a failed update (bad checksum, apply raised) the engine keeps
        its weights, the sender is told why, and the next update can succeed; if the group broke,
        raises `SyncError` and the next call reconnects.
        """
        group = self._connect()
        staged: list[tuple[torch.Tensor, BucketHeader]] = []
        try:
            while True:
                ctrl = torch.empty(4, dtype=torch.int64)
                _bcast(group.pg, ctrl).wait()
                magic, version, kind, n = (int(x) for x in ctrl)
                if magic != MAGIC:
                    raise SyncError(f"bad control word {ctrl.tolist()}: not a Tandem sync stream")
                if kind == ABORT:
                    staged = []
                    log.warning("sync to version %d aborted by the sender; weights unchanged", version)
                    continue
                if kind == COMMIT:
                    break
                hdr = torch.empty(kind, dtype=torch.uint8)
                _bcast(group.pg, hdr).wait()
                flat = torch.empty(n, dtype=torch.uint8)
                _bcast(group.pg, flat).wait()
                if self.corrupt_next_bucket:
                    flat[0] ^= 0xFF
                    self.corrupt_next_bucket = False
                staged.append((flat, BucketHeader.from_json(bytes(hdr.numpy()).decode())))
        except SyncError:
            self._group = None
            raise
        except Exception as e:
            self._group = None
            raise SyncError(f"sync receive failed: {type(e).__name__}: {e}") from e
        ok = 1
        try:
            named = [nt for flat, header in staged for nt in unflatten_bucket(flat, header, verify=True)]
            apply(named, version)
        except Exception as e:  # noqa: BLE001 - reported to the sender, weights untouched
            ok = 0
            group.store.set(f"error/{version}/{self.rank}", f"{type(e).__name__}: {e}")
            log.error("sync to version %d not applied: %s", version, e)
        status = torch.tensor([ok], dtype=torch.int64)
        _allreduce_min(group.pg, status)
        if not ok:
            raise SyncError(
                f"sync to version {version} was not applied: {group.store.get(f'error/{version}/{self.rank}').decode()}"
            )
        return version

    def close(self) -> None:
        self._group = None
