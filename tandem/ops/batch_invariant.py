"""Batch-invariant ("deterministic") numerics shared by the inference engine and the training engines.

In this mode a token's hidden states, logits and log-probs do not depend on what else is in the batch
(other sequences, padding, how many rows a matmul has) nor on whether the token was computed by a
prefill, a decode step or a packed training forward. Rollout log-probs then equal training log-probs
bit for bit, in float32 and bfloat16.

API::

    from tandem.ops import InvariantVarlenAttention, batch_invariant_mode

    with batch_invariant_mode():                      # thread-local; enter it in the thread that runs
        log_probs, _ = model(flat_ids, positions,     # the model
                             InvariantVarlenAttention(cu_seqlens), targets=next_ids, temperature=T)

The embedded inference engine (``TorchEngineConfig(deterministic=True)``) runs the same mode and
computes its KV-cache attention with `invariant_attention`, the function `InvariantVarlenAttention`
uses. `packed_attention(cu_seqlens)` picks the right context for a training forward (invariant inside
the mode, the stock `VarlenAttention` outside).

Why results depend on the batch on CPU, and what the mode does about it (measured, see
docs/inference.md):

* **Matmul row count.** GEMM libraries take other code paths for products with few rows and round
  differently there. oneDNN (float32 and bfloat16, what ``F.linear`` runs in the mode, see
  tandem/ops/linear.py) gives every output row the same bits for any row count >= 2, any row
  offset and any thread count (bfloat16: with AVX-512 BF16 kernels; with AMX, where they are not, in
  products of exactly `BF16_TILE` rows, `bf16_invariant_path`); MKL's float32 SGEMM (the fallback, and the batched attention products)
  does so at exactly 4 or 8 rows and from 12 rows on. `invariant_linear` pads the rows of a small
  product up to such a count (`padded_rows`): a decode step of one sequence computes 2 (or 4) rows
  instead of 1, so the cost is a few extra rows, not fixed tiles.
* **Attention length.** GEMM results also depend on the length of the reduced dimension (MKL
  blocks it differently), so ``P @ V`` over "all keys so far" changes with the sequence length and a
  decode step disagrees with a prefill. `invariant_attention` keeps the softmax over a key buffer
  padded to a multiple of `KEY_TILE` (the softmax of a row does not change when ``-inf`` columns are
  appended) and computes ``P @ V`` as one fixed-size ``[rows, KEY_TILE] @ [KEY_TILE, D]`` product per
  key tile, summed over tiles in a fixed order; tiles past a query's position contribute exact zeros.
* **Elementwise tails.** Vectorised kernels compute the last ``numel % vector_width`` elements with
  scalar code; for ``sigmoid``/``silu`` that rounds differently, so a row's result would depend on
  where it sits in the tensor. The mode computes SiLU as ``x / (1 + exp(-x))`` (``exp``, ``+`` and
  ``/`` give the same bits on both paths).

Everything else the model does (RMSNorm, rotary, softmax, logsumexp, embedding, MoE routing in
expert order) was measured to be row-invariant already. The mode is differentiable, so a training
engine can also train under it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tandem.ops.linear import PackedOnlyWeight, PackedWeights, _compute_dtype, fast_linear, uses_onednn

__all__ = [
    "KEY_TILE",
    "BF16_TILE",
    "bf16_invariant_path",
    "InvariantSharedPrefixAttention",
    "InvariantVarlenAttention",
    "batch_invariant_mode",
    "group_queries",
    "invariant_attention",
    "invariant_linear",
    "invariant_silu",
    "is_batch_invariant",
    "is_invariant_mode",
    "packed_attention",
    "padded_rows",
    "round_up",
    "ungroup_queries",
]

KEY_TILE = 64  # keys per fixed-size P @ V product; key buffers are padded to a multiple of it
_MAX_SCORE_ELEMENTS = 1 << 24  # query rows are processed in chunks so scores stay below ~64 MB

_state = threading.local()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_rows(m: int) -> int:
    """Rows an MKL float32 product of ``m`` rows is computed with: the smallest row-invariant count >= m.

    Measured on this machine's MKL (float32) with 1 and 2 threads, with and without bias, plain and
    batched: 4, 8 and every count >= 12 give each row the same bits as any other such count.
    """
    if m <= 4:
        return 4
    if m <= 8:
        return 8
    return max(m, 16)


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    packed: PackedWeights | None = None,
) -> torch.Tensor:
    """``F.linear`` whose every output row is independent of the number of rows in ``x [..., K]``.

    ``packed`` (`tandem.ops.linear.pack_weights`) gives the same bits as the plain weights, faster.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    onednn = uses_onednn(x2, weight) or isinstance(weight, PackedOnlyWeight)
    if onednn and _compute_dtype(x2, weight) == torch.bfloat16 and (path := bf16_invariant_path()) != "native":
        if path == "float32":
            return _bf16_through_float32(x, weight, bias, packed)
        y = _tiled(x2, weight, bias, packed)
        return y.reshape(*lead, y.shape[-1])
    mp = max(m, 2) if onednn else padded_rows(m)
    if mp != m:
        x2 = F.pad(x2, (0, 0, 0, mp - m))
    y = fast_linear(x2, weight, bias, packed=packed, few_rows=False)  # oneDNN's bits: the trainer's
    if mp != m:
        y = y[:m]
    return y.reshape(*lead, y.shape[-1])


BF16_TILE = 64  # rows per oneDNN bf16 product where its kernels pick paths by row count (AMX)
_BF16_PATH: list[str] = []


def bf16_invariant_path() -> str:
    """How the mode computes a oneDNN bfloat16 linear on this CPU, probed once per process (~50 ms: three of
    SmolLM2's shapes, 7 row counts, 3 offsets):

    * ``"native"``: oneDNN's bf16 rows are row-invariant for >= 2 rows (AVX-512 BF16 kernels): as float32;
    * ``"tiled"``: they are not (AMX, Sapphire Rapids and later: rows of a 2-32-row product differ from the
      same rows of a 300-row one), but a product of exactly `BF16_TILE` rows gives every row the same bits
      whatever the other rows: the rows are computed in tiles of that many, the last padded with zeros;
    * ``"float32"``: neither holds: each product runs in float32 on the widened operands (slower)."""
    if not _BF16_PATH:
        _BF16_PATH.append(_probe_bf16())
    return _BF16_PATH[0]


def _probe_bf16() -> str:
    g = torch.Generator().manual_seed(0)
    native = tiled = True
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for n, k in ((1536, 576), (576, 1536), (192, 576)):
            w = torch.randn(n, k, generator=g).to(torch.bfloat16)
            x = torch.randn(300, k, generator=g).to(torch.bfloat16)
            if not uses_onednn(x, w):
                return "native"  # bf16 takes F.linear here (no oneDNN bf16): the mode pads rows for MKL instead
            full, full_tiled = fast_linear(x, w), _tiled(x, w, None, None)
            for m in (2, 3, 5, 17, 33, 64, 129):
                for start in (0, 7, 100):
                    native = native and torch.equal(fast_linear(x[start : start + m], w), full[start : start + m])
                    tiled = tiled and torch.equal(_tiled(x[start : start + m], w, None, None),
                                                  full_tiled[start : start + m])
    return "native" if native else "tiled" if tiled else "float32"


def _tiled(x2: torch.Tensor, weight, bias, packed) -> torch.Tensor:
    """``x2 [M, K]`` times the weight in products of exactly `BF16_TILE` rows (the last padded with zeros)."""
    m = x2.shape[0]
    mp = round_up(max(m, 1), BF16_TILE)
    if mp != m:
        x2 = F.pad(x2, (0, 0, 0, mp - m))
    if mp == BF16_TILE:
        return fast_linear(x2, weight, bias, packed=packed)[:m]
    return torch.cat([fast_linear(x2[i : i + BF16_TILE], weight, bias, packed=packed)
                      for i in range(0, mp, BF16_TILE)])[:m]


def _bf16_through_float32(x, weight, bias, packed) -> torch.Tensor:
    """A bfloat16 product where oneDNN's bf16 kernels are not row-invariant, tiled or not (`bf16_invariant_path`): the
    bf16 operands are widened to float32 (exactly), multiplied by the row-invariant float32 kernel and the
    result rounded to bfloat16 once, as a bf16 GEMM with float32 accumulation does. The float32 copy of the
    weight is made per product (and kept for backward in training): slower, the price of exact rollouts."""
    if isinstance(weight, PackedOnlyWeight):
        weight = packed[id(weight)].to_dense()
    with torch.autocast("cpu", enabled=False):
        wide = [t if t is None else t.to(torch.bfloat16).float() for t in (x, weight, bias)]
        return invariant_linear(*wide).to(torch.bfloat16)


def invariant_silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """SiLU computed identically for every element (no scalar tail path); float32 inside."""
    xf = x.float()
    y = (xf / (1.0 + torch.exp(-xf))).to(x.dtype)
    if inplace:
        return x.copy_(y)
    return y


class _BatchInvariantMode(TorchFunctionMode):
    def __init__(self, packed: PackedWeights | None) -> None:
        super().__init__()
        self.packed = packed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs, packed=self.packed)
        if func is F.silu:
            return invariant_silu(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True, *, packed: PackedWeights | None = None) -> Iterator[None]:
    """Run the enclosed model code with batch-invariant numerics (this thread only; re-entrant).

    Inside, ``F.linear`` (every ``nn.Linear`` and the vocabulary projection of the log-prob helpers)
    and ``F.silu`` are replaced by their invariant versions. Attention is not a torch function: use
    `InvariantVarlenAttention` (training) or an engine context built on `invariant_attention`.
    ``packed``: oneDNN-packed weight copies (`tandem.ops.linear.pack_weights`), same bits, faster.
    """
    if not enabled:
        yield
        return
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        with _BatchInvariantMode(packed):
            yield
    finally:
        _state.depth = depth


def is_invariant_mode(mode) -> bool:
    """Whether ``mode`` (a torch function mode) is the one `batch_invariant_mode` enters."""
    return isinstance(mode, _BatchInvariantMode)


def is_batch_invariant() -> bool:
    """Whether the calling thread is inside `batch_invariant_mode`."""
    return getattr(_state, "depth", 0) > 0


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``q [n, Hq, D]`` -> ``[Hkv, n * G, D]``: the rows that share a KV head, row ``i * G + g``."""
    n, hq, d = q.shape
    g = hq // num_kv_heads
    return q.view(n, num_kv_heads, g, d).transpose(0, 1).reshape(num_kv_heads, n * g, d)


def ungroup_queries(out: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `group_queries`: ``[Hkv, n * G, D]`` -> ``[n, Hq, D]``."""
    hkv, rows, d = out.shape
    g = rows // n
    return out.reshape(hkv, n, g, d).transpose(0, 1).reshape(n, hkv * g, d)


def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_limit: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention whose result per query row does not depend on the other rows or the buffer length.

    ``q [S, Hkv, M, D]`` (the query rows sharing each KV head, `group_queries`), ``k, v [S, Hkv, L, D]``
    with ``L`` a multiple of `KEY_TILE` (a view of a KV cache or a zero-padded buffer; keys past a
    row's limit may hold any finite values), ``key_limit [S, M]`` int: row ``m`` attends keys
    ``0 .. key_limit[s, m] - 1`` (``>= 1``). Returns ``[S, Hkv, M, D]`` in ``q.dtype``.

    ``M`` is padded internally to `padded_rows`; ``L`` may differ between calls (longer buffers only add
    masked keys), so a decode step, a chunked prefill and a packed training forward give the same bits.
    """
    s, hkv, m, d = q.shape
    length = k.shape[2]
    if length % KEY_TILE:
        raise ValueError(
            f"invariant_attention: key length {length} must be a multiple of KEY_TILE={KEY_TILE}"
        )
    mp = padded_rows(m)
    if mp != m:
        q = F.pad(q, (0, 0, 0, mp - m))
        key_limit = F.pad(key_limit, (0, mp - m), value=1)
    rows_per_chunk = padded_rows(max(1, _MAX_SCORE_ELEMENTS // max(1, s * hkv * length)))
    if rows_per_chunk >= mp:
        return _invariant_attention_rows(q, k, v, key_limit, scale)[:, :, :m]
    outs = []
    for r in range(0, mp, rows_per_chunk):
        rows = min(rows_per_chunk, mp - r)
        qc, lc = q[:, :, r : r + rows], key_limit[:, r : r + rows]
        rp = padded_rows(rows)
        if rp != rows:
            qc, lc = F.pad(qc, (0, 0, 0, rp - rows)), F.pad(lc, (0, rp - rows), value=1)
        outs.append(_invariant_attention_rows(qc, k, v, lc, scale)[:, :, :rows])
    return torch.cat(outs, dim=2)[:, :, :m]


def _invariant_attention_rows(q, k, v, key_limit, scale):
    s, hkv, m, d = q.shape
    length = k.shape[2]
    tiles = length // KEY_TILE
    if q.dtype == torch.float32:
        scores = torch.matmul(q, k.transpose(-1, -2))  # [S, Hkv, M, L]
    else:
        # oneDNN copies a transposed strided key view, and K @ q^T is row-invariant in bf16 too
        scores = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2)
    scores = scores.float() * scale
    allowed = torch.arange(length, device=q.device) < key_limit[:, :, None]  # [S, M, L]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    probs_t = probs.view(s, hkv, m, tiles, KEY_TILE).transpose(2, 3)  # [S, Hkv, tiles, M, T]
    partial = torch.matmul(probs_t, v.reshape(s, hkv, tiles, KEY_TILE, d))  # [S, Hkv, tiles, M, D]
    return partial.sum(dim=2, dtype=torch.float32).to(q.dtype)


class InvariantVarlenAttention:
    """Packed causal attention (like `VarlenAttention`) with the numerics of the engine's KV cache.

    ``cu_seqlens [S + 1]``: cumulative lengths of the packed sequences (``cu_seqlens[-1] == N``); every
    token attends to the earlier tokens of its own sequence. Use it under `batch_invariant_mode`.
    """

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        cu = cu_seqlens.to(torch.long).cpu()
        lengths = cu[1:] - cu[:-1]
        if lengths.numel() == 0 or (lengths <= 0).any():
            raise ValueError(
                f"InvariantVarlenAttention: every sequence needs >= 1 token, got lengths {lengths.tolist()}"
            )
        self.starts = cu[:-1].tolist()
        self.lengths = lengths.tolist()
        self.num_tokens = int(cu[-1])

    @classmethod
    def from_lengths(cls, lengths) -> InvariantVarlenAttention:
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        return cls(F.pad(torch.cumsum(lengths, 0), (1, 0)))

    def attend(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        n = q.shape[0]
        if n != self.num_tokens:
            raise ValueError(f"InvariantVarlenAttention built for {self.num_tokens} tokens got {n}")
        outs = [_attend_piece(q, k, v, start, length, None, scale) for start, length in zip(self.starts, self.lengths, strict=True)]
        return torch.cat(outs, dim=0)


def _attend_piece(q, k, v, start: int, length: int, prefix: tuple[int, int] | None, scale: float) -> torch.Tensor:
    """Invariant causal attention of tokens ``start .. start + length - 1`` of a packed batch, optionally
    behind ``prefix = (start, length)``: the keys are then the prefix's followed by the piece's own."""
    hq, hkv = q.shape[1], k.shape[1]
    ks, vs = k[start : start + length], v[start : start + length]
    before = 0
    if prefix is not None:
        ps, before = prefix
        ks, vs = torch.cat([k[ps : ps + before], ks]), torch.cat([v[ps : ps + before], vs])
    total = before + length
    padded = round_up(total, KEY_TILE)
    kp = F.pad(ks.transpose(0, 1), (0, 0, 0, padded - total))
    vp = F.pad(vs.transpose(0, 1), (0, 0, 0, padded - total))
    rows = group_queries(q[start : start + length], hkv)  # [Hkv, length * G, D]
    limit = torch.arange(before + 1, total + 1, device=q.device).repeat_interleave(hq // hkv)
    out = invariant_attention(rows[None], kp[None], vp[None], limit[None], scale)[0]
    return ungroup_queries(out, length)


class InvariantSharedPrefixAttention:
    """`SharedPrefixAttention` (prompts stored once, `PrefixLayout`) with the numerics of the engine's KV
    cache: a suffix's rows see ``prefix + suffix`` keys, the bits they get in their own sequence."""

    def __init__(self, layout) -> None:
        self.num_tokens = layout.num_tokens
        pieces = [(s, m, None) for s, m in layout.prefixes]
        pieces += [(s, m, layout.prefixes[g]) for s, m, g in layout.suffixes]
        self.pieces = sorted(pieces, key=lambda p: p[0])

    def attend(self, layer_idx: int, q, k, v, scale: float) -> torch.Tensor:
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"InvariantSharedPrefixAttention built for {self.num_tokens} tokens got {q.shape[0]}")
        return torch.cat([_attend_piece(q, k, v, s, m, pre, scale) for s, m, pre in self.pieces], dim=0)


def packed_attention(cu_seqlens: torch.Tensor, layout=None):
    """The attention context for a packed training forward: invariant inside `batch_invariant_mode`.

    Lets a training engine build its context in one place: `InvariantVarlenAttention` when the calling
    thread is in the mode, the stock `tandem.models.attention.VarlenAttention` otherwise; with a
    ``layout`` (`tandem.models.attention.PrefixLayout`, prompts stored once) their shared-prefix forms.
    """
    if layout is not None:
        if is_batch_invariant():
            return InvariantSharedPrefixAttention(layout)
        from tandem.models.attention import SharedPrefixAttention

        return SharedPrefixAttention(layout)
    if is_batch_invariant():
        return InvariantVarlenAttention(cu_seqlens)
    from tandem.models.attention import VarlenAttention

    return VarlenAttention(cu_seqlens)
