"""Process group, device mesh, FSDP2 wrapping and the collectives the engine needs.

One process without a process group is a plain single-process run: no mesh, no sharding, and every
collective below degenerates to the identity, so the engine code has one path for all world sizes.

A process group that `init_distributed` created (torchrun without a group of the caller's) belongs to
the engines: contexts on it are counted and the last `DistContext.close` destroys it. A group the
caller created is never destroyed here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.engines.training.common import pick_device
from tandem.engines.training.fsdp.config import ParallelConfig
from tandem.models.registry import DTYPES

log = logging.getLogger(__name__)

__all__ = ["DistContext", "apply_fsdp", "enable_activation_checkpointing", "hint_bf16", "init_distributed", "visiting"]


@dataclass(kw_only=True, slots=True)
class DistContext:
    """Where this rank stands: ``mesh`` is ``None`` when running as one plain process."""

    rank: int
    world_size: int
    device: torch.device
    mesh: Any = None  # torch.distributed.DeviceMesh
    owns_group: bool = False  # on a group init_distributed created: counted in _USERS
    closed: bool = False

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A reduced copy of ``t`` (``op`` is ``sum`` or ``max``) over all data-parallel ranks."""
        if not self.sharded:
            return t.clone()
        out = t.to(self.device).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.to(t.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.sharded:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.sharded:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def close(self) -> None:
        """Release this context; the last one on a group that `init_distributed` created destroys the
        group. Idempotent."""
        global _USERS
        if self.closed:
            return
        self.closed = True
        if not self.owns_group:
            return
        _USERS -= 1
        if _USERS == 0 and _ours():
            dist.destroy_process_group()


_OWNED: Any = None  # the default process group init_distributed created (None: it created none)
_USERS = 0  # live contexts on that group


def _ours() -> bool:
    """Whether the current default group is the one init_distributed created."""
    return dist.is_initialized() and _OWNED is not None and dist.group.WORLD is _OWNED


def init_distributed(cfg: ParallelConfig, device_preference: str) -> DistContext:
    """Join (or create, under torchrun) the process group and build the data-parallel mesh.

    An existing default group is used as it is. Without one, ``WORLD_SIZE > 1`` in the environment
    (torchrun) creates it with ``cfg.backend`` (``auto``: NCCL on CUDA, gloo on CPU); otherwise the run
    is a single plain process. Close the context (`DistContext.close`) when the engine is done.
    """
    global _OWNED, _USERS
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if device_preference != "cpu" and torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        _OWNED, _USERS = dist.group.WORLD, 0
    owns = _ours()  # created just now, or joining the group an earlier engine created
    try:
        ctx = _context(cfg, device_preference)
    except BaseException:
        if owns and _USERS == 0:  # do not leak the group this call created
            dist.destroy_process_group()
        raise
    ctx.owns_group = owns
    _USERS += int(owns)
    return ctx


def _context(cfg: ParallelConfig, device_preference: str) -> DistContext:
    device = pick_device(device_preference)
    if not dist.is_initialized():
        if cfg.replicate != 1:
            raise ValueError(f"replicate={cfg.replicate} needs a process group of at least that many ranks")
        return DistContext(rank=0, world_size=1, device=device)
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cfg.replicate:
        raise ValueError(f"replicate={cfg.replicate} must divide the world size {world}")
    shard = world // cfg.replicate
    if cfg.replicate > 1:
        mesh = init_device_mesh(device.type, (cfg.replicate, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return DistContext(rank=rank, world_size=world, device=device, mesh=mesh)


def enable_activation_checkpointing(layers: Iterable[nn.Module]) -> None:
    """Recompute each layer's activations in backward instead of keeping them.

    The layer's ``forward`` is replaced on the instance (not wrapped in a new module) so parameter
    names stay HF names. Under FSDP2 the layer's pre-backward hook has re-gathered its parameters by
    the time the recomputation runs, as with torchtitan's wrapper applied before ``fully_shard``.
    """
    for layer in layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def apply_fsdp(
    root: nn.Module,
    layers: Sequence[nn.Module],
    ctx: DistContext,
    cfg: ParallelConfig,
    *,
    offload: bool = False,
    ignored: set[nn.Parameter] | None = None,
    after_shard: Callable[[nn.Module, torch.device], None] | None = None,
) -> None:
    """``fully_shard`` every layer, then the root (embeddings, final norm, LM head: tied stay tied).

    ``ignored``: parameters the root leaves alone (already sharded by fsdp/vocab_parallel.py).
    ``after_shard(module, device)``: called on each layer, then the root, right after it is sharded, with the
    device its shards live on (a deferred load reads the rank's rows of the module's meta weights there:
    fsdp/deferred.py).

    Gradients are *summed* over ranks, not averaged: Tandem's losses are already divided by the global
    normaliser (`LossScale`), so the sum over ranks is exactly the full-batch gradient.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype] if cfg.param_dtype else None,
        reduce_dtype=DTYPES[cfg.reduce_dtype] if cfg.reduce_dtype else None,
    )
    kw: dict[str, Any] = dict(mesh=ctx.mesh, mp_policy=mp)
    shards_on = ctx.device
    if (offload or cfg.cpu_offload) and ctx.device.type != "cpu":  # on a CPU device there is nowhere to go
        kw["offload_policy"] = CPUOffloadPolicy()
        shards_on = torch.device("cpu")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, **kw)
        if after_shard is not None:
            after_shard(layer, shards_on)
    fully_shard(root, ignored_params=ignored or None, **kw)
    if after_shard is not None:
        after_shard(root, shards_on)
    rings = cfg.ring_collectives and dist.get_backend(ctx.mesh.get_group("shard")) == "gloo"
    if rings:
        from tandem.engines.training.fsdp.ring_comms import RingAllGather, RingReduceScatter
    for m in root.modules():
        if isinstance(m, FSDPModule):
            # Divide by 1 with plain SUM collectives: gloo has no PREMUL_SUM, and NCCL's AVG would
            # average what the loss normalisation already made a global mean.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            if rings:
                m.set_custom_all_gather(RingAllGather())
                m.set_custom_reduce_scatter(RingReduceScatter())


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter; collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if not isinstance(t, DTensor):
        return t
    if t.device.type != device.type:  # CPU-offloaded shards: gather on the collective's device
        t = DTensor.from_local(
            t.to_local().to(device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return t.full_tensor()


def total_grad_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients (a plain scalar tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


@contextlib.contextmanager
def visiting(module: nn.Module, device: torch.device):
    """Bring a CPU-kept module to ``device`` for the enclosed forward, then back (no-op on CPU)."""
    if device.type == "cpu":
        yield
        return
    module.to(device)
    try:
        yield
    finally:
        module.to("cpu")


def hint_bf16(ctx: DistContext, param_dtype: str | None, model_dtype: str) -> None:
    """On a CPU with bf16 instructions, say once that fp32 training leaves ~1.4-1.9x on the table."""
    from tandem.ops.native import cpu_has_native_bf16

    if (ctx.device.type == "cpu" and ctx.is_main and param_dtype is None and model_dtype == "float32"
            and cpu_has_native_bf16()):
        log.info("this CPU has bf16 instructions: trainer.fsdp.parallel.param_dtype=bfloat16 trains ~1.4-1.9x "
                 "faster here, fp32 master weights kept, at the bf16 log-prob bound (docs/training.md)")
