"""Prompt sharing: the rows of a batch that share a prompt feed it to the model once.

A GRPO group's responses all continue the same prompt. Packed as separate sequences, the prompt's tokens go
through every layer once per response, forward and backward; packed once, followed by each response's
tokens (positions continuing at the prompt's length, attention through
`tandem.models.attention.SharedPrefixAttention`), they go through once per group. The log-probs and
gradients are those of the separate sequences (the same sums, in another order; bit for bit in
deterministic mode). This is the "shared-prefix forward" of Prefix Grouper (Liu et al. 2025,
arXiv:2506.05433).

`prompt_units` finds the rows that share: equal prompt lengths and equal prompt tokens (the group index is
not trusted: a multi-turn sample's prompt may differ within a group), each with at least one response
token. `shared_layout` lays a micro-batch out; `plan_shared` keeps such rows in one micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.batch import TrainBatch, partition_by_token_budget, partition_padded
from tandem.models.attention import PrefixLayout

__all__ = ["plan_shared", "prompt_units", "shared_layout"]


def prompt_units(batch: TrainBatch) -> list[list[int]]:
    """Rows grouped by identical prompts (rows without a response token stand alone), in first-row order."""
    plen = batch.prompt_lengths.tolist()
    resp = batch.response_lengths.tolist()
    ids = batch.input_ids.numpy()
    units: dict[object, list[int]] = {}
    for i in range(batch.batch_size):
        key = (plen[i], ids[i, : plen[i]].tobytes()) if resp[i] > 0 else ("alone", i)
        units.setdefault(key, []).append(i)
    return list(units.values())


def unit_cost(batch: TrainBatch, rows: Sequence[int]) -> int:
    """Tokens of ``rows`` laid out with their prompt once (the token measure of the micro-batch budget)."""
    lengths = batch.seq_lengths
    if len(rows) == 1:
        return int(lengths[rows[0]])
    p = int(batch.prompt_lengths[rows[0]])
    return p + sum(int(lengths[i]) - p for i in rows)


def plan_shared(batch: TrainBatch, max_tokens: int, *, padded: bool = False) -> list[list[int]]:
    """Row indices per micro-batch, rows that share a prompt kept together under the token budget.

    First-fit decreasing over prompt units costed with the prompt once; a unit over the budget is cut
    into consecutive runs of rows that fit (each run holds the prompt once). Every row must fit alone
    (`check_batch`). ``padded``: each run is one row of a right-padded micro-batch (the Megatron engine),
    and the budget bounds runs x the longest run (`partition_padded`).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be > 0")
    pieces: list[tuple[int, list[int]]] = []
    for unit in prompt_units(batch):
        run: list[int] = []
        for i in unit:
            if run and unit_cost(batch, [*run, i]) > max_tokens:
                pieces.append((unit_cost(batch, run), run))
                run = []
            run.append(i)
        pieces.append((unit_cost(batch, run), run))
    for cost, rows in pieces:
        if cost > max_tokens:
            raise ValueError(
                f"sequence {rows[0]} has {cost} tokens, more than the micro-batch token budget {max_tokens}; "
                f"raise the budget to at least {cost}"
            )
    costs = [cost for cost, _ in pieces]
    bins = partition_padded(costs, max_tokens) if padded else partition_by_token_budget(costs, max_tokens)
    return [sorted(row for k in b for row in pieces[k][1]) for b in bins]


def shared_layout(
    sub: TrainBatch, row_idx: torch.Tensor, seq_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, PrefixLayout, torch.Tensor] | None:
    """``(input_ids [N], positions [N], layout, select [M])`` of ``sub`` with shared prompts stored once.

    ``row_idx, seq_pos [M]``: the row and the predicting sequence position of every response token.
    Rows with nothing to feed are left out, as in the plain packed layout. None when no two rows share
    a prompt (the plain layout is then the same thing).
    """
    fed = (sub.seq_lengths - 1).clamp(min=0).tolist()
    units = [[i for i in u if fed[i] > 0] for u in prompt_units(sub)]
    units = [u for u in units if u]
    if all(len(u) == 1 for u in units):
        return None
    b = sub.batch_size
    split = torch.zeros(b, dtype=torch.long)  # sequence positions below it sit in the row's prefix
    pre_at = torch.zeros(b, dtype=torch.long)  # flat offset of the row's prefix
    suf_at = torch.zeros(b, dtype=torch.long)  # flat offset of the row's suffix
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    prefixes: list[tuple[int, int]] = []
    suffixes: list[tuple[int, int, int]] = []
    cursor = 0
    for unit in units:
        # a unit of one is an ordinary sequence: all of it is "prefix"
        p = fed[unit[0]] if len(unit) == 1 else int(sub.prompt_lengths[unit[0]])
        ids.append(sub.input_ids[unit[0], :p])
        pos.append(torch.arange(p))
        prefixes.append((cursor, p))
        for i in unit:
            split[i], pre_at[i] = p, cursor
        cursor += p
        if len(unit) == 1:
            continue
        for i in unit:
            s = fed[i] - p
            suf_at[i] = cursor
            if s > 0:  # a one-token response is predicted from the prompt's last position alone
                ids.append(sub.input_ids[i, p : p + s])
                pos.append(torch.arange(p, p + s))
                suffixes.append((cursor, s, len(prefixes) - 1))
                cursor += s
    layout = PrefixLayout(prefixes=tuple(prefixes), suffixes=tuple(suffixes), num_tokens=cursor)
    r = split[row_idx]
    select = torch.where(seq_pos < r, pre_at[row_idx] + seq_pos, suf_at[row_idx] + seq_pos - r)
    return torch.cat(ids), torch.cat(pos), layout, select
