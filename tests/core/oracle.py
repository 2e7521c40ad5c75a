"""A tiny, readable pure-Python oracle of GRPO advantages + the PPO-clip loss (no torch, no vectors).

Written from the papers' formulas, one sample and one token at a time, so that the vectorized,
micro-batched production path can be compared with something obviously right.
"""

from __future__ import annotations

import math


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: list[float], *, unbiased: bool) -> float:
    m = mean(xs)
    n = len(xs) - 1 if unbiased else len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / n) if n > 0 else 0.0


def grpo_advantages(
    rewards: list[float],
    groups: list[int],
    *,
    eps: float = 1e-6,
    unbiased: bool = True,
    normalize: bool = True,
) -> list[float]:
    """DeepSeekMath eq. (3): A_i = (r_i - mean(group)) / (std(group) + eps); 0 for a lone sample."""
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups, strict=True):
        members.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, groups, strict=True):
        rs = members[g]
        if len(rs) == 1:
            out.append(0.0)
            continue
        centered = r - mean(rs)
        out.append(centered / (std(rs, unbiased=unbiased) + eps) if normalize else centered)
    return out


def ppo_clip_token_loss(
    logp: float, old: float, adv: float, *, eps_low: float, eps_high: float, dual_clip_c: float | None = None
) -> float:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and for A < 0 at most -c A (dual clip)."""
    ratio = math.exp(logp - old)
    clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = -min(ratio * adv, clipped * adv)
    if dual_clip_c is not None and adv < 0:
        loss = min(loss, -dual_clip_c * adv)
    return loss


def k3(logp: float, ref: float) -> float:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1."""
    return math.exp(ref - logp) - (ref - logp) - 1


def policy_loss(
    rows: list[dict],
    *,
    aggregation: str,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    kl_coef: float = 0.0,
    norm_length: int | None = None,
) -> float:
    """Full-batch loss. Each row: ``logp``, ``old``, ``ref``, ``mask`` (lists) and ``adv`` (a float)."""
    seq_terms, token_sum, num_tokens, num_seqs = [], 0.0, 0, 0
    for row in rows:
        terms = []
        for lp, old, ref, m in zip(row["logp"], row["old"], row["ref"], row["mask"], strict=True):
            if not m:
                continue
            term = ppo_clip_token_loss(
                lp, old, row["adv"], eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
            )
            terms.append(term + kl_coef * k3(lp, ref))
        if terms:
            num_seqs += 1
            num_tokens += len(terms)
            token_sum += sum(terms)
            seq_terms.append(sum(terms) / len(terms))
    if aggregation == "token-mean":
        return token_sum / num_tokens
    if aggregation == "seq-mean-token-mean":
        return sum(seq_terms) / num_seqs
    if aggregation == "seq-mean-token-sum":
        return token_sum / num_seqs
    if aggregation == "seq-mean-token-sum-norm":
        return token_sum / (num_seqs * norm_length)
    raise ValueError(aggregation)
