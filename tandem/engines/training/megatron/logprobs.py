"""Temperature-scaled log-probs and entropy from the last hidden states, over a vocabulary split across
tensor-parallel ranks, ``chunk`` rows of logits at a time.

Each TP rank holds the output layer's rows of its vocabulary slice, ``W_local [V_local, h]`` (Megatron's
``parallel_output``); the full ``[M, V]`` logits never exist on one rank, and of the local ones at most
``chunk x V_local`` exist at a time: the backward recomputes each chunk's logits (as the FSDP engine's head,
tandem/models/logprobs.py) instead of holding ``[M, V_local]`` float32 several times over (logits, their
exponentials, the softmax and gradient). With ``z = h W_local^T / T`` (float32), each rank keeps every row's
local maximum, exponential sum and target logit, and two all-reduces over the TP group for all rows (a max,
then one summed tensor of the sums rescaled to the global max; `slice_stats`, shared with the FSDP engine's
vocabulary-parallel head) give::

    lse        = max + log(sum_v exp(z_v - max))
    log p(t)   = z_t - lse                       (z_t lives on exactly one rank; the others add 0)
    entropy    = -sum_v p_v (z_v - lse)

This is the standard vocab-parallel cross entropy (Megatron's ``vocab_parallel_cross_entropy``, the
Megatron-LM paper, Shoeybi et al. 2019) extended by the entropy term. The backward needs no
communication of its own: with the global ``lse`` each rank owns its columns of ``softmax(z)``::

    d log p(t) / dz = onehot(t) - p
    d H / dz        = -p * (log p + H)

and the hidden states' gradient, a partial sum per vocabulary slice, is summed over the TP ranks by
``copy_to_tensor_model_parallel_region`` (as in Megatron's ``ColumnParallelLinear``), or under sequence
parallelism by the backward of the sequence gather that produced the hidden states (pipeline.py).

Rows past the real vocabulary (Megatron pads it to a multiple of the TP size) are excluded, so the
result equals a log-softmax over exactly the HF vocabulary. With one TP rank `head_logprobs` *is* the FSDP
engine's head (`token_logprobs`): the same bits for the same hidden states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.models.logprobs import slice_grads, slice_stats, token_logprobs

__all__ = ["head_logprobs"]


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, temperature, chunk, group, with_entropy):
        logp, ent, lse = slice_stats(hidden, weight, targets, vocab_start, temperature, chunk, with_entropy, group)
        ctx.save_for_backward(hidden, weight, targets, lse, *([ent] if with_entropy else []))
        ctx.vocab_start, ctx.temperature, ctx.chunk, ctx.with_entropy = vocab_start, temperature, chunk, with_entropy
        return logp, (ent if with_entropy else logp.new_zeros(0))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        ent = rest[0] if ctx.with_entropy and g_ent.numel() else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_hidden = slice_grads(hidden, weight, targets, ctx.vocab_start, lse, g_logp.float(), ctx.temperature,
                               ctx.chunk, g_ent=g_ent.float() if ent is not None else None, ent=ent, g_weight=g_weight)
        g_w = g_weight.to(weight.dtype) if need_w else None
        return (g_hidden.to(hidden.dtype) if need_h else None), g_w, None, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    group=None,
    with_entropy: bool = False,
    chunk: int = 256,
    sum_hidden_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets [M]`` (global ids), and optionally entropy, from the last hidden states.

    ``hidden [M, H]`` at the positions that predict ``targets``; ``weight [V_local, H]`` is this rank's
    slice of the output layer (padded rows included), starting at global id ``vocab_start``;
    ``vocab_size`` is the real vocabulary. At most ``chunk`` rows of logits exist at a time (forward and
    backward). Differentiable in ``hidden`` and ``weight``; collective over ``group`` (the TP group).
    ``sum_hidden_grad=False``: the caller sums the hidden states' gradient over the group itself (sequence
    parallelism's gather).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [M, H], weight {tuple(weight.shape)} [V_local, H] and "
            f"targets [M], got {tuple(targets.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    temperature = 1.0 if temperature == 0 else float(temperature)
    real = max(0, min(weight.shape[0], vocab_size - vocab_start))
    w = weight[:real] if real < weight.shape[0] else weight
    if group is None or dist.get_world_size(group) == 1:
        return token_logprobs(
            hidden, w, targets, temperature=temperature, chunk_size=chunk, with_entropy=with_entropy
        )
    if not torch.is_grad_enabled() or not (hidden.requires_grad or w.requires_grad):
        with torch.no_grad():
            logp, ent, _ = slice_stats(hidden, w, targets, vocab_start, temperature, chunk, with_entropy, group)
        return logp, ent
    if hidden.requires_grad and sum_hidden_grad:  # each rank's slice adds to the hidden states' gradient
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    logp, ent = _ChunkedHead.apply(hidden, w, targets, vocab_start, temperature, chunk, group, with_entropy)
    return logp, (ent if with_entropy else None)
