"""Gradient reduction across replicas and the global gradient norm, for one rank's Megatron parameters.

Megatron's own ``DistributedDataParallel`` (contiguous grad buffers) and ``finalize_model_grads`` are
CUDA-only (buffers on ``torch.cuda.current_device()``, CUDA streams), so the engine reduces gradients
itself, with the same rules:

* dense parameters are replicated over the data-parallel group: their gradients are *summed* there
  (Tandem's losses are already divided by the global normaliser, so the sum is the full-batch gradient);
* expert parameters are replicated over the expert-data-parallel group: summed there;
* with sequence parallelism, parameters Megatron marks ``sequence_parallel`` (norms, router) hold
  partial gradients on each TP rank: summed over the TP group;
* tied embeddings on several pipeline stages (the first stage's embedding, the last stage's output
  layer): summed over Megatron's embedding group.

The norm counts every logical element once: a TP-replicated tensor only on TP rank 0, then sums of
squares are added over the model-parallel group (dense) and the expert model-parallel group (experts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tandem.engines.training.megatron.convert import Rule

__all__ = ["all_reduce_grads", "global_grad_norm", "reduce_gradients"]


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_grads(grads: Sequence[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` in place, as one flat buffer per dtype."""
    if not grads or _group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            g.copy_(synced)


def reduce_gradients(
    params: Iterable[tuple[str, Rule, torch.nn.Parameter]],
    *,
    dp_group,
    expert_dp_group,
    tp_group,
    sequence_parallel: bool,
    embedding_group=None,
    tied_names: frozenset[str] = frozenset(),
) -> None:
    """Make every replica's ``.grad`` the sum over its replicas (see the module docstring)."""
    dense, expert, partial_tp, tied = [], [], [], []
    for name, rule, p in params:
        if p.grad is None:
            continue
        (expert if rule.expert else dense).append(p.grad)
        if sequence_parallel and getattr(p, "sequence_parallel", False):
            partial_tp.append(p.grad)
        if name in tied_names:
            tied.append(p.grad)
    all_reduce_grads(partial_tp, tp_group)
    all_reduce_grads(tied, embedding_group)
    all_reduce_grads(dense, dp_group)
    all_reduce_grads(expert, expert_dp_group)


def global_grad_norm(
    params: Iterable[tuple[str, Rule, torch.nn.Parameter]],
    *,
    tp_rank: int,
    etp_rank: int,
    model_group,
    expert_model_group,
    skip: frozenset[str] = frozenset(),
    device: torch.device,
) -> torch.Tensor:
    """L2 norm of the whole model's gradient, the same float64 scalar on every rank."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # dense, expert
    for name, rule, p in params:
        if p.grad is None or name in skip:
            continue
        owner_rank = etp_rank if rule.expert else tp_rank
        if rule.split == "replicated" and owner_rank != 0:
            continue
        sums[int(rule.expert)] += p.grad.detach().double().pow(2).sum()
    dense, expert = sums[:1].clone(), sums[1:].clone()
    if _group_size(model_group) > 1:
        dist.all_reduce(dense, group=model_group)
    if _group_size(expert_model_group) > 1:
        dist.all_reduce(expert, group=expert_model_group)
    return (dense + expert).sqrt().squeeze(0)
