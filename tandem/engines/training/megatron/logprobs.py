"""Temperature-scaled log-probs and entropy over a vocabulary split across tensor-parallel ranks.

Each TP rank holds the logits of its vocabulary slice, ``z_local [M, V_local]`` (Megatron's
``parallel_output``); the full ``[M, V]`` logits never exist on one rank. With ``z = logits / T``
(float32) and three all-reduces over the TP group (a max, then one summed ``[3, M]`` tensor)::

    lse        = max + log(sum_v exp(z_v - max))
    log p(t)   = z_t - lse                       (z_t lives on exactly one rank; the others add 0)
    entropy    = -sum_v p_v (z_v - lse)

This is the standard vocab-parallel cross entropy (Megatron's ``vocab_parallel_cross_entropy``, the
Megatron-LM paper, Shoeybi et al. 2019) extended by the entropy term. The backward needs no
communication: with the global ``lse`` each rank owns its columns of ``softmax(z)``::

    d log p(t) / dz = onehot(t) - p
    d H / dz        = -p * (log p + H)

Columns past the real vocabulary (Megatron pads it to a multiple of the TP size) are excluded, so the
result equals a log-softmax over exactly the HF vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs"]


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _stats(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, group, with_entropy: bool):
    """``(log_probs [M], entropy [M] | None, lse [M])`` of the local logits ``z [M, V_local]``."""
    m = z.shape[0]
    local_max = z.max(dim=-1).values if z.shape[1] else z.new_full((m,), float("-inf"))
    gmax = _all_reduce(local_max.clone(), group, dist.ReduceOp.MAX)
    shifted = z - gmax[:, None]
    exp = shifted.exp()
    local_t = targets - vocab_start
    own = (local_t >= 0) & (local_t < z.shape[1])
    target_z = torch.where(
        own, shifted.gather(-1, local_t.clamp(0, max(z.shape[1] - 1, 0))[:, None]).squeeze(-1), 0.0
    )
    sums = torch.stack([exp.sum(-1), target_z, (exp * shifted).sum(-1)])  # [3, M]
    _all_reduce(sums, group)
    log_sum = sums[0].log()
    lse = gmax + log_sum
    logp = sums[1] - log_sum
    # H = log S - sum(e * s) / S with s = z - max, e = exp(s), S = sum(e)
    ent = log_sum - sums[2] / sums[0] if with_entropy else None
    return logp, ent, lse


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, targets, vocab_start, group, with_entropy):
        logp, ent, lse = _stats(z, targets, vocab_start, group, with_entropy)
        ctx.save_for_backward(z, targets, lse, *([ent] if with_entropy else []))
        ctx.vocab_start, ctx.with_entropy = vocab_start, with_entropy
        return logp, (ent if with_entropy else logp.new_zeros(0))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        z, targets, lse, *rest = ctx.saved_tensors
        logp_all = z - lse[:, None]
        p = logp_all.exp()
        gz = -p * g_logp[:, None]
        local_t = targets - ctx.vocab_start
        own = (local_t >= 0) & (local_t < z.shape[1])
        rows = own.nonzero(as_tuple=True)[0]
        gz[rows, local_t[rows]] += g_logp[rows]
        if ctx.with_entropy and g_ent.numel():
            ent = rest[0]
            gz -= g_ent[:, None] * p * (logp_all + ent[:, None])
        return gz, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    group=None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets [M]`` (global ids) and optionally entropy, float32 ``[M]`` each.

    ``logits [M, V_local]`` are this rank's vocabulary slice, starting at global id ``vocab_start``;
    ``vocab_size`` is the real (unpadded) vocabulary. ``temperature == 0`` means 1 (greedy log-probs
    are those of the unscaled softmax). Differentiable in ``logits``; collective over ``group``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [M, V_local] with targets [M], got {tuple(targets.shape)}"
        )
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    real = max(0, min(logits.shape[1], vocab_size - vocab_start))
    z = logits[:, :real].float()
    if temperature not in (0.0, 1.0):
        z = z / temperature
    if not torch.is_grad_enabled() or not z.requires_grad:
        with torch.no_grad():
            logp, ent, _ = _stats(z, targets, vocab_start, group, with_entropy)
        return logp, ent
    logp, ent = _VocabParallelLogProbs.apply(z, targets, vocab_start, group, with_entropy)
    return logp, (ent if with_entropy else None)
