"""Micro-batches for a Megatron ``GPTModel`` stage and the schedule that runs them through the pipeline.

**Layout.** Megatron's local attention cannot take packed (THD) sequences, so a micro-batch is padded:
``input_ids [b, L]`` right-padded, with one causal mask ``[1, 1, L, L]`` (right padding needs no
padding mask: a real token only attends to earlier, real, tokens). Only the ``M`` positions that
predict response tokens are kept, and the output layer does not run: the last stage hands those hidden
states and the layer's weight to the log-prob head (megatron/logprobs.py: `head_logprobs`), which
projects them onto the vocabulary a chunk of rows at a time. Prompt positions never produce logits, and
no ``[M, V]`` logits are held for the backward. Under sequence parallelism the stand-in first gathers the
sequence as the output layer would (Megatron's ``gather_from_sequence_parallel_region``: all-gather
forward, reduce-scatter backward, which also sums the hidden states' gradient over the TP ranks).

**Schedule.** Megatron's own pipeline schedules allocate on CUDA (``torch.zeros(..., device="cuda")``,
p2p buffers on ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``), so the engine runs its own
GPipe-style schedule on ``torch.distributed`` point-to-point ops: every stage runs all forwards
(receiving activations from the previous stage, sending to the next), then all backwards in the same
order (gradients flow back the same way). It is deadlock-free with blocking send/recv because each
phase only sends in one direction. With one stage each micro-batch's backward follows its forward
directly, so activations of one micro-batch at a time are alive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.engines.training.common import MicroBatch

__all__ = ["HeadInput", "StageBatch", "StageLink", "gpipe", "pad_micro_batch", "pad_rows", "stage_forward",
           "stage_shape", "to_stage_batch"]


@dataclass(kw_only=True, slots=True)
class StageBatch:
    """A padded micro-batch as a Megatron stage consumes it."""

    input_ids: torch.Tensor  # [b, L] int64
    position_ids: torch.Tensor  # [b, L] int64
    attention_mask: torch.Tensor | None  # [1, 1, L, L] bool, True = masked out; None: causal (SDPAttention)
    select: torch.Tensor  # [M] int64 into the flattened [b * L] positions
    targets: torch.Tensor  # [M] int64
    source: MicroBatch  # the unpadded micro-batch (scatter back to response space)
    rotary_at_positions: bool = False  # rotary angles from position_ids (shared prompts), not the column index


def pad_micro_batch(
    mb: MicroBatch, rows: int, length: int, pad_token_id: int, device: torch.device, *, mask: bool = True
) -> StageBatch:
    """``mb`` (padded layout) widened to ``[rows, length]``: extra rows/columns are pad tokens.

    Extra columns sit after every real token and extra rows are never selected, so causality keeps
    them from influencing anything that is scored. ``mask=False``: no ``[L, L]`` mask tensor (64 MiB at 8k
    tokens), for a core attention that takes none as causal (attention.py).
    """
    b, width = mb.input_ids.shape
    if rows < b or length < width:
        raise ValueError(f"cannot pad a [{b}, {width}] micro-batch down to [{rows}, {length}]")
    ids = torch.full((rows, length), pad_token_id, dtype=torch.long)
    ids[:b, :width] = mb.input_ids
    positions = torch.arange(length).expand(rows, length).contiguous()
    select = (mb.select // width) * length + mb.select % width
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None] if mask else None
    return StageBatch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        attention_mask=causal.to(device) if mask else None,
        select=select.to(device),
        targets=mb.targets.to(device),
        source=mb,
    )


def stage_shape(mb: MicroBatch) -> tuple[int, int]:
    """``(rows, length)`` of ``mb`` as a stage runs it: its padded rows, or one row per block of a packed one."""
    if mb.packed:
        sizes = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
        return len(sizes), int(sizes.max())
    return tuple(mb.input_ids.shape)


def to_stage_batch(
    mb: MicroBatch, rows: int, length: int, pad_token_id: int, device: torch.device, *, mask: bool = True
) -> StageBatch:
    """`pad_rows` for a packed micro-batch, `pad_micro_batch` for a padded one."""
    if mb.packed:
        return pad_rows(mb, rows, length, pad_token_id, device)
    return pad_micro_batch(mb, rows, length, pad_token_id, device, mask=mask)


def pad_rows(mb: MicroBatch, rows: int, length: int, pad_token_id: int, device: torch.device) -> StageBatch:
    """A packed micro-batch as right-padded rows ``[rows, length]``: one row per block of ``cu_seqlens``.

    With shared prompts (``mb.layout``, common/prompts.py) a block is a prompt followed by the responses that
    share it, each token at its position in its own sequence (a response continues at the prompt's length),
    and the mask (``[rows, 1, L, L]``, True = masked out) lets a response attend to the prompt and to its own
    earlier tokens only: the attention of the separate sequences. Without a layout a block is one sequence
    starting at column 0 and no mask is needed (causal). Pad tokens attend to pad tokens only.
    """
    starts = mb.cu_seqlens[:-1]
    sizes = mb.cu_seqlens[1:] - starts
    if rows < len(sizes) or length < int(sizes.max()):
        raise ValueError(f"cannot lay {len(sizes)} blocks of up to {int(sizes.max())} tokens into [{rows}, {length}]")
    n = mb.num_tokens
    row = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    dest = row * length + torch.arange(n) - starts[row]  # [N]: a packed token's place in the flat rows
    ids = torch.full((rows * length,), pad_token_id, dtype=torch.long)
    ids[dest] = mb.input_ids
    positions = torch.zeros(rows * length, dtype=torch.long)
    positions[dest] = mb.positions
    mask = None
    if mb.layout is not None:
        piece = torch.full((rows * length,), -1, dtype=torch.long)  # pads: a piece of their own
        prefix = torch.zeros(rows * length, dtype=torch.bool)
        own = torch.empty(n, dtype=torch.long)
        is_prefix = torch.zeros(n, dtype=torch.bool)
        for g, (s, k) in enumerate(mb.layout.prefixes):
            own[s : s + k], is_prefix[s : s + k] = g, True
        for j, (s, k, _) in enumerate(mb.layout.suffixes):
            own[s : s + k] = len(mb.layout.prefixes) + j
        piece[dest], prefix[dest] = own, is_prefix
        piece, prefix = piece.view(rows, length), prefix.view(rows, length)
        col = torch.arange(length)
        allowed = (col[:, None] >= col[None, :])[None] & (
            (piece[:, :, None] == piece[:, None, :]) | prefix[:, None, :]
        )
        mask = (~allowed)[:, None].to(device)
    return StageBatch(
        input_ids=ids.view(rows, length).to(device),
        position_ids=positions.view(rows, length).to(device),
        attention_mask=mask,
        select=dest[mb.select].to(device),
        targets=mb.targets.to(device),
        source=mb,
        rotary_at_positions=mb.layout is not None,
    )


@contextlib.contextmanager
def _rotary_at(module, positions: torch.Tensor) -> Iterator[None]:
    """Rotary angles of ``positions [b, L]`` (``[L, b, 1, dim]``) instead of Megatron's per-column table
    (``[L, 1, 1, dim]``; its RoPE broadcasts over the batch either way)."""
    rope = getattr(module, "rotary_pos_emb", None)
    if rope is None:  # a stage without rotary embeddings
        yield
        return

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        table = rope.get_emb(int(positions.max()) + 1)  # [P, 1, 1, dim]
        return table[:, 0][positions.t()]

    rope.forward = forward  # an instance attribute: nn.Module.__call__ runs it
    try:
        yield
    finally:
        del rope.forward


@dataclass(slots=True)
class HeadInput:
    """The last stage's output when the log-prob head does the vocabulary projection."""

    hidden: torch.Tensor  # [M, h] at the selected positions
    weight: torch.Tensor  # [V_local, h]: the output layer's (the word embeddings' when tied)
    gathered: bool  # sequence parallel: the gather's backward already sums the gradient over the TP ranks


@contextlib.contextmanager
def _head_input(module, select: torch.Tensor, sink: dict) -> Iterator[None]:
    """Stand in for the output layer's forward: hand on the hidden states at ``select`` (``[s, b, h]`` ->
    ``[M, 1, h]``) instead of logits, and leave the weight the model passed (tied: the embeddings') in ``sink``."""
    layer = module.output_layer

    def forward(hidden, weight=None, runtime_gather_output=None):
        sink["weight"] = layer.weight if weight is None else weight
        sink["gathered"] = bool(layer.sequence_parallel)
        if layer.sequence_parallel:  # [s / TP, b, h] -> [s, b, h], as ColumnParallelLinear does (CUDA only)
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                          group=layer.tp_group)
        flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        return flat.index_select(0, select).unsqueeze(1), None

    layer.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks included
    try:
        yield
    finally:
        del layer.forward


def stage_forward(
    module, batch: StageBatch, input_tensor: torch.Tensor | None, *, first: bool, last: bool
) -> torch.Tensor | HeadInput:
    """One stage's forward: ``[L, b, h]``, or on the last stage the `HeadInput` of the selected positions."""
    if not first:
        module.set_input_tensor(input_tensor)
    sink: dict = {}
    with (_head_input(module, batch.select, sink) if last else contextlib.nullcontext(),
          _rotary_at(module, batch.position_ids) if batch.rotary_at_positions else contextlib.nullcontext()):
        out = module(
            input_ids=batch.input_ids if first else None,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
        )
    if not last:
        return out
    return HeadInput(hidden=out.squeeze(0), weight=sink["weight"], gathered=sink["gathered"])  # [1, M, h] -> [M, h]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StageLink:
    """Blocking activation/gradient exchange with the neighbouring pipeline stages (same TP rank).

    An activation travels after a header ``[d0, d1, d2, dtype index]``: micro-batches differ in shape,
    and the dtype of a stage's output is whatever Megatron's last layer produced.
    """

    def __init__(self, pp_group, pp_rank: int, pp_size: int, device: torch.device) -> None:
        self.device = device
        self.prev = dist.get_global_rank(pp_group, pp_rank - 1) if pp_rank > 0 else None
        self.next = dist.get_global_rank(pp_group, pp_rank + 1) if pp_rank < pp_size - 1 else None

    def send_forward(self, t: torch.Tensor) -> None:
        header = torch.tensor([*t.shape, _DTYPES.index(t.dtype)], dtype=torch.long, device=self.device)
        dist.send(header, self.next)
        dist.send(t.detach().contiguous(), self.next)

    def recv_forward(self) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.long, device=self.device)
        dist.recv(header, self.prev)
        *shape, dtype = header.tolist()
        t = torch.empty(tuple(shape), dtype=_DTYPES[dtype], device=self.device)
        dist.recv(t, self.prev)
        return t.requires_grad_()

    def send_backward(self, grad: torch.Tensor) -> None:
        dist.send(grad.contiguous(), self.prev)

    def recv_backward(self, like: torch.Tensor) -> torch.Tensor:
        grad = torch.empty_like(like)
        dist.recv(grad, self.next)
        return grad


def gpipe(
    num_micro_batches: int,
    forward: Callable[[int, torch.Tensor | None], torch.Tensor | HeadInput],
    loss: Callable[[int, HeadInput], torch.Tensor] | None,
    link: StageLink | None,
) -> None:
    """Run ``forward`` (and, with ``loss``, backward) over the micro-batches of one step on this stage.

    ``forward(k, input_tensor)`` returns the stage output; on the last stage ``loss(k, output)`` turns it
    into the scalar to differentiate (it also records whatever the caller needs). ``link`` is None with
    a single stage. ``loss=None`` runs forwards only (the last stage then calls nothing else).
    """
    first = link is None or link.prev is None
    last = link is None or link.next is None
    if link is None:  # one stage: forward and backward back to back
        for k in range(num_micro_batches):
            out = forward(k, None)
            if loss is not None:
                loss(k, out).backward()
        return
    kept: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for k in range(num_micro_batches):
        inp = None if first else link.recv_forward()
        out = forward(k, inp)
        if last:
            out = loss(k, out) if loss is not None else out
        else:
            link.send_forward(out)
        if loss is not None:
            kept.append((inp, out))
    if loss is None:
        return
    for inp, out in kept:
        if last:
            out.backward()
        else:
            torch.autograd.backward(out, link.recv_backward(out))
        if not first:
            link.send_backward(inp.grad if inp.grad is not None else torch.zeros_like(inp))
