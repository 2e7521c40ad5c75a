"""Engine-neutral pieces of a training engine: batch -> micro-batch tensors, normalisers, buckets.

A training engine feeds the model, for each sequence of ``T`` tokens, its first ``T - 1`` tokens (the
last token predicts nothing) and needs the hidden states only at the positions that predict response
tokens: row ``i``'s response token ``j`` is predicted at sequence position ``P_i + j - 1``
(core/batch.py). `MicroBatch` holds the model inputs plus those gather/scatter indices, in one of two
layouts:

* **packed** (``input_ids [N]``): sequences concatenated without padding, positions restarting per
  sequence, ``cu_seqlens [S + 1]`` for varlen attention. Rows with no response token are left out.
* **padded** (``input_ids [b, L]``): right-padded rows with an ``attention_mask``, for models that
  cannot take packed input (HF fallback).

Packed with ``share_prompts``, rows that share a prompt hold it once (common/prompts.py): ``layout``
(`tandem.models.attention.PrefixLayout`) says where each prompt and response piece sits and
``cu_seqlens`` bounds the blocks (a prompt and its responses).

Either way ``select [M]`` indexes the flattened hidden states ``[N or b*L, H]`` at the ``M`` predicting
positions, ``targets [M]`` are the predicted token ids, and `MicroBatch.to_response` scatters ``[M]``
values into response space ``[b, R]`` (zeros on padding).

The rest is the skeleton of a training step that every engine shares: the global loss normalisers
(`global_loss_scale`), the cross-rank skip decision (`step_skipped`) and the step's metrics
(`step_metrics`), so that the engines cannot drift apart in what they report.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.core.batch import TrainBatch, partition_by_token_budget, partition_padded
from tandem.core.losses import reduce_micro_batch_metrics
from tandem.core.protocols import LossScale
from tandem.engines.training.common.prompts import plan_shared, prompt_units, shared_layout, unit_cost
from tandem.models.attention import PrefixLayout
from tandem.sync.base import bucketize

__all__ = [
    "MicroBatch",
    "bucket_by_bytes",
    "pick_device",
    "check_batch",
    "dummy_micro_batch",
    "global_loss_scale",
    "local_loss_scale",
    "make_micro_batch",
    "plan_micro_batches",
    "split_for_data_parallel",
    "step_metrics",
    "step_skipped",
    "tandem_version",
]


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """Model inputs of one micro-batch and the map from predicting positions to response space."""

    input_ids: torch.Tensor  # packed [N] / padded [b, L] int64
    positions: torch.Tensor  # same shape as input_ids
    cu_seqlens: torch.Tensor | None  # packed: [S + 1] int64
    attention_mask: torch.Tensor | None  # padded: [b, L] int64 (1 = real token)
    select: torch.Tensor  # [M] int64 into the flattened hidden states
    targets: torch.Tensor  # [M] int64
    scatter: torch.Tensor  # [M] int64 into the flattened response space [b * R]
    response_shape: tuple[int, int]  # (b, R)
    routed_experts: torch.Tensor | None = None  # packed: [N, layers, topk] int32 (R3 replay)
    layout: PrefixLayout | None = None  # packed with prompts stored once (common/prompts.py)
    is_dummy: bool = False  # a stand-in that keeps ranks in lockstep; contributes nothing

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to_response(self, values: torch.Tensor) -> torch.Tensor:
        """``[M]`` -> ``[b, R]`` with zeros where no response token exists (keeps autograd)."""
        b, r = self.response_shape
        out = values.new_zeros(b * r)
        return out.index_put((self.scatter,), values).view(b, r)

    def to(self, device: torch.device) -> MicroBatch:
        moved = {}
        for name in self.__slots__:
            v = getattr(self, name)
            moved[name] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        return MicroBatch(**moved)


def _response_coords(batch: TrainBatch, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row, response column and predicting sequence position of every response token, each ``[M]``."""
    resp = batch.response_lengths
    col = torch.arange(width)
    valid = col[None, :] < resp[:, None]  # [b, R]
    row_idx, col_idx = valid.nonzero(as_tuple=True)
    seq_pos = batch.prompt_lengths[row_idx] - 1 + col_idx
    return row_idx, col_idx, seq_pos


def make_micro_batch(
    sub: TrainBatch, *, packed: bool, with_routing: bool = False, share_prompts: bool = False
) -> MicroBatch:
    """The model inputs of batch ``sub`` (one micro-batch's rows) in the packed or padded layout.

    ``with_routing`` carries ``sub.routed_experts`` along the packed tokens for MoE routing replay.
    ``share_prompts`` (packed, without routing replay: a prompt's routing is recorded per row) stores
    each prompt that several rows share once.
    """
    width = int(sub.loss_mask.shape[1])
    fed = (sub.seq_lengths - 1).clamp(min=0)  # tokens fed per row
    row_idx, col_idx, seq_pos = _response_coords(sub, width)
    scatter = row_idx * width + col_idx
    targets = sub.input_ids[row_idx, seq_pos + 1]
    routing = with_routing and sub.routed_experts is not None
    shared = shared_layout(sub, row_idx, seq_pos) if packed and share_prompts and not routing else None
    if shared is not None:
        ids, positions, layout, select = shared
        starts = [start for start, _ in layout.prefixes]
        return MicroBatch(
            input_ids=ids,
            positions=positions,
            cu_seqlens=torch.tensor([*starts, layout.num_tokens]),
            attention_mask=None,
            select=select,
            targets=targets,
            scatter=scatter,
            response_shape=(sub.batch_size, width),
            layout=layout,
        )
    if not packed:
        length = max(int(fed.max()), 1)
        ids = sub.input_ids[:, :length]
        mask = (torch.arange(length)[None, :] < fed[:, None]).long()
        # A row with nothing to feed still attends to one token: a fully masked row gives NaN
        # activations, and NaN * 0 in the backward would poison the weight gradients.
        mask[:, 0] = 1
        positions = torch.arange(length).expand_as(ids).contiguous()
        return MicroBatch(
            input_ids=ids.contiguous(),
            positions=positions,
            cu_seqlens=None,
            attention_mask=mask,
            select=row_idx * length + seq_pos,
            targets=targets,
            scatter=scatter,
            response_shape=(sub.batch_size, width),
        )
    keep = (fed > 0).nonzero(as_tuple=True)[0]
    lengths = fed[keep]
    offsets = torch.zeros(sub.batch_size, dtype=torch.long)
    offsets[keep] = torch.cumsum(lengths, 0) - lengths
    pieces = [sub.input_ids[i, : int(fed[i])] for i in keep.tolist()]
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]) if pieces else ids.clone()
    routed = None
    if with_routing and sub.routed_experts is not None and pieces:
        routed = torch.cat([sub.routed_experts[i, : int(fed[i])] for i in keep.tolist()])
    return MicroBatch(
        input_ids=ids,
        positions=positions,
        cu_seqlens=torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)),
        attention_mask=None,
        select=offsets[row_idx] + seq_pos,
        targets=targets,
        scatter=scatter,
        response_shape=(sub.batch_size, width),
        routed_experts=routed,
    )


def dummy_micro_batch(*, packed: bool, pad_token_id: int = 0) -> MicroBatch:
    """One pad token predicting itself: a forward/backward that keeps FSDP's collectives in step."""
    one = torch.tensor([pad_token_id], dtype=torch.long)
    zero = torch.zeros(1, dtype=torch.long)
    return MicroBatch(
        input_ids=one if packed else one[None, :],
        positions=zero if packed else zero[None, :],
        cu_seqlens=torch.tensor([0, 1]) if packed else None,
        attention_mask=None if packed else torch.ones(1, 1, dtype=torch.long),
        select=zero,
        targets=one,
        scatter=zero,
        response_shape=(1, 1),
        is_dummy=True,
    )


def check_batch(batch: TrainBatch, *, max_context: int, micro_batch_tokens: int) -> None:
    """Raise ValueError naming the row, its length and the limit it breaks."""
    lengths = batch.seq_lengths.tolist()
    if not lengths:
        raise ValueError("the batch holds no rows")
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > max_context:
        raise ValueError(
            f"row {longest} has {lengths[longest]} tokens, more than the model context "
            f"(max_position_embeddings={max_context})"
        )
    if lengths[longest] > micro_batch_tokens:
        raise ValueError(
            f"row {longest} has {lengths[longest]} tokens, more than micro_batch_tokens="
            f"{micro_batch_tokens}; raise micro_batch_tokens to at least {lengths[longest]}"
        )
    if int(batch.input_ids.shape[1]) < lengths[longest]:
        raise ValueError(
            f"seq_lengths[{longest}]={lengths[longest]} exceeds input_ids width {batch.input_ids.shape[1]}"
        )


def plan_micro_batches(
    batch: TrainBatch, micro_batch_tokens: int, *, share_prompts: bool = False, padded: bool = False
) -> list[list[int]]:
    """Row indices per micro-batch: first-fit decreasing on sequence lengths under the token budget.

    ``share_prompts``: rows sharing a prompt stay together, costed with the prompt once (`plan_shared`).
    ``padded``: the budget bounds rows x the longest row (an engine that right-pads: `partition_padded`).
    """
    if share_prompts:
        return plan_shared(batch, micro_batch_tokens, padded=padded)
    lengths = batch.seq_lengths.tolist()
    return partition_padded(lengths, micro_batch_tokens) if padded else partition_by_token_budget(lengths, micro_batch_tokens)


def local_loss_scale(batch: TrainBatch) -> torch.Tensor:
    """``[3]`` float64: this rank's loss tokens, sequences with a loss token, and response width.

    The first two are summed and the last maxed over data-parallel ranks to build the `LossScale`.
    """
    per_row = batch.loss_mask.sum(1)
    width = int(batch.response_lengths.max()) if batch.batch_size else 0
    return torch.tensor([float(per_row.sum()), float((per_row > 0).sum()), float(width)], dtype=torch.float64)


def loss_scale_from(totals: torch.Tensor) -> LossScale:
    """`LossScale` from the reduced ``[tokens, sequences, width]`` of `local_loss_scale`."""
    return LossScale(
        num_tokens=float(totals[0]), num_sequences=float(totals[1]), max_response_length=int(totals[2])
    )


def global_loss_scale(
    batch: TrainBatch, all_reduce: Callable[[torch.Tensor, str], torch.Tensor]
) -> LossScale:
    """The `LossScale` of the global batch from this rank's ``batch`` (collective).

    ``all_reduce(t, op)`` reduces ``t`` over the data-parallel ranks with ``op`` ``"sum"`` or ``"max"``:
    loss tokens and sequences are summed, the response width is maxed.
    """
    local = local_loss_scale(batch)
    sums = all_reduce(local[:2], "sum")
    width = all_reduce(local[2:], "max")
    return loss_scale_from(torch.cat([sums, width]))


def step_skipped(global_loss: float, grad_norm: float) -> bool:
    """Whether the optimizer step is skipped: the global loss or the gradient norm is NaN/Inf.

    Both inputs are global (the same on every rank), so every rank takes the same decision.
    """
    return not (math.isfinite(global_loss) and math.isfinite(grad_norm))


def step_metrics(
    prefix: str,
    *,
    loss: float,
    grad_norm: float,
    lr: float,
    skipped: bool,
    tokens: int,
    started: float,
    rank_metrics: Iterable[dict[str, float]],
    device: torch.device,
    extra: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The metrics of one train step, the same keys for every engine.

    ``{prefix}/loss`` (the global loss), ``grad_norm``, ``lr`` (the LR the step used), ``skipped_step``,
    ``tokens`` (fed over all ranks), ``tokens_per_s`` and ``step_time_s`` (since ``started``, a
    ``time.perf_counter()`` value); then each rank's loss metrics reduced by the
    `reduce_micro_batch_metrics` convention, ``extra``, and ``perf/max_memory_allocated_gb`` on CUDA.
    """
    elapsed = time.perf_counter() - started
    out = {
        f"{prefix}/loss": loss,
        f"{prefix}/grad_norm": grad_norm,
        f"{prefix}/lr": lr,
        f"{prefix}/skipped_step": float(skipped),
        f"{prefix}/tokens": float(tokens),
        f"{prefix}/tokens_per_s": tokens / max(elapsed, 1e-9),
        f"{prefix}/step_time_s": elapsed,
        **reduce_micro_batch_metrics(rank_metrics),
        **(extra or {}),
    }
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def tandem_version() -> str:
    """Tandem's version (the `EngineInfo.version` of its own engines); ``""`` when it cannot be told."""
    try:
        from tandem import __version__

        return str(__version__)
    except ImportError:
        pass
    try:
        return importlib.metadata.version("tandem-rl")
    except importlib.metadata.PackageNotFoundError:
        return ""


def split_for_data_parallel(batch: TrainBatch, num_ranks: int, *, share_prompts: bool = False) -> list[list[int]]:
    """Rows for each of ``num_ranks`` ranks, balancing token counts (longest-first greedy).

    Every rank gets at least one row when the batch has that many; rows stay in ascending order.
    ``share_prompts``: rows sharing a prompt go to one rank (costed with the prompt once) when there
    are at least as many such units as ranks.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    if batch.batch_size < num_ranks:
        raise ValueError(f"batch of {batch.batch_size} rows cannot feed {num_ranks} data-parallel ranks")
    units = prompt_units(batch) if share_prompts else []
    if len(units) < num_ranks:
        units = [[i] for i in range(batch.batch_size)]
    cost = [unit_cost(batch, u) for u in units]
    order = sorted(range(len(units)), key=lambda k: (-cost[k], units[k][0]))
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for k in order:
        r = min(range(num_ranks), key=lambda r: (load[r], len(shards[r])))
        shards[r].extend(units[k])
        load[r] += cost[k]
    return [sorted(s) for s in shards]


def pick_device(preference: str) -> torch.device:
    """The training device for ``"auto" | "cpu" | "cuda"``; on CUDA, this rank's local GPU (set current)."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available on this machine")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    index = local % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# Engines bucket their sync tensors with the sync layer's own function (one rule for every sender).
bucket_by_bytes = bucketize
