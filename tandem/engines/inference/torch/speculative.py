"""Speculative decoding in the embedded engine: drafters, and verification by speculative sampling.

A decoding sequence with a draft ``d_1 .. d_k`` runs in the step's forward as a chunk of ``k + 1`` rows,
its last token and the draft, at positions ``L - 1 .. L - 1 + k`` (the attention path of a prompt chunk:
causal inside the chunk, the cache before it). Row ``i`` gives the target's distribution of the token
at position ``L + i``. `speculative_sample` walks the draft: token ``d_{i+1}`` is accepted with probability
``p_i(d_{i+1})`` (``min(1, p/q)`` with the n-gram drafter's point mass ``q = 1``); at the first rejection a
token is drawn from ``p_i`` with ``d_{i+1}`` removed (``normalise(max(0, p - q))``), and if every draft
token is accepted a bonus token is drawn from ``p_k``. Each emitted token is thereby distributed exactly as
``p`` (temperature, top-k, top-p as the engine samples them); greedy rows accept a draft token when it is
the argmax. The random numbers come from the sequence's own generator, so a seeded request gives the same
output every time (not the output it gives without speculation: the draws are used differently).

The engine then keeps the keys/values of the last token and the accepted draft tokens (``num_cached``
moves past them) and ignores the rest of the chunk's rows: a rejected token's keys/values stay in the
slot past the sequence's length, where nothing reads them and the next step overwrites them (the KV
rollback). The log-probs recorded are the target's under the engine's convention, ``log_softmax(logits /
T)`` of that row (`tandem.engines.inference.torch.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.speculative import SpeculativeConfig
from tandem.engines.inference.torch.kv_cache import PrefillChunk
from tandem.engines.inference.torch.sampling import (
    RowSampler,
    filtered_probs,
    inverse_cdf,
    scale_logits,
    token_log_probs,
)

__all__ = ["DraftDist", "NgramDrafter", "SpecStats", "accept_drafts", "apply_verification", "draft_for_verification", "make_drafter",
           "next_k", "speculative_sample"]


def make_drafter(model, config: SpeculativeConfig):
    if config.drafter == "draft_head":
        from tandem.engines.inference.torch.draft_head import HeadDrafter

        return HeadDrafter(model, config)
    return NgramDrafter(config)


class NgramDrafter:
    """Prompt lookup: the tokens after the latest earlier occurrence of the sequence's last ``n`` tokens
    (``n`` from ``ngram_max`` down to ``ngram_min``), searched in its prompt and its output so far."""

    stats: dict[str, float] = {}
    needs_hidden = False  # the engine skips gathering hidden rows for it

    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_n, self.min_n = config.ngram_max, config.ngram_min

    def observe(self, seq, hidden, tokens, lse=None) -> None:  # needs no hidden states
        pass

    def observe_rows(self, sequences, hidden, tokens, lse=None) -> None:
        pass

    def propose_batch(self, sequences, ks: list[int]) -> list[list[int]]:
        return [self.propose(np.asarray(s.request.prompt + s.output, dtype=np.int64), k)
                for s, k in zip(sequences, ks, strict=True)]

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        length = len(tokens)
        if k < 1 or length < 2:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0 .. L-1-n
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


@dataclass(slots=True)
class DraftDist:
    """The distributions draft tokens were sampled from: ``rows [k, Vd]`` (each summing to 1) over the
    vocabulary ids ``ids [Vd]`` (a draft vocabulary; 0 elsewhere); ``index [V]``: id -> column, -1 outside."""

    rows: torch.Tensor
    ids: torch.Tensor
    index: torch.Tensor

    def at(self, i: int, token: int) -> float:
        col = int(self.index[token])
        return float(self.rows[i, col]) if col >= 0 else 0.0

    def residual(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """``max(0, p - q_i)`` over the whole vocabulary."""
        out = p.clone()
        out[self.ids] -= self.rows[i].to(p.dtype)
        return out.clamp(min=0.0)


def speculative_sample(logits: torch.Tensor, draft: list[int], sampler: RowSampler,
                       q: DraftDist | None = None) -> list[int]:
    """The tokens a sequence emits from its ``k + 1`` verification rows ``logits [k + 1, V]`` (float32):
    the accepted draft tokens, then one token drawn from the target (the correction or the bonus).
    ``q``: the distributions the draft tokens were sampled from; None: point masses (the draft was chosen,
    not sampled)."""
    k = len(draft)
    if sampler.greedy:
        target = logits.argmax(dim=-1).tolist()
        out = []
        for i, token in enumerate(draft):
            if target[i] != token:
                return [*out, target[i]]
            out.append(token)
        return [*out, target[k]]
    scaled = logits / float(sampler.temperature) if sampler.temperature != 1.0 else logits
    vocab = logits.shape[-1]

    def row(i: int) -> torch.Tensor:  # row i's sampling distribution, float64, normalised (row-independent)
        probs = filtered_probs(scaled[i : i + 1], [sampler], vocab)[0].double()
        return probs / probs.sum()

    # Row by row, as the walk reaches it: rows past the first rejection are never needed, and a softmax over
    # the vocabulary per row is most of this function's cost (k + 1 rows up front took ~4x the time at k = 4).
    generator = sampler.generator
    out = []
    for i, token in enumerate(draft):
        probs = row(i)
        p = probs[token].item()
        q_i = q.at(i, token) if q is not None else 1.0
        if torch.rand(1, generator=generator, dtype=torch.float64).item() < (p / q_i if q_i > 0 else 1.0):
            out.append(token)  # accepted with probability min(1, p / q)
            continue
        if q is None:
            residual = probs.clone()
            residual[token] = 0.0  # max(0, p - q) for the point mass q at the draft token
        else:
            residual = q.residual(i, probs)
        return [*out, _draw(residual, generator)]
    return [*out, _draw(row(k), generator)]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    uniform = torch.rand(1, generator=generator, dtype=torch.float64)
    return int(inverse_cdf(probs.float()[None], uniform)[0])


def draft_for_verification(plan, drafter, config) -> None:
    """Move the decoding sequences of ``plan`` that get a draft to ``plan.verify`` (``config``: the engine's
    `TorchEngineConfig`). A draft never runs past what the sequence may still emit (``max_new_tokens``, the
    context), so the chunk stays inside the sequence's KV-cache slot. No drafts while more than
    ``max_batch`` sequences decode."""
    spec = config.speculative
    if spec.max_batch is not None and len(plan.decode) > spec.max_batch:
        return
    ks = [min(s.spec_k or spec.k, min(s.request.params.max_new_tokens - len(s.output),
                                      config.max_model_len - s.length) - 1) for s in plan.decode]
    candidates = [(s, k) for s, k in zip(plan.decode, ks, strict=True) if k > 0]
    drafts = dict(zip((id(s) for s, _ in candidates),
                      drafter.propose_batch([s for s, _ in candidates], [k for _, k in candidates]), strict=True))
    keep = []
    for seq in plan.decode:
        draft = drafts.get(id(seq))
        if draft:
            plan.verify.append((seq, PrefillChunk(slot=seq.slot, start=seq.length - 1, count=len(draft) + 1), draft))
        else:
            keep.append(seq)
    plan.decode = keep


def apply_verification(engine, plan, logits: torch.Tensor, hidden: torch.Tensor, recorded, offset: int,
                       lse: torch.Tensor | None = None) -> int:
    """The verified sequences of ``plan`` take their tokens (``logits``: their rows; ``offset``: the first of
    their rows in the step; ``lse``: logsumexp of ``logits`` per row, for a drafter that learns): the
    keys/values of rejected rows are dropped, routing rows recorded for what is kept, the drafter told; the
    number of tokens emitted."""
    emitted = accept_drafts(plan.verify, logits, engine.config.speculative, engine._spec_stats)
    total, row = 0, 0
    for (seq, chunk, _), (new, log_probs) in zip(plan.verify, emitted, strict=True):
        seq.num_cached = chunk.start + len(new)  # keys/values kept: the last token + the accepted draft
        if recorded is not None and seq.request.params.return_routed_experts:
            engine.scheduler.record_routing(seq, chunk.start, recorded[offset : offset + len(new)])
        engine._drafter.observe(seq, hidden[offset : offset + len(new)], new,
                                None if lse is None else lse[row : row + len(new)])
        offset += chunk.count
        row += chunk.count
        engine._append([seq] * len(new), new, log_probs)
        total += len(new)
    return total


def accept_drafts(verify, logits: torch.Tensor, spec: SpeculativeConfig, stats: SpecStats):
    """Per verified sequence of ``verify`` (rows of ``logits`` in its order): the tokens it emits and their
    log-probs under the engine's convention; updates each sequence's next ``k`` and ``stats``."""
    out, offset = [], 0
    for seq, chunk, draft in verify:
        rows = logits[offset : offset + chunk.count]
        offset += chunk.count
        tokens = speculative_sample(rows, draft, seq.sampler, seq.spec_q)
        seq.spec_q = None
        used = rows[: len(tokens)]
        log_probs = token_log_probs(scale_logits(used, [seq.sampler] * len(tokens)),
                                    torch.tensor(tokens, dtype=torch.long, device=used.device))
        accepted = len(tokens) - 1
        stats.passes += 1
        stats.drafted += len(draft)
        stats.accepted += accepted
        stats.emitted += len(tokens)
        seq.spec_k = next_k(spec, seq.spec_k or spec.k, len(draft), accepted)
        out.append((tokens, log_probs.tolist()))
    return out


def next_k(config: SpeculativeConfig, current: int, drafted: int, accepted: int) -> int:
    """A sequence's draft length for its next pass: ``k`` fixed, or adaptive (one more after a fully
    accepted draft, the accepted length + 1 after a rejection, within ``1 .. config.k``)."""
    if not config.adaptive:
        return config.k
    if accepted == drafted:
        return min(config.k, current + 1)
    return max(1, min(config.k, accepted + 1))


@dataclass(slots=True)
class SpecStats:
    """Counters of speculation: target passes that verified a draft, tokens drafted / accepted / emitted."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_passes": self.passes, "spec_drafted": self.drafted, "spec_accepted": self.accepted,
            "spec_emitted": self.emitted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_mean_accepted": self.accepted / self.passes if self.passes else 0.0,
            "spec_tokens_per_pass": self.emitted / self.passes if self.passes else 0.0,
        }
