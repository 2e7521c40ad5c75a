"""The process group under `tandem.sync.broadcast`: one generation of it (`_Group`: store prefix, gloo or NCCL
group, update counter) and the collective and store calls the sender and receivers make on it."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def _bcast(pg, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def _allreduce_min(pg, tensor: torch.Tensor):
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return pg.allreduce([tensor], opts)


def _new_pg(store: dist.Store, rank: int, size: int, timeout_s: float, device: torch.device, address: str):
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    wildcard = address in ("", "0.0.0.0", "::")  # sync.host asked for every interface
    opts._devices = [dist.ProcessGroupGloo.create_default_device() if wildcard
                     else dist.ProcessGroupGloo.create_device(hostname=address)]  # that interface only
    opts._threads = 2  # what the timeout-only constructor gives one device
    return dist.ProcessGroupGloo(store, rank, size, opts)


class _Group:
    """One generation of the group: its store prefix, process group and update counter."""

    def __init__(self, store: dist.Store, session: str, rank: int, size: int, timeout_s: float, device,
                 address: str) -> None:
        self.store = dist.PrefixStore(f"tandem-sync/{session}/", store)
        self.session = session
        self.pg = _new_pg(self.store, rank, size, timeout_s, device, address)
        self.seq = 0


def _status(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def _get(store: dist.Store, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None
