"""Log-probs (and entropy) of target tokens without materialising full-vocabulary logits.

``log p(target) = z[target] - logsumexp(z)`` with ``z = (hidden @ W^T) / temperature`` in float32. The
vocabulary projection is computed one chunk of rows at a time; with autograd, the backward pass
recomputes each chunk's logits instead of keeping them, so memory stays at ``chunk x vocab`` floats
whatever the number of tokens (peak ~ one chunk's logits, updated in place into their gradient; two
buffers with entropy).

Gradients (``p = softmax(z)``, ``H = -sum p log p``)::

    d log p(t) / dz = onehot(t) - p
    d H / dz        = -p * (log p + H)

A model whose input embedding is the same tensor as this projection (tied weights) can pass a
`TiedGrad`: the backward then leaves its ``[V, H]`` weight gradient in it instead of returning it, and
the embedding's backward (`tied_embedding`, which runs last) adds its rows into that buffer in place and
returns it. Autograd would otherwise hold the projection's dense gradient through the whole backward,
allocate a second dense one for the embedding and a third for their sum: 3 x 108 MiB for SmolLM2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "TiedGrad", "chunk_logits", "logits_grad_", "logprobs_from_hidden", "logsumexp_", "slice_grads", "slice_stats",
    "tied_embedding", "token_logprobs",
]


class TiedGrad:
    """One forward's slot for the tied weight's gradient (see the module docstring)."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, sink):
        ctx.save_for_backward(ids)
        ctx.sink, ctx.shape, ctx.dtype = sink, weight.shape, weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        g, ctx.sink.grad = ctx.sink.grad, None
        if g is None:  # the projection's backward did not run (its output got no gradient)
            g = torch.zeros(ctx.shape, dtype=torch.float32, device=grad.device)
        g.index_add_(0, ids.reshape(-1), grad.reshape(-1, ctx.shape[1]).to(g.dtype))
        return None, g.to(ctx.dtype), None


def tied_embedding(ids: torch.Tensor, weight: torch.Tensor, sink: TiedGrad) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose weight gradient is accumulated into the buffer ``token_logprobs``
    left in ``sink`` (pass the same `TiedGrad` to both, for one forward)."""
    return _TiedEmbedding.apply(ids, weight, sink)


def logsumexp_(z: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(z, -1)`` with the same bits (ATen's CPU formula: ``m + log(sum(exp(z - m)))``, an
    infinite max taken as 0), computed in ``z``, which it consumes: no ``[n, V]`` temporary (tested
    against ``torch.logsumexp``)."""
    m = z.amax(-1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0)
    return z.sub_(m).exp_().sum(-1).log_().add_(m.squeeze(-1))


def _chunk_stats(h, weight, targets, temperature, with_entropy):
    """The one formula every engine uses for returned log-probs (F.linear so invariant modes apply):
    ``(log p [n], entropy [n] or None, logsumexp [n])``. One ``[n, V]`` buffer without entropy, two with (the
    head runs at the end of a training forward, while every activation is held)."""
    z = F.linear(h, weight).float()
    if temperature != 1.0:
        z.div_(temperature)  # z is F.linear's fresh output: in place, the same bits as z / temperature
    z_target = z.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        lse = logsumexp_(z)
        return z_target - lse, None, lse
    lse = logsumexp_(z.clone())
    logp_all = z.sub_(lse[:, None])  # -sum p log p loses less to cancellation than lse - sum p z
    ent = -logp_all.exp().mul_(logp_all).sum(-1)
    return z_target - lse, ent, lse


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``F.linear(h, weight) / temperature`` in float32, a fresh tensor (a backward updates it in place)."""
    z = F.linear(h, weight).float()
    return z.div_(temperature) if temperature != 1.0 else z


def logits_grad_(
    logp_all: torch.Tensor,
    g_logp: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    g_ent: torch.Tensor | None = None,
    ent: torch.Tensor | None = None,
    in_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss gradient at the logits ``z`` of one chunk, computed in place in ``logp_all`` (``[n, V]``
    log-softmax, consumed): ``g_logp (onehot(t) - p) - g_ent p (log p + H)``, divided by the temperature.
    One ``[n, V]`` buffer (two with entropy), not four. ``in_rows`` (bool ``[n]``): which targets lie in these
    columns (a vocabulary slice; ``targets`` are then column indices, clamped)."""
    g = g_logp[:, None].float()
    if g_ent is not None:
        p = logp_all.exp()
        gz = logp_all.add_(ent[:, None]).mul_(-g_ent[:, None].float()).sub_(g).mul_(p)
        del p
    else:
        gz = logp_all.exp_().mul_(-g)
    gz.scatter_add_(-1, targets[:, None], g if in_rows is None else g * in_rows[:, None])
    return gz.div_(temperature) if temperature != 1.0 else gz


def _target_columns(targets: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(column [n], inside [n] bool)``: a target's column in the slice ``[start, start + rows)``, clamped where
    it lies outside."""
    col = targets - start
    inside = (col >= 0) & (col < rows)
    return col.clamp(0, max(rows - 1, 0)), inside


def slice_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    group,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(log p [n], entropy [n] or None, logsumexp [n])`` of ``targets`` (global ids) under a vocabulary split
    into slices over a group of ranks, every rank holding the same ``hidden [n, H]`` and its rows ``weight`` of
    the projection, ids ``[start, start + rows)``. Collective over the process ``group``: two all-reduces
    whatever ``n`` (a max, then a sum): each chunk's maximum,
    exponential sum, target logit and ``sum e log e`` are kept per rank and combined at the end (each rank's
    sums rescaled to the global maximum), so the chunks take no collective of their own."""
    n, rows = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    m, s, zt, a = (torch.zeros(n, **f32) for _ in range(4))
    for i in range(0, n, chunk):
        z = chunk_logits(hidden[i : i + chunk], weight, temperature)
        mi = z.max(-1).values if rows else torch.full((z.shape[0],), float("-inf"), **f32)
        col, inside = _target_columns(targets[i : i + chunk], start, rows)
        zt[i : i + chunk] = torch.where(inside, z.gather(-1, col[:, None]).squeeze(-1), 0.0) if rows else 0.0
        e = z.sub_(mi[:, None]).exp_()  # in place: e = exp(z - m), the one [chunk, rows] buffer
        m[i : i + chunk], s[i : i + chunk] = mi, e.sum(-1)
        if with_entropy:  # sum e (z - m) = sum e log e: bounded by the logits' spread, not their level
            a[i : i + chunk] = e.xlogy_(e).sum(-1)
        del z, e
    gm = m.clone()
    dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(m - gm)
    parts = [s * scale, zt] + ([scale * (a + (m - gm) * s)] if with_entropy else [])
    total = torch.stack(parts)
    dist.all_reduce(total, group=group)
    lse = gm + torch.log(total[0])
    logp = total[1] - lse
    # entropy = lse - sum p z = log S - sum_r scale_r (a_r + (m_r - gm) s_r) / S: no large terms cancel
    ent = torch.log(total[0]) - total[2] / total[0] if with_entropy else None
    return logp, ent, lse


def slice_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    lse: torch.Tensor,
    g_logp: torch.Tensor,
    temperature: float,
    chunk: int,
    *,
    g_ent: torch.Tensor | None = None,
    ent: torch.Tensor | None = None,
    g_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The backward of `slice_stats` on this rank's slice: returns this slice's part of the gradient at
    ``hidden`` (float32 ``[n, H]``; the caller sums the parts over the group) and adds the gradient of ``weight``
    into ``g_weight`` (float32, in place) when given. Each chunk's logits are recomputed (the same bits)."""
    n, rows = hidden.shape[0], weight.shape[0]
    g_hidden = torch.zeros((n, weight.shape[1]), dtype=torch.float32, device=hidden.device)
    for i in range(0, n, chunk):
        h = hidden[i : i + chunk]
        col, inside = _target_columns(targets[i : i + chunk], start, rows)
        gz = logits_grad_(
            chunk_logits(h, weight, temperature).sub_(lse[i : i + chunk, None]),  # log p over this slice's columns
            g_logp[i : i + chunk],
            col,
            temperature,
            g_ent=g_ent[i : i + chunk] if g_ent is not None else None,
            ent=ent[i : i + chunk] if g_ent is not None else None,
            in_rows=inside,
        )
        g_hidden[i : i + chunk] = torch.matmul(gz.to(weight.dtype), weight).float()
        if g_weight is not None:
            g_weight.addmm_(gz.t(), h.float())
    return g_hidden


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy, sink):
        n = hidden.shape[0]
        logp, lse = (hidden.new_empty(n, dtype=torch.float32) for _ in range(2))
        ent = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        for s in range(0, n, chunk):
            lp, en, lse[s : s + chunk] = _chunk_stats(
                hidden[s : s + chunk], weight, targets[s : s + chunk], temperature, with_entropy
            )
            logp[s : s + chunk] = lp
            if with_entropy:
                ent[s : s + chunk] = en
        # the backward recomputes each chunk's logits (the same bits) and subtracts this logsumexp: one
        # [chunk, V] buffer there, no second reduction over the vocabulary
        ctx.save_for_backward(hidden, weight, targets, lse, *([ent] if with_entropy else []))
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.sink = temperature, chunk, with_entropy, sink
        if with_entropy:
            return logp, ent
        return logp, logp.new_zeros(0)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        ent = rest[0] if ctx.with_entropy else None
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.zeros_like(hidden) if need_h else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            z = chunk_logits(h, weight, t)
            with_ent = ent is not None and g_ent.numel()
            gz = logits_grad_(
                z.sub_(lse[s : s + chunk, None]),
                g_logp[s : s + chunk],
                targets[s : s + chunk],
                t,
                g_ent=g_ent[s : s + chunk] if with_ent else None,
                ent=ent[s : s + chunk] if with_ent else None,
            )
            if need_h:
                g_hidden[s : s + chunk] = torch.matmul(gz.to(weight.dtype), weight).to(hidden.dtype)
            if need_w:
                g_weight.addmm_(gz.t(), h.float())  # in place: no vocab x hidden temporary
        if need_w and ctx.sink is not None:  # the tied embedding's backward adds to it and returns it
            ctx.sink.grad, g_weight, need_w = g_weight, None, False
        return g_hidden, (g_weight.to(weight.dtype) if need_w else None), None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    tied_grad: TiedGrad | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` under ``softmax(hidden @ weight.T / temperature)``, chunked over rows.

    ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]`` int64 -> ``log_probs [N]`` float32 and, with
    ``with_entropy``, ``entropy [N]`` float32 (else ``None``). Differentiable in ``hidden`` and
    ``weight``; at most ``chunk_size x V`` logits exist at a time. ``temperature == 0`` means 1 (greedy
    log-probs are those of the unscaled softmax, the convention in core/protocols.py). ``tied_grad``:
    ``weight`` is also the input embedding, looked up through `tied_embedding` with the same slot.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"token_logprobs: hidden {tuple(hidden.shape)} must be [N, H] and targets [N], got {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    temperature = 1.0 if temperature == 0 else float(temperature)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        with torch.no_grad():
            for s in range(0, n, chunk_size):
                lp, en, _ = _chunk_stats(
                    hidden[s : s + chunk_size], weight, targets[s : s + chunk_size], temperature, with_entropy
                )
                logp[s : s + chunk_size] = lp
                if ent is not None:
                    ent[s : s + chunk_size] = en
        return logp, ent
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, targets, temperature, chunk_size, with_entropy, tied_grad)
    return logp, (ent if with_entropy else None)


def logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """No-grad log-probs of ``targets [N]`` for small ``N`` (an engine's sampled tokens), float32 ``[N]``.

    Same formula as the trainer's `token_logprobs`, so both sides produce the same bits for the same
    hidden states.
    """
    with torch.no_grad():
        return _chunk_stats(hidden, weight, targets, 1.0 if temperature == 0 else float(temperature), False)[0]
