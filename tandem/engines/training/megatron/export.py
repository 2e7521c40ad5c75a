"""The policy's weights as HF-named full tensors, gathered from tensor, pipeline and expert shards.

Collective: every rank walks the same list of parameters (`convert.rules`) in the same order. For each
one, the ranks that hold it (its pipeline stage, and for an expert its expert-parallel rank) gather the
tensor-parallel slices into the full Megatron tensor; broadcasts then hand it to the other expert ranks
and pipeline stages, so every rank ends up with every tensor (a sync that sends from rank 0 ignores the
copies elsewhere). The full tensor is split back into HF tensors (`convert.from_megatron`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from tandem.engines.training.megatron import convert
from tandem.engines.training.megatron.model import BuiltModel
from tandem.engines.training.megatron.parallel import MegatronContext

__all__ = ["hf_tensors", "owner_stage"]


def owner_stage(rule: convert.Rule, num_layers: int, pp_size: int) -> int:
    """The pipeline stage that holds ``rule``'s parameter (layers split evenly over stages)."""
    name = rule.megatron
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (num_layers // pp_size)
    return pp_size - 1  # final norm, output layer


def _owner_expert_rank(rule: convert.Rule, num_experts: int, ep_size: int) -> int:
    expert = int(rule.megatron.split(".local_experts.")[1].split(".")[0])
    return expert // (num_experts // ep_size)


def _gather_tp(rule: convert.Rule, local: torch.Tensor, ctx: MegatronContext) -> torch.Tensor:
    group = ctx.groups["etp"] if rule.expert else ctx.groups["tp"]
    size = dist.get_world_size(group)
    if rule.split == "replicated" or size == 1:
        return local.detach()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    return convert.unshard(rule, shards)


def _broadcast(t: torch.Tensor, group, src_group_rank: int) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.broadcast(t, src=dist.get_global_rank(group, src_group_rank), group=group)
    return t


@torch.no_grad()
def hf_tensors(
    built: BuiltModel, ctx: MegatronContext, dtype: torch.dtype, *, rules: list[convert.Rule] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor in dtype)`` for the whole model, on every rank (collective).

    Megatron keeps its norms in fp32 under a bf16 model; everything leaves in the model's ``dtype``,
    as in its HF checkpoint. ``rules``: these parameters instead of the model's (LoRA adapters: peft names).
    """
    local = {name: p for name, _, p in built.local_params()}
    layout = built.layout
    for rule in convert.rules(layout) if rules is None else rules:
        stage = owner_stage(rule, layout.num_layers, ctx.pp_size)
        expert_rank = _owner_expert_rank(rule, layout.num_experts, ctx.ep_size) if rule.expert else None
        on_stage = ctx.pp_rank == stage
        full = None
        if on_stage and (expert_rank is None or ctx.ep_rank == expert_rank):
            full = _gather_tp(rule, local[rule.megatron], ctx).to(dtype)
        if full is None:
            full = torch.empty(built.full_shapes[rule.megatron], dtype=dtype, device=ctx.device)
        if expert_rank is not None and on_stage:
            full = _broadcast(full.contiguous(), ctx.groups["ep"], expert_rank)
        if ctx.pp_size > 1:
            full = _broadcast(full.contiguous(), ctx.groups["pp"], stage)
        for name, t in convert.from_megatron(rule, layout, full):
            yield name, t.contiguous()
