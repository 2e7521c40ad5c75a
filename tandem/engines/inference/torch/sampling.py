"""Token sampling with per-sequence generators, and the log-prob convention of core/protocols.py.

For one step the engine hands over the float32 logits of the rows that need a new token ``[R, V]``
and one `RowSampler` per row. Each row is sampled by inverse-CDF sampling: one uniform number from
the row's own ``torch.Generator`` against the cumulative distribution in vocabulary order. A row's
token therefore depends only on its logits and its generator, never on the other rows, which is what
makes "same seed, same output" hold when requests are batched with others.

The returned log-prob is that of the sampled token under ``log_softmax(logits / T)`` over the full
vocabulary, computed with the same operations as `tandem.models.logprobs` (scale, ``logsumexp``,
gather, subtract), so the engine and a trainer give the same bits for the same hidden states. top-k
and top-p only restrict which tokens can be drawn (top-k first, then top-p over what is left,
renormalised); they do not change the returned log-prob. ``T == 0`` is greedy (argmax) with the
log-prob of ``log_softmax(logits)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engines.inference.common import derive_seed

__all__ = ["RowSampler", "derive_seed", "filtered_probs", "inverse_cdf", "sample_tokens", "scale_logits",
           "token_log_probs"]

@dataclass(slots=True)
class RowSampler:
    """How one sequence draws its next token."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_tokens(logits: torch.Tensor, rows: list[RowSampler], native=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [R, V]`` float32 -> ``tokens [R]`` int64 and their ``log_probs [R]`` float32.

    ``native``: the loaded ``sample`` kernel (tandem.ops.native), used when no row restricts top-k / top-p:
    the same draw (each row's uniform number from its own generator, inverse CDF in vocabulary order) in
    three passes over the logits instead of five; tokens and log-probs differ from this function's torch
    path by float rounding only (the log-sum-exp summed in another order), so the deterministic mode does not
    use it."""
    num_rows, vocab = logits.shape
    if (native is not None and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and all(r.greedy or ((r.top_k <= 0 or r.top_k >= vocab) and r.top_p >= 1.0) for r in rows)):
        from tandem.ops.native import sample

        temps = torch.tensor([0.0 if r.greedy else float(r.temperature) for r in rows], dtype=torch.float32)
        uniforms = [0.0 if r.greedy else torch.rand(1, generator=r.generator, dtype=torch.float64).item() for r in rows]
        return sample(native, logits, temps, torch.tensor(uniforms, dtype=torch.float64))
    scaled = scale_logits(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if len(greedy) == num_rows:
        tokens = logits.argmax(dim=-1)
    elif not greedy:
        tokens = _draw(scaled, rows, vocab)
    else:
        tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        random = [i for i, r in enumerate(rows) if not r.greedy]
        g_idx, r_idx = torch.tensor(greedy, device=logits.device), torch.tensor(random, device=logits.device)
        tokens[g_idx] = logits[g_idx].argmax(dim=-1)
        tokens[r_idx] = _draw(scaled[r_idx], [rows[i] for i in random], vocab)
    return tokens, token_log_probs(scaled, tokens)


def scale_logits(logits: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    """``logits / T`` per row (``T = 1`` for greedy rows): the log-prob convention's scaling."""
    temps = [1.0 if r.greedy else float(r.temperature) for r in rows]
    if all(t == 1.0 for t in temps):
        return logits
    # division by a per-row column gives the same bits as the trainer's division by a scalar
    return logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]


def token_log_probs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(scaled)`` at ``tokens``, with the operations of `tandem.models.logprobs`."""
    lse = torch.logsumexp(scaled, dim=-1)
    return scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse


def _draw(scaled: torch.Tensor, rows: list[RowSampler], vocab: int) -> torch.Tensor:
    """Inverse-CDF draw per row from ``softmax(scaled)`` restricted by top-k / top-p."""
    probs = filtered_probs(scaled, rows, vocab)
    uniforms = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in rows])
    return inverse_cdf(probs, uniforms.to(probs.device))


def filtered_probs(scaled: torch.Tensor, rows: list[RowSampler], vocab: int) -> torch.Tensor:
    """``softmax(scaled)`` with what top-k / top-p exclude set to 0 (not renormalised): the sampling
    distribution of each row up to its total."""
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    top_k = [r.top_k if 0 < r.top_k < vocab else 0 for r in rows]
    if any(top_k):
        kmax = max(top_k)
        kth = torch.topk(probs, kmax, dim=-1).values  # [R, kmax] descending
        k_idx = torch.tensor([max(k, 1) - 1 if k else kmax - 1 for k in top_k], device=probs.device)
        threshold = kth.gather(-1, k_idx[:, None])
        limited = torch.tensor([bool(k) for k in top_k], device=probs.device)[:, None]
        probs = torch.where(limited & (probs < threshold), 0.0, probs)
    top_p = [r.top_p for r in rows]
    if any(p < 1.0 for p in top_p):
        sorted_probs = probs.sort(dim=-1, descending=True).values
        cum = sorted_probs.cumsum(-1)
        total = cum[:, -1:]
        p = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]
        # keep the smallest prefix of the sorted tokens whose mass reaches top_p of what is left
        keep = (cum - sorted_probs) < p * total
        threshold = torch.where(keep, sorted_probs, torch.inf).min(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, 0.0, probs)
    return probs


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Token ``t`` per row with ``CDF(t - 1) <= u * total < CDF(t)``, in two levels.

    A full-vocabulary float64 CDF would allocate ``R x V`` doubles every step; instead the draw first
    picks a block of ``block`` tokens from the float64 CDF of block masses, then a token from the CDF
    inside that block. Only tokens of non-zero probability can be returned.
    """
    num_rows, vocab = probs.shape
    pad = -vocab % block
    blocks = F.pad(probs, (0, pad)).view(num_rows, -1, block) if pad else probs.view(num_rows, -1, block)
    block_mass = blocks.sum(-1).double()  # [R, V / block]
    block_cdf = block_mass.cumsum(-1)
    target = uniforms[:, None] * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]
    # u * total may round up to the total: stay within the last block that has mass
    block_ids = torch.arange(block_mass.shape[1], device=probs.device)
    chosen = torch.minimum(chosen, torch.where(block_mass > 0, block_ids, 0).amax(-1, keepdim=True))
    before = torch.where(chosen > 0, block_cdf.gather(-1, (chosen - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, chosen[:, :, None].expand(-1, -1, block)).squeeze(1)  # [R, block]
    inside_cdf = inside.cumsum(-1, dtype=torch.float64)
    offset = torch.searchsorted(inside_cdf, target - before, right=True)
    # rounding between the two levels may point one past the block's last token of non-zero mass
    positions = torch.arange(block, device=probs.device)
    last_nonzero = torch.where(inside > 0, positions, -1).amax(-1, keepdim=True)
    return (chosen * block + torch.minimum(offset, last_nonzero)).squeeze(-1)
