"""FSDP2's all-gather and reduce-scatter on CPU as point-to-point rings over gloo.

Gloo's own collectives cost memory and time that a CPU rank feels: its ``reduce_scatter_tensor`` clones
the whole input and all-reduces it (every rank moves and sums the full layer, then keeps its chunk), and
its ``all_gather_into_tensor`` stages the output in a buffer of its own. Measured on two gloo ranks, one
thread each, one SmolLM2-135M decoder layer in fp32 (13.5 MiB; bench/fsdp_collectives.py, docs/benchmarks.md):
reduce-scatter 14.5 ms and +30.5 MiB of resident high-water mark, as a ring 4.2 ms and +1.6 MiB; all-gather
8.8 ms and +15.3 MiB, as a ring 4.3 ms and +1.3 MiB; a world-2 training step 0.92-0.94x the time.

The rings here are the textbook ones (``world - 1`` steps; each step sends one chunk to the next rank and
receives one from the previous):

* reduce-scatter: the partial sum of chunk ``c`` starts at rank ``c + 1`` and travels the ring, each rank
  adding its own contribution, until it reaches rank ``c``; the last step receives straight into the
  output, so at world 2 there is no staging buffer at all. Partial sums accumulate in place in FSDP's
  copy-in buffer (``input_tensor``), which FSDP discards after the call.
* all-gather: each rank copies its shard into its slot of the output, then forwards the slot it received
  last; every chunk lands directly in its slot.

A sum of two values does not depend on their order, so at world 2 the reduced gradients are bit-identical
to gloo's; at larger worlds the summation order differs from gloo's ring all-reduce (a last-bit
difference, the same on every run). Only ``SUM`` is a ring here (Tandem's FSDP reduces with plain sums,
parallel.py); any other reduction goes to gloo's collective as before. The calls are synchronous (FSDP
issues its CPU collectives synchronously) and return ``None``, which FSDP reads as "already done".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # torch 2.13: only here

__all__ = ["RingAllGather", "RingReduceScatter", "ring_all_gather", "ring_reduce_scatter"]


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int, int, int]:
    """(world, rank in the group, global rank of the next rank, global rank of the previous one)."""
    world, rank = group.size(), group.rank()
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    return world, rank, nxt, prv


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group: dist.ProcessGroup) -> None:
    """Send ``send`` to ``nxt`` while receiving ``recv`` from ``prv``; returns when both are done."""
    works = [dist.isend(send, nxt, group=group), dist.irecv(recv, prv, group=group)]
    for w in works:
        w.wait()


def _split(whole: torch.Tensor, part: torch.Tensor, world: int, whole_name: str, part_name: str) -> torch.Tensor:
    """``whole`` as ``[world, n]`` chunks, checked to split evenly and to match ``part`` (one chunk's worth)."""
    if not whole.is_contiguous() or whole.numel() % world:
        raise ValueError(f"{whole_name}: {whole.numel()} elements (contiguous={whole.is_contiguous()}) do not "
                         f"split into {world} equal contiguous chunks")
    chunks = whole.view(world, -1)
    if part.numel() != chunks.shape[1] or part.dtype != whole.dtype:
        raise ValueError(f"{part_name}: {part.numel()} x {part.dtype}, expected {chunks.shape[1]} x {whole.dtype} "
                         f"({whole_name} / world {world})")
    return chunks


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` = this rank's chunk of the sum of every rank's ``input`` (``input`` is overwritten)."""
    world, rank, nxt, prv = _neighbours(group)
    chunks = _split(input, output, world, "reduce-scatter input", "reduce-scatter output")
    if world == 1:
        output.view(-1).copy_(chunks[0])
        return
    staging = None
    for step in range(world - 1):
        send = chunks[(rank - 1 - step) % world]  # the partial sum of that chunk (at step 0: our own)
        target = (rank - 2 - step) % world  # the chunk whose partial sum arrives
        last = step == world - 2  # its sum is complete once ours is added: it is our chunk
        if last:
            recv = output.view(-1)
        else:
            if staging is None:
                staging = torch.empty_like(chunks[0])
            recv = staging
        _exchange(send, recv, nxt, prv, group)
        if last:
            recv.add_(chunks[target])
        else:
            chunks[target].add_(recv)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` = every rank's ``input``, concatenated in rank order."""
    world, rank, nxt, prv = _neighbours(group)
    chunks = _split(output, input, world, "all-gather output", "all-gather input")
    if chunks[rank].data_ptr() != input.data_ptr():  # FSDP's copy-in already wrote it in place
        chunks[rank].copy_(input.view(-1))
    for step in range(world - 1):
        _exchange(chunks[(rank - step) % world], chunks[(rank - step - 1) % world], nxt, prv, group)


class _Alloc:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RingAllGather(_Alloc, AllGather):
    """FSDP2 custom all-gather (``FSDPModule.set_custom_all_gather``): `ring_all_gather`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        ring_all_gather(output_tensor, input_tensor, group)


class RingReduceScatter(_Alloc, ReduceScatter):
    """FSDP2 custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``): `ring_reduce_scatter` for
    ``SUM``, gloo's collective for any other reduction."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        ring_reduce_scatter(output_tensor, input_tensor, group)
        return None
