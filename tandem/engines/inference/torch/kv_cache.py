"""The preallocated KV cache and the attention context of one engine step.

The cache holds ``num_slots`` sequence slots per layer: ``k[layer], v[layer]`` are ``[slots, Hkv, slot_len,
D]`` tensors, one pair per layer rather than one ``[layers, ...]`` block, so that a colocated engine's
`wake_up` can place them in the memory a training step just freed: the host allocator (tcmalloc) keeps
that memory as spans of a few MiB to tens of MiB between the step's long-lived tensors, and two
141 MB blocks (SmolLM2, 64 slots of 96 tokens) fit in none of them, so the heap grew by their size at the
first wake-up after training (measured on the LoRA recipe, docs/benchmarks.md).

A sequence owns one slot while it runs and its keys sit contiguously at positions ``0 .. len - 1``,
so decode attention over a range of slots reads the cache in place (a strided view, no gather): on a
CPU the step is bound by memory traffic, and a paged layout would have to copy every key each step.

`StepAttention` is the `AttentionContext` of one forward that mixes sequences: first one decode token
per running sequence (ordered by slot), then prompt chunks. Each layer writes the new keys/values into
the cache and attends over the cache: decode rows in one batched product over the slot range, each
prompt chunk on its own (causal within the chunk, everything before it from the cache); with the native
kernel (`tandem.ops.native`), decode rows and every chunk of at most `SMALL_CHUNK` rows in one call. With
``deterministic=True`` both use `tandem.ops.invariant_attention`, the numerics of the training side's
`InvariantVarlenAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.ops import native
from tandem.ops.batch_invariant import KEY_TILE, group_queries, invariant_attention, round_up, ungroup_queries

__all__ = ["KVCache", "PrefillChunk", "StepAttention"]

SMALL_CHUNK = 16  # prompt/verification chunks of at most this many rows take `_small_chunk_attention`


class KVCache:
    """``k[layer], v[layer]``: ``[num_slots, Hkv, slot_len, D]`` per layer (module docstring), allocated once
    (zeros); `release` frees them."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        slot_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.shape = (num_layers, num_slots, num_kv_heads, slot_len, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots, self.slot_len = num_slots, slot_len
        self.k: list[torch.Tensor] | None = None
        self.v: list[torch.Tensor] | None = None
        self.allocate()

    @property
    def allocated(self) -> bool:
        return self.k is not None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return 2 * n * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self) -> None:
        if self.k is None:
            layer = self.shape[1:]
            self.k = [torch.zeros(layer, dtype=self.dtype, device=self.device) for _ in range(self.shape[0])]
            self.v = [torch.zeros(layer, dtype=self.dtype, device=self.device) for _ in range(self.shape[0])]

    def release(self) -> None:
        self.k = self.v = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the keys/values of positions ``0 .. length - 1`` of every layer to another slot."""
        if length > 0:
            for k, v in zip(self.k, self.v, strict=True):
                k[dst_slot, :, :length] = k[src_slot, :, :length]
                v[dst_slot, :, :length] = v[src_slot, :, :length]


@dataclass(slots=True)
class PrefillChunk:
    """``count`` prompt tokens of the sequence in ``slot``, at positions ``start .. start + count - 1``."""

    slot: int
    start: int
    count: int


class StepAttention:
    """Attention context of one step: ``decode_slots`` (ascending), then ``prefills``, in token order.

    ``decode_lengths[i]`` is the number of keys of decode sequence ``i`` including its new token.
    """

    def __init__(
        self,
        cache: KVCache,
        decode_slots: list[int],
        decode_lengths: list[int],
        prefills: list[PrefillChunk],
        *,
        deterministic: bool,
        native_lib=None,
    ) -> None:
        self.cache, self.deterministic = cache, deterministic
        self.native = native_lib  # tandem.ops.native's library: decode rows + short chunks through it (normal mode)
        self.decode_slots, self.prefills = decode_slots, prefills
        self.num_decode = len(decode_slots)
        dev = cache.device
        slots = list(decode_slots)
        positions = [n - 1 for n in decode_lengths]
        for c in prefills:
            slots += [c.slot] * c.count
            positions += range(c.start, c.start + c.count)
        self.num_tokens = len(slots)
        # row of each (token, kv head) in a layer's cache viewed as [slots * Hkv * slot_len, D]
        _, _, hkv, slot_len, _ = cache.shape
        token_rows = torch.tensor(slots, dtype=torch.long) * (hkv * slot_len) + torch.tensor(
            positions, dtype=torch.long
        )
        self.write_rows = (token_rows[:, None] + torch.arange(hkv) * slot_len).reshape(-1).to(dev)
        if decode_slots:
            self.lo, self.hi = decode_slots[0], decode_slots[-1] + 1
            span = self.hi - self.lo
            self.dense = span == len(decode_slots)  # decode slots are exactly lo .. hi - 1
            limit = torch.ones(span, dtype=torch.long)
            rows = torch.tensor(decode_slots, dtype=torch.long) - self.lo
            limit[rows] = torch.tensor(decode_lengths, dtype=torch.long)
            self.decode_rows = rows.to(dev)
            self.decode_limit = limit.to(dev)  # [span]; slots in the range that do not decode: 1 key
            max_len = max(decode_lengths)
            self.decode_keys = round_up(max_len, KEY_TILE) if deterministic else max_len
        if native_lib is not None:
            self._plan_native(decode_slots, decode_lengths, prefills)

    def _plan_native(self, decode_slots, decode_lengths, prefills) -> None:
        """Rows for the native kernel, computed once per step: every decode row and every row of a chunk of
        at most `SMALL_CHUNK` tokens (row ``i`` of a chunk sees positions ``< start + i + 1``); longer chunks
        keep SDPA."""
        rows, slots, limits = list(range(len(decode_slots))), list(decode_slots), list(decode_lengths)
        self.large_chunks: list[tuple[int, PrefillChunk]] = []
        offset = len(decode_slots)
        for chunk in prefills:
            if chunk.count <= SMALL_CHUNK:
                rows += range(offset, offset + chunk.count)
                slots += [chunk.slot] * chunk.count
                limits += range(chunk.start + 1, chunk.start + chunk.count + 1)
            else:
                self.large_chunks.append((offset, chunk))
            offset += chunk.count
        dev = self.cache.device
        self.native_all = len(rows) == self.num_tokens
        self.native_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self.native_slots = torch.tensor(slots, dtype=torch.long, device=dev)
        self.native_limit = torch.tensor(limits, dtype=torch.long, device=dev)
        self.native_max = max(limits, default=1)

    def attend(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        """``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` of this step's tokens -> ``[N, Hq, D]``."""
        cache_k, cache_v = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [slots, Hkv, L, D]
        d = k.shape[-1]
        hq, hkv = q.shape[1], cache_k.shape[1]
        if (self.native is not None and len(self.native_rows) and native.supports(hq // hkv, d, q.dtype, q.device)
                and k.dtype == cache_k.dtype):
            if self.native_all:  # the kernel writes the step's keys and values itself, then reads
                return self._native_attend(q, cache_k, cache_v, scale, k, v)
            self._write(cache_k, cache_v, k, v)
            return self._native_attend(q, cache_k, cache_v, scale)
        self._write(cache_k, cache_v, k, v)
        if not self.prefills:
            return self._decode(q, cache_k, cache_v, scale)
        out = torch.empty_like(q)
        if self.num_decode:
            out[: self.num_decode] = self._decode(q[: self.num_decode], cache_k, cache_v, scale)
        offset = self.num_decode
        for chunk in self.prefills:
            rows = slice(offset, offset + chunk.count)
            out[rows] = self._prefill(q[rows], chunk, cache_k, cache_v, scale)
            offset += chunk.count
        return out

    def _write(self, cache_k, cache_v, k, v) -> None:
        """This step's keys and values into their slots' rows of one layer's cache."""
        d = k.shape[-1]
        cache_k.view(-1, d).index_copy_(0, self.write_rows, k.reshape(-1, d))
        cache_v.view(-1, d).index_copy_(0, self.write_rows, v.reshape(-1, d))

    def _native_attend(self, q, cache_k, cache_v, scale, k=None, v=None) -> torch.Tensor:
        """Decode rows and short chunks in one call of the native kernel; long chunks through `_prefill`.
        With ``k, v`` (every row native), the kernel writes them into the cache first (row ``i``'s at its
        position, ``native_limit[i] - 1``), as `_write` would."""
        n, hq, d = q.shape
        hkv = cache_k.shape[1]
        rows = q if self.native_all else q.index_select(0, self.native_rows)
        got = native.decode_attention(self.native, rows.view(-1, hkv, hq // hkv, d), cache_k, cache_v,
                                      self.native_slots, self.native_limit, scale, self.native_max,
                                      new_k=k, new_v=v)
        if self.native_all:
            return got.view(n, hq, d)
        out = torch.empty_like(q)
        if len(self.native_rows):
            out.index_copy_(0, self.native_rows, got.view(-1, hq, d))
        for offset, chunk in self.large_chunks:
            out[offset : offset + chunk.count] = self._prefill(q[offset : offset + chunk.count], chunk, cache_k,
                                                                cache_v, scale)
        return out

    def _decode(self, q, cache_k, cache_v, scale) -> torch.Tensor:
        b, hq, d = q.shape
        hkv = cache_k.shape[1]
        span = self.hi - self.lo
        grouped = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]: one query row per head of the group
        if not self.dense:
            full = grouped.new_zeros(span, hkv, hq // hkv, d)
            full[self.decode_rows] = grouped
            grouped = full
        keys = cache_k[self.lo : self.hi, :, : self.decode_keys]
        values = cache_v[self.lo : self.hi, :, : self.decode_keys]
        if self.deterministic:
            limit = self.decode_limit[:, None].expand(span, hq // hkv)
            out = invariant_attention(grouped, keys, values, limit, scale)
        else:
            out = _masked_attention(grouped, keys, values, self.decode_limit, scale)
        if not self.dense:
            out = out[self.decode_rows]
        return out.reshape(b, hq, d)

    def _prefill(self, q, chunk: PrefillChunk, cache_k, cache_v, scale) -> torch.Tensor:
        n, hq, d = q.shape
        hkv = cache_k.shape[1]
        end = chunk.start + n
        if self.deterministic:
            length = round_up(end, KEY_TILE)
            keys = cache_k[chunk.slot : chunk.slot + 1, :, :length]
            values = cache_v[chunk.slot : chunk.slot + 1, :, :length]
            limit = torch.arange(chunk.start + 1, end + 1, device=q.device).repeat_interleave(hq // hkv)
            out = invariant_attention(group_queries(q, hkv)[None], keys, values, limit[None], scale)[0]
            return ungroup_queries(out, n)
        if n <= SMALL_CHUNK:
            return _small_chunk_attention(q, cache_k[chunk.slot, :, :end], cache_v[chunk.slot, :, :end],
                                          chunk.start, scale)
        keys = cache_k[chunk.slot, :, :end][None]
        values = cache_v[chunk.slot, :, :end][None]
        mask = None
        if chunk.start:
            mask = (
                torch.arange(end, device=q.device)[None, :]
                <= torch.arange(chunk.start, end, device=q.device)[:, None]
            )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=hq != hkv,
        )  # [1, Hq, n, D]
        return out[0].transpose(0, 1)


def _small_chunk_attention(q, keys, values, start: int, scale: float) -> torch.Tensor:
    """``q [n, Hq, D]`` at positions ``start .. start + n - 1`` over one slot's ``keys, values [Hkv, end, D]``,
    causally: the decode path's two batched products with the chunk's query rows stacked per key head (a
    speculative verification's ``k + 1`` rows, a short prompt chunk). SDPA's flash kernel costs ~60 us per
    call on a CPU whatever the size, this ~25 us at a handful of rows (not used in deterministic mode)."""
    n, hq, d = q.shape
    hkv, end = keys.shape[0], keys.shape[1]
    g = hq // hkv
    grouped = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # rows (head of group, token)
    if q.dtype == torch.float32:
        scores = torch.matmul(grouped, keys.transpose(-1, -2))  # [Hkv, G * n, end]
    else:
        scores = torch.matmul(keys, grouped.transpose(-1, -2)).transpose(-1, -2)
    scores = scores.float() * scale
    position = torch.arange(start, start + n, device=q.device).repeat(g)  # [G * n]
    allowed = torch.arange(end, device=q.device)[None, :] <= position[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [Hkv, G * n, D]
    return out.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def _masked_attention(q, k, v, limit, scale) -> torch.Tensor:
    """``q [S, Hkv, G, D]`` over ``k, v [S, Hkv, L, D]``, row ``s`` seeing keys ``< limit[s]``."""
    if q.dtype == torch.float32:
        scores = torch.matmul(q, k.transpose(-1, -2))  # [S, Hkv, G, L]
    else:
        # oneDNN copies a transposed strided key view; K @ q^T reads the cache as it lies
        scores = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2)
    scores = scores.float() * scale
    allowed = torch.arange(k.shape[2], device=q.device)[None, :] < limit[:, None]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
