"""The token embedding and the log-prob projection, vocabulary-parallel over the data-parallel ranks.

FSDP2 shards a parameter by rows (``Shard(0)``); the rows of the token embedding and of the output
projection are vocabulary entries, so a rank's shard is already a slice of the vocabulary. Gathering
it costs a whole ``[V, H]`` copy on every rank for the forward, and the backward a whole ``[V, H]``
gradient plus the reduce-scatter's copy of it: 3 x 108 MiB for SmolLM2 at the peak of a step, more
than sharding the optimizer state saves at world 2.

Here each rank computes with its slice where it lies, and the ranks exchange what is small instead
(token ids, the hidden states of the predicted positions, per-token statistics: O(tokens x H), never
O(V x H)):

* embedding: every rank looks up all ranks' ids in its rows (zeros elsewhere); one all-reduce sums
  the rows (each has exactly one non-zero term: the result is the plain lookup's, bit for bit) and a
  rank keeps its own tokens. Backward: the output gradients of all ranks are gathered and each rank
  adds its rows' into its slice's gradient.
* log-probs: the hidden states of all ranks are gathered; each rank computes the logits of its slice
  chunk by chunk (models/logprobs.py's recomputing scheme) and the per-token max, sum of exponentials
  and target logit (and, for entropy, sum p z) are combined by two all-reduces:
  ``log p(t) = z_t - (m + log S)``. One ``[chunk, V / world]`` buffer is live (the exponentials are taken
  in place; the entropy's ``sum e log e`` too). The backward recomputes the slice's logits; the
  hidden-state gradient partials are summed by an all-reduce.

Every rank sees every rank's tokens, so a slice's weight gradient is complete where it is computed: no
gradient collective for it. The weight stays a DTensor (``Shard(0)`` on the FSDP mesh), so checkpoints
(DCP), weight sync (``full_tensor``), the gradient norm and AdamW treat it like FSDP's own shards;
FSDP ignores it (``ignored_params``).

Numerics: the formulas of models/logprobs.py summed in another order (a few ulps apart), so the engine
leaves this off in deterministic mode, where log-probs must equal the embedded engine's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.models.logprobs import slice_grads, slice_stats

__all__ = ["VocabParallelEmbedding", "VocabShard", "can_shard_vocabulary", "shard_vocabulary", "vocab_parallel_logprobs", "vocab_rows"]


@dataclass(frozen=True, slots=True)
class VocabShard:
    """Rows ``[start, stop)`` of a ``vocab``-row table on ``rank`` of ``world`` (process ``group``)."""

    group: Any
    rank: int
    world: int
    start: int
    stop: int
    vocab: int


def vocab_rows(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """``rank``'s rows as ``Shard(0)`` places them (torch.chunk: ceil(V / world) rows, the last fewer)."""
    size = -(-vocab // world)
    start = min(rank * size, vocab)
    return start, min(start + size, vocab)


def _gather_sizes(n: int, vs: VocabShard, device: torch.device) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(vs.world)]
    dist.all_gather(out, mine, group=vs.group)
    return [int(s) for s in out]


def _gather_rows(x: torch.Tensor, sizes: list[int], vs: VocabShard) -> torch.Tensor:
    """Every rank's ``x`` (``sizes[r]`` rows on rank r) concatenated in rank order."""
    most = max(max(sizes), 1)  # never an empty collective
    pad = x.new_zeros((most, *x.shape[1:]))
    pad[: x.shape[0]] = x
    out = [torch.empty_like(pad) for _ in range(vs.world)]
    dist.all_gather(out, pad, group=vs.group)
    return torch.cat([o[:s] for o, s in zip(out, sizes, strict=True)])


def _mine(x: torch.Tensor, sizes: list[int], vs: VocabShard) -> torch.Tensor:
    start = sum(sizes[: vs.rank])
    return x[start : start + sizes[vs.rank]]


def _all_reduce(x: torch.Tensor, vs: VocabShard, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(x, op=op, group=vs.group)
    return x


class _MainGrad:
    """A sharded parameter's own ``.grad`` as the place its slice's gradient is added in place (created, zero,
    at first use; kept in the parameter's dtype, fp32 master weights). The functions below return no weight
    gradient: no slice-sized temporary per micro-batch for autograd to add, and a tied weight's two uses (the
    projection, then the embedding) add into the one buffer. Like Megatron's ``main_grad``."""

    __slots__ = ("param",)

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param

    def local(self) -> torch.Tensor:
        p = self.param
        if p.grad is None:
            from torch.distributed.tensor import DTensor

            local = torch.zeros(p.to_local().shape, dtype=p.dtype, device=p.to_local().device)
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
        return p.grad.to_local()


def _main_grad(param: nn.Parameter | None) -> _MainGrad | None:
    return _MainGrad(param) if param is not None and param.requires_grad and torch.is_grad_enabled() else None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, vs, main):
        flat = ids.reshape(-1)
        sizes = _gather_sizes(flat.numel(), vs, flat.device)
        rows = _gather_rows(flat, sizes, vs) - vs.start
        hit = ((rows >= 0) & (rows < weight.shape[0])).nonzero().squeeze(-1)
        out = weight.new_zeros((rows.numel(), weight.shape[1]))
        out[hit] = weight[rows[hit]]
        _all_reduce(out, vs)  # one non-zero term per row: exact
        ctx.save_for_backward(hit, rows[hit])
        ctx.vs, ctx.sizes, ctx.main, ctx.width = vs, sizes, main, weight.shape[1]
        return _mine(out, sizes, vs).reshape(*ids.shape, weight.shape[1]).clone()

    @staticmethod
    def backward(ctx, grad):
        hit, rows = ctx.saved_tensors
        grads = _gather_rows(grad.reshape(-1, ctx.width).contiguous(), ctx.sizes, ctx.vs)  # collective: always
        if ctx.main is not None:
            g = ctx.main.local()
            g.index_add_(0, rows, grads[hit].to(g.dtype))
        return None, None, None, None


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vs, temperature, chunk, with_entropy, main):
        sizes = _gather_sizes(hidden.shape[0], vs, hidden.device)
        h_all = _gather_rows(hidden.detach(), sizes, vs)
        t_all = _gather_rows(targets, sizes, vs)
        logp, ent, lse = slice_stats(h_all, weight, t_all, vs.start, temperature, chunk, with_entropy, vs.group)
        ctx.save_for_backward(h_all, weight, t_all, lse, *([ent] if with_entropy else []))
        ctx.vs, ctx.sizes, ctx.main = vs, sizes, main
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.hidden_dtype = temperature, chunk, with_entropy, hidden.dtype
        mine = _mine(logp, sizes, vs).clone()
        if with_entropy:
            return mine, _mine(ent, sizes, vs).clone()
        return mine, mine.new_zeros(0)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h_all, weight, t_all, lse, *rest = ctx.saved_tensors
        vs, sizes, t, chunk = ctx.vs, ctx.sizes, ctx.temperature, ctx.chunk
        ent = rest[0] if ctx.with_entropy else None
        g_all = _gather_rows(g_logp.float().contiguous(), sizes, vs)
        ge_all = _gather_rows(g_ent.float().contiguous(), sizes, vs) if ent is not None else None
        main = ctx.main if ctx.needs_input_grad[1] else None
        g_weight = None
        if main is not None:  # fp32 master weights: straight into .grad; else through an fp32 buffer
            g_weight = main.local()
            if g_weight.dtype != torch.float32:
                g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        g_hidden = slice_grads(h_all, weight, t_all, vs.start, lse, g_all, t, chunk, g_ent=ge_all, ent=ent,
                               g_weight=g_weight)
        if g_weight is not None and g_weight is not main.local():
            main.local().add_(g_weight.to(main.local().dtype))
        # every rank's partial over its slice of the vocabulary, summed (a collective: always, in step)
        g_h = _mine(_all_reduce(g_hidden, vs), sizes, vs).to(ctx.hidden_dtype).clone()
        return (g_h if ctx.needs_input_grad[0] else None), None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vs: VocabShard,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    grad_into: nn.Parameter | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`tandem.models.logprobs.token_logprobs` with ``weight`` this rank's rows ``[stop - start, H]`` of the
    projection (``grad_into.to_local()``, maybe cast). Collective: every rank of ``vs.group`` calls it (with its
    own ``hidden [N_r, H]``, ``targets [N_r]``; ``N_r`` may differ, and be 0), and its backward, in the same
    order. The weight's gradient is added into ``grad_into.grad`` in place (`_MainGrad`), not returned."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"vocab_parallel_logprobs: hidden {tuple(hidden.shape)} must be [N, H] and targets [N], "
            f"got {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    if weight.shape[0] != vs.stop - vs.start:
        raise ValueError(f"weight has {weight.shape[0]} rows, the shard [{vs.start}, {vs.stop}) has {vs.stop - vs.start}")
    temperature = 1.0 if temperature == 0 else float(temperature)
    main = _main_grad(grad_into)
    logp, ent = _LogProbs.apply(hidden, weight, targets, vs, temperature, chunk_size, with_entropy, main)
    return logp, (ent if with_entropy else None)


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose ``weight`` is a ``Shard(0)`` DTensor used in place (see module docstring); its
    gradient is added into ``weight.grad`` in place."""

    def __init__(self, weight: nn.Parameter, vs: VocabShard, compute_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = weight
        self.shard = vs
        self.compute_dtype = compute_dtype

    def local_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's rows of ``weight`` (default: the embedding's) in the compute dtype, differentiably."""
        w = (self.weight if weight is None else weight).to_local()
        return w.to(self.compute_dtype) if self.compute_dtype is not None and w.dtype != self.compute_dtype else w

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Embedding.apply(ids, self.local_weight(), self.shard, _main_grad(self.weight))

    def extra_repr(self) -> str:
        vs = self.shard
        return f"{vs.vocab}, {self.weight.shape[1]}, rows=[{vs.start}, {vs.stop}) of rank {vs.rank}/{vs.world}"


def _as_shard(p: nn.Parameter, mesh: Any, vs: VocabShard, device: torch.device, read_rows=None) -> nn.Parameter:
    from torch.distributed.tensor import DTensor, Shard

    if p.is_meta and read_rows is not None:  # not read yet (fsdp/deferred.py): this rank's rows alone
        local = read_rows(p, vs.start, vs.stop).to(device)
    else:
        local = p.detach()[vs.start : vs.stop].to(device, copy=True)
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
    return nn.Parameter(dt, requires_grad=p.requires_grad)


def shard_vocabulary(
    lm: nn.Module, mesh: Any, device: torch.device, compute_dtype: torch.dtype | None, read_rows=None
) -> set[nn.Parameter]:
    """Replace a native `CausalLM`'s embedding (and its LM head's weight, tied or not) by vocabulary
    shards on the 1-D ``mesh``, in place, before ``fully_shard``; returns the parameters FSDP must ignore.
    ``read_rows(p, start, stop)``: a weight still on the meta device is read this way, this rank's rows only."""
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    embed, head = lm.model.embed_tokens, lm.lm_head
    tied = head.weight is embed.weight
    vocab = embed.weight.shape[0]
    vs = VocabShard(group, rank, world, *vocab_rows(vocab, world, rank), vocab)
    weight = _as_shard(embed.weight, mesh, vs, device, read_rows)
    lm.model.embed_tokens = VocabParallelEmbedding(weight, vs, compute_dtype)
    head.weight = weight if tied else _as_shard(head.weight, mesh, vs, device, read_rows)
    return {weight, head.weight}


def can_shard_vocabulary(lm: nn.Module, world: int) -> str | None:
    """Why ``lm`` cannot take `shard_vocabulary` (None: it can)."""
    embed = getattr(getattr(lm, "model", None), "embed_tokens", None)
    head = getattr(lm, "lm_head", None)
    if type(embed) is not nn.Embedding or not isinstance(head, nn.Linear) or head.bias is not None:
        return "not a native model with a plain embedding and bias-free LM head"
    if embed.padding_idx is not None or embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return "the embedding has padding_idx / max_norm / scale_grad_by_freq / sparse"
    if embed.weight.shape[0] < world or head.weight.shape[0] != embed.weight.shape[0]:
        return f"vocabulary of {embed.weight.shape[0]} rows for {world} ranks"
    return None
