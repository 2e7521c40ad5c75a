"""Attention contexts and MoE routing state for the flat token-major model (models/transformer.py).

The model never builds masks itself: each layer hands its ``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` to an
`AttentionContext`, which knows how the ``N`` tokens group into sequences (and, for an inference
engine, where the KV cache lives). Training uses `VarlenAttention` (packed causal sequences); the
embedded inference engine provides a KV-cache context; the batch-invariant mode provides its own. `SharedPrefixAttention`
serves a packed batch in which sequences that share a prompt hold it once (`PrefixLayout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tandem.models.recompute import offer

__all__ = ["AttentionContext", "MoERouting", "PrefixLayout", "SharedPrefixAttention", "VarlenAttention"]


class AttentionContext(Protocol):
    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` (rotary applied) -> ``[N, Hq, D]``."""
        ...


class VarlenAttention:
    """Causal attention within each of several sequences packed into one flat batch.

    ``cu_seqlens [S + 1]`` are the cumulative lengths (``cu_seqlens[-1] == N``). Sequences of equal lengths go
    through one SDPA call as a ``[S, L]`` view; otherwise they are gathered into up to `MAX_PADDED_CALLS`
    right-padded ``[S_i, L_i]`` layouts of similar lengths (`_length_buckets`), one SDPA call each: with right
    padding, plain causal masking already keeps every real query away from padded keys, so no mask is needed.
    """

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        cu = cu_seqlens.to(torch.long)
        lengths = cu[1:] - cu[:-1]
        if (lengths <= 0).any():
            raise ValueError(
                f"VarlenAttention: every sequence needs >= 1 token, got lengths {lengths.tolist()}"
            )
        self.num_seqs = int(lengths.numel())
        self.max_len = int(lengths.max())
        self.num_tokens = n = int(cu[-1])
        self.uniform = bool((lengths == self.max_len).all())
        self.calls: list[torch.Tensor] = []  # per SDPA call: [S_i, L_i] flat token index, padded with n
        if not self.uniform:
            starts, lens = cu[:-1].tolist(), lengths.tolist()
            for pick in _length_buckets(lens, lens, MAX_PADDED_CALLS):
                self.calls.append(_gather_index([starts[i] for i in pick], [lens[i] for i in pick], n).to(cu.device))
            self.token_row = _token_rows(self.calls, n)

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu"
    ) -> VarlenAttention:
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
        return cls(F.pad(torch.cumsum(lengths, 0), (1, 0)))

    def attend(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        n, hq, d = q.shape
        if n != self.num_tokens:
            raise ValueError(f"VarlenAttention built for {self.num_tokens} tokens got {n}")
        gqa = hq != k.shape[1]
        if self.uniform:
            s, length = self.num_seqs, self.max_len
            out = F.scaled_dot_product_attention(
                *(x.view(s, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)),
                is_causal=True, scale=scale, enable_gqa=gqa,
            )  # [S, Hq, L, D]
            return out.transpose(1, 2).reshape(s * length, hq, d)
        qe, ke, ve = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (q, k, v))  # row n: padding
        outs = [F.scaled_dot_product_attention(_rows(qe, ix), _rows(ke, ix), _rows(ve, ix), is_causal=True,
                                               scale=scale, enable_gqa=gqa) for ix in self.calls]
        # the rows the output projection keeps are a gather of SDPA's outputs, which SDPA keeps itself
        return offer(_unpad_cat(self.token_row, *outs), _unpad_cat, self.token_row, *outs)


def _token_rows(indices: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Flat token -> its row in the stacked outputs of calls over ``indices`` (``[S_i, L_i]`` flat token indices,
    padded with ``n``)."""
    order = torch.cat([ix.reshape(-1) for ix in indices])
    real = (order < n).nonzero(as_tuple=True)[0]
    token_row = torch.empty(n, dtype=torch.long, device=order.device)
    token_row[order[real]] = real
    return token_row


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [N + 1, H, D]`` at ``index [S, L]`` -> ``[S, H, L, D]``; index_select: its backward (index_add) is ~4x
    faster on CPU than advanced indexing's (index_put with accumulate)."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)


MAX_PADDED_CALLS = 4  # SDPA calls, at most, that `VarlenAttention` splits its sequences into (by length), and
# `SharedPrefixAttention` its suffixes


def _length_buckets(q_len: list[int], k_len: list[int], max_calls: int = MAX_PADDED_CALLS,
                    slack: float = 1.05) -> list[list[int]]:
    """Row indices grouped into padded attention calls: sorted by key length, cut into contiguous runs that minimise
    the padded area ``sum(rows x (max query length + max key length))`` (what the calls keep for backward: padded
    queries and outputs, keys and values); the fewest calls within ``slack`` of the best with ``max_calls``."""
    order = np.argsort(np.asarray(k_len), kind="stable")
    q, k = np.asarray(q_len)[order], np.asarray(k_len)[order]
    n = len(order)
    cost = np.full((n + 1, n + 1), np.inf)  # cost[i, j]: rows order[i:j] in one call (k sorted: max is k[j - 1])
    for i in range(n):
        qmax = np.maximum.accumulate(q[i:])
        cost[i, i + 1:] = np.arange(1, n - i + 1) * (qmax + k[i:])
    best = [cost[0]]  # best[c][j]: rows order[:j] in c + 1 calls
    cut = []
    for _ in range(1, min(max_calls, n)):
        total = best[-1][:, None] + cost  # [i, j]: the first i rows in the calls so far, then i:j in one
        cut.append(np.argmin(total, axis=0))
        best.append(total[cut[-1], np.arange(n + 1)])
    calls = next(c for c in range(len(best)) if best[c][n] <= slack * best[-1][n])
    bounds, j = [n], n
    for c in range(calls, 0, -1):
        j = int(cut[c - 1][j])
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _unpad_cat(index: torch.Tensor, *outs: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of the flat outputs ``outs [S_i, Hq, L_i, D]`` stacked."""
    hq, d = outs[0].shape[1], outs[0].shape[3]
    return torch.cat([o.transpose(1, 2).reshape(-1, hq, d) for o in outs]).index_select(0, index)


@dataclass(frozen=True, slots=True)
class PrefixLayout:
    """Where the pieces of a packed batch with shared prompts sit (token offsets into the flat batch).

    ``prefixes[g] = (start, length)``: a prefix, stored once; ``suffixes[j] = (start, length, g)``: a
    suffix whose sequence is prefix ``g`` followed by it (its positions continue at the prefix's length).
    A prefix without suffixes is an ordinary packed sequence. Every token belongs to exactly one piece.
    """

    prefixes: tuple[tuple[int, int], ...]
    suffixes: tuple[tuple[int, int, int], ...]
    num_tokens: int

    def __post_init__(self) -> None:
        covered = [(s, n) for s, n in self.prefixes] + [(s, n) for s, n, _ in self.suffixes]
        if any(n <= 0 for _, n in covered) or any(not 0 <= g < len(self.prefixes) for *_, g in self.suffixes):
            raise ValueError(f"PrefixLayout: empty piece or unknown prefix in {self}")
        mark = torch.zeros(self.num_tokens + 1, dtype=torch.long)
        for s, n in covered:
            mark[s : s + n] += 1
        if mark[: self.num_tokens].ne(1).any() or sum(n for _, n in covered) != self.num_tokens:
            raise ValueError(f"PrefixLayout: pieces must cover the {self.num_tokens} tokens exactly once")


def _gather_index(starts: Sequence[int], lengths: Sequence[int], pad: int) -> torch.Tensor:
    """``[S, Lmax]`` flat token index of each piece's tokens, right-padded with ``pad``."""
    width = max(lengths)
    col = torch.arange(width)
    idx = torch.as_tensor(starts)[:, None] + col[None, :]
    return torch.where(col[None, :] < torch.as_tensor(lengths)[:, None], idx, pad)


class SharedPrefixAttention:
    """Causal attention over a packed batch whose sequences share prefixes stored once (`PrefixLayout`).

    A GRPO group's responses share their prompt: packing it once per group instead of once per response
    removes its repeated projections and MLPs from the forward and backward (the "shared-prefix forward"
    of Prefix Grouper, Liu et al. 2025). Each token gets the attention it would get in its own sequence:
    a prefix token attends causally within the prefix, a suffix token to the whole prefix and causally
    within its suffix; the gradients of the prefix sum over the suffixes that read it. SDPA calls per layer:
    the prefixes (right-padded, causal) and the suffixes in up to `MAX_PADDED_CALLS` calls of similar lengths
    (queries right-padded, keys ``prefix + suffix`` gathered per suffix, a mask for the prefix offset), so a
    batch of short and long responses does not pad every one to the longest.
    """

    def __init__(self, layout: PrefixLayout) -> None:
        self.num_tokens = n = layout.num_tokens
        pre_starts = [s for s, _ in layout.prefixes]
        pre_lengths = [m for _, m in layout.prefixes]
        self.pre_index = _gather_index(pre_starts, pre_lengths, n)  # [G, Pmax]
        # the suffixes in up to MAX_PADDED_CALLS attention calls of similar lengths (`_length_buckets`): each
        # (query index [R, Smax], key index [R, Kmax], boolean mask [R, 1, Smax, Kmax])
        self.suffix_calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._float_masks: dict[tuple, torch.Tensor] = {}
        if layout.suffixes:
            starts = torch.tensor([s for s, _, _ in layout.suffixes])
            lengths = torch.tensor([m for _, m, _ in layout.suffixes])
            plen = torch.tensor([pre_lengths[g] for *_, g in layout.suffixes])
            pstart = torch.tensor([pre_starts[g] for *_, g in layout.suffixes])
            for pick in _length_buckets(lengths.tolist(), (plen + lengths).tolist(), MAX_PADDED_CALLS):
                call = self._suffix_call(starts[pick], lengths[pick], plen[pick], pstart[pick], n)
                self.suffix_calls.append(call)
        # flat token -> its row in cat(prefix outputs, suffix outputs)
        self.token_row = _token_rows([self.pre_index, *(call[0] for call in self.suffix_calls)], n)

    @staticmethod
    def _suffix_call(starts, lengths, plen, pstart, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One attention call's indices for these suffixes: queries right-padded with ``n`` (the zero row), keys
        ``prefix + suffix`` per suffix, and the mask of what each query sees."""
        query = _gather_index(starts.tolist(), lengths.tolist(), n)  # [R, Smax]
        width = int((plen + lengths).max())
        t = torch.arange(width)[None, :]
        key = torch.where(t < plen[:, None], pstart[:, None] + t, starts[:, None] + t - plen[:, None])
        key = torch.where(t < (plen + lengths)[:, None], key, n)  # [R, Kmax]
        j = torch.arange(query.shape[1])
        # query j of suffix r sits at sequence position plen[r] + j and sees keys 0 .. plen[r] + j
        mask = (t[:, None, :] <= (plen[:, None] + j[None, :])[:, :, None])[:, None]  # [R, 1, Smax, Kmax]
        return query, key, mask

    def _float_mask(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """Suffix call ``i``'s mask as SDPA turns a boolean one into (0 where seen, -inf elsewhere, ``q``'s dtype),
        made once for all layers: SDPA keeps the mask it was given for backward, and a boolean one would be
        converted, and kept, again in every layer (~200 floats per token and layer for 8 x 8 GRPO rows)."""
        key = (i, q.device, q.dtype)
        if key not in self._float_masks:
            mask = self.suffix_calls[i][2].to(q.device)
            self._float_masks[key] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                mask.logical_not(), float("-inf"))
        return self._float_masks[key]

    def attend(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        n, hq, d = q.shape
        if n != self.num_tokens:
            raise ValueError(f"SharedPrefixAttention built for {self.num_tokens} tokens got {n}")
        gqa = hq != k.shape[1]
        qe, ke, ve = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (q, k, v))  # row n: padding
        ix = self.pre_index.to(q.device)
        out = F.scaled_dot_product_attention(
            _rows(qe, ix), _rows(ke, ix), _rows(ve, ix), is_causal=True, scale=scale, enable_gqa=gqa
        )
        outs = [out]
        for i, (iq, ik, _) in enumerate(self.suffix_calls):
            iq, ik = iq.to(q.device), ik.to(q.device)
            outs.append(F.scaled_dot_product_attention(
                _rows(qe, iq), _rows(ke, ik), _rows(ve, ik), attn_mask=self._float_mask(i, q), scale=scale,
                enable_gqa=gqa,
            ))
        row = self.token_row.to(q.device)  # a gather of SDPA's outputs, which SDPA keeps itself
        return offer(_unpad_cat(row, *outs), _unpad_cat, row, *outs)


class MoERouting:
    """Per-forward MoE routing state: records the routing each MoE layer chose, optionally replays one.

    ``moe_layers`` are the model's MoE layer indices; ``replay [N, len(moe_layers), topk]`` (int), when
    given, is the routing to use instead of the router's own top-k (R3, routing replay). Afterwards
    `recorded()` is the routing the router itself chose ``[N, layers, topk]`` int32 and
    `mismatch_fraction()` the fraction of (token, layer) pairs whose own choice differs from the
    replayed one (compared as sets).
    """

    def __init__(self, moe_layers: Sequence[int], *, replay: torch.Tensor | None = None) -> None:
        self.slot = {layer: i for i, layer in enumerate(moe_layers)}
        if replay is not None and replay.shape[1] != len(self.slot):
            raise ValueError(
                f"routing replay has {replay.shape[1]} MoE layers, the model has {len(self.slot)}"
            )
        self.replay = replay
        self._own: dict[int, torch.Tensor] = {}
        self._mismatch = 0
        self._compared = 0

    def replay_ids(self, layer_idx: int) -> torch.Tensor | None:
        if self.replay is None:
            return None
        return self.replay[:, self.slot[layer_idx]]

    def observe(self, layer_idx: int, own_ids: torch.Tensor, replay_ids: torch.Tensor | None) -> None:
        self._own[layer_idx] = own_ids.detach()
        if replay_ids is not None:
            a = own_ids.detach().sort(-1).values
            b = replay_ids.to(a.dtype).sort(-1).values
            self._mismatch += int((a != b).any(-1).sum())
            self._compared += int(a.shape[0])

    def recorded(self) -> torch.Tensor:
        """``[N, layers, topk]`` int32: the top-k each MoE layer's router chose in this forward."""
        missing = [layer for layer in self.slot if layer not in self._own]
        if missing:
            raise RuntimeError(f"no routing recorded for MoE layers {missing}")
        return torch.stack([self._own[layer] for layer in self.slot], dim=1).to(torch.int32)

    def mismatch_fraction(self) -> float:
        return self._mismatch / self._compared if self._compared else 0.0
