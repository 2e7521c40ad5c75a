"""Megatron's model-parallel state: the process group, the TP/PP/EP/DP groups and this rank's place.

Megatron keeps its groups in module globals (``megatron.core.parallel_state``), so one process holds
one layout at a time. `init_model_parallel` reuses a layout that is already set up with the same
sizes and refuses a different one while an engine of the old layout may still be alive: call
`MegatronContext.close` (the engine's ``close``) first.

Without a process group (one plain process) a world-size-1 gloo group on a free local port is
created, because Megatron needs ``torch.distributed``; the last ``close`` destroys it again (contexts
are reference-counted: several engines of one layout may live in one process). Under torchrun
(``WORLD_SIZE > 1``) the default group is created with ``backend``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tandem.engines.training.common import pick_device

__all__ = ["MegatronContext", "init_model_parallel"]


@dataclass(kw_only=True, slots=True)
class MegatronContext:
    """Where this rank stands in the ``tp x pp x dp`` (and ``ep``) layout."""

    rank: int
    world_size: int
    device: torch.device
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    ep_size: int
    ep_rank: int
    dp_size: int
    dp_rank: int
    closed: bool = False
    groups: dict[str, Any] = field(default_factory=dict)  # tp, pp, dp, ep, etp, expert_dp, model, ...

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group: str = "world") -> torch.Tensor:
        """A reduced copy of ``t`` over ``group`` (``world``, ``dp``, ``tp``, ``pp``); ``op`` sum or max."""
        out = t.to(self.device).clone()
        pg = None if group == "world" else self.groups[group]
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=pg)
        return out.to(t.device)

    def all_gather_object(self, obj: Any, group: str = "world") -> list[Any]:
        pg = None if group == "world" else self.groups[group]
        out: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(out, obj, group=pg)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Release this context; the last one alive tears down Megatron's groups (and a process group
        that an engine created). Idempotent."""
        global _LAYOUT, _USERS, _OWNED_GROUP
        if self.closed:
            return
        self.closed = True
        _USERS -= 1
        if _USERS > 0:
            return
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        _LAYOUT = None
        if _OWNED_GROUP and dist.is_initialized():
            dist.destroy_process_group()
        _OWNED_GROUP = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_process_group(backend: str, device_preference: str) -> bool:
    """Join or create the default group; True when this call created it."""
    if dist.is_initialized():
        return False
    if backend == "auto":
        backend = "nccl" if device_preference != "cpu" and torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return True


def _check_sizes(tp: int, pp: int, ep: int, etp: int) -> None:
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"tensor_parallel x pipeline_parallel = {tp} x {pp} must divide the world size {world}"
        )
    dp = world // (tp * pp)
    if (dp * tp) % (ep * etp):
        raise ValueError(
            f"expert_parallel x expert_tensor_parallel = {ep} x {etp} must divide "
            f"data_parallel x tensor_parallel = {dp} x {tp}"
        )


def _current_layout() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )


_LAYOUT: tuple[int, int, int, int] | None = None  # (tp, pp, ep, etp) that parallel_state holds
_USERS = 0  # live contexts sharing that state (engines, reference models)
_OWNED_GROUP = False  # the default process group was created here (one plain process)


def init_model_parallel(
    *, tp: int, pp: int, ep: int, etp: int, backend: str = "auto", device: str = "auto"
) -> MegatronContext:
    """Set up (or reuse) Megatron's groups for ``tp x pp`` model parallelism and ``ep`` experts."""
    global _LAYOUT, _USERS, _OWNED_GROUP
    from megatron.core import parallel_state as ps

    _OWNED_GROUP = _ensure_process_group(backend, device) or _OWNED_GROUP
    try:
        _check_sizes(tp, pp, ep, etp)
        layout = (tp, pp, ep, etp)
        if ps.model_parallel_is_initialized():
            held = _LAYOUT or _current_layout()
            if held != layout:
                raise RuntimeError(
                    f"Megatron's parallel state already holds (tp, pp, ep, etp)={held}; close() the engine "
                    f"that uses it before building one with {layout}"
                )
        else:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
            )
            _LAYOUT = layout
    except BaseException:
        if _USERS == 0 and _OWNED_GROUP:  # do not leak the group this call created
            dist.destroy_process_group()
            _OWNED_GROUP = False
        raise
    _USERS += 1
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "expert_dp": ps.get_expert_data_parallel_group(),
        "model": ps.get_model_parallel_group(),  # tp x pp: one model replica
        "expert_model": ps.get_expert_tensor_model_pipeline_parallel_group(),  # etp x ep x pp
    }
    if pp > 1:
        groups["embedding"] = ps.get_embedding_group()
    return MegatronContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=pick_device(device),
        tp_size=tp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=pp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_size=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_size=dist.get_world_size() // (tp * pp),
        dp_rank=ps.get_data_parallel_rank(),
        groups=groups,
    )
