"""Settings of speculative rollouts (``rollout.speculative``), shared by every inference engine.

Speculation changes how fast tokens are produced, never which: a drafter proposes up to ``k`` tokens,
one target pass scores them, and speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling") accepts draft token ``d`` with probability ``min(1, p(d) / q(d))`` and on a
rejection draws from ``normalise(max(0, p - q))``, so every emitted token is distributed exactly as the
target's sampling distribution ``p`` (temperature, top-k, top-p applied). The log-probs recorded are the
target's, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DRAFTERS", "SpeculativeConfig"]

DRAFTERS = ("ngram", "draft_head")


@dataclass(kw_only=True, slots=True)
class SpeculativeConfig:
    """``drafter``: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last ``ngram_max`` .. ``ngram_min`` tokens, in its prompt or its own output; no model), or
    ``draft_head`` (a small head on the policy's last hidden state and the newest token, Eagle-style,
    trained online on the hidden states of the rollouts the engine produces: ``head_epochs`` passes at each
    weight update over the rollouts since the last one plus ``head_replay`` times as many older rows from a
    window of the newest ``head_buffer_tokens``, distilling the target's distribution, unrolled
    ``head_unroll`` draft steps; over a draft vocabulary of the ``draft_vocab`` most frequent tokens seen).
    ``k``: draft tokens per target pass (the most, with ``adaptive``). ``adaptive``: each sequence's ``k``
    follows its acceptance: one more after a fully accepted draft, the accepted length + 1 after a rejection,
    between 1 and ``k``. ``max_batch``: speculate only while at most this many sequences decode (a larger
    batch is compute-bound on a CPU, where the extra rows of a verification cost more than they save);
    None: always."""

    drafter: Literal["ngram", "draft_head"] = "ngram"
    k: int = 4
    adaptive: bool = True
    max_batch: int | None = 4
    ngram_max: int = 3
    ngram_min: int = 1
    draft_vocab: int = 4096
    head_lr: float = 3e-3
    head_epochs: int = 2
    head_buffer_tokens: int = 16384  # the newest rows, from which older ones are replayed
    head_replay: float = 2.0  # older rows trained on per new row
    head_unroll: int = 2  # draft steps unrolled in training (the head fed its own features)

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"speculative drafter={self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 32:
            raise ValueError(f"speculative k={self.k!r} must be an integer in [1, 32]")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"speculative max_batch={self.max_batch} must be >= 1 (or None: always)")
        if (self.draft_vocab < 2 or self.head_epochs < 0 or not self.head_lr > 0 or self.head_buffer_tokens < 1
                or not 1 <= self.head_unroll <= 8 or not self.head_replay >= 0):
            raise ValueError(f"speculative draft_vocab={self.draft_vocab} (>= 2), head_epochs={self.head_epochs} "
                             f"(>= 0), head_lr={self.head_lr} (> 0), head_buffer_tokens={self.head_buffer_tokens} "
                             f"(>= 1), head_unroll={self.head_unroll} (1 .. 8), head_replay={self.head_replay} (>= 0): out of range")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"speculative ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need "
                             "1 <= ngram_min <= ngram_max <= 16")
