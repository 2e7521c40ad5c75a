"""`TorchEngine.score`: teacher-forced log-probs of given sequences with a prefill pass (`ScoringEngine`)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch
import torch.nn.functional as F

from tandem.ops.batch_invariant import batch_invariant_mode
from tandem.ops.linear import fast_linear_mode

__all__ = ["ScoringMethods"]


class ScoringMethods:
    """`TorchEngine`'s ``score`` (the engine holds ``model``, ``cache``, ``config``, ``adapters``, ``_packed``,
    ``_policy_adapter`` and ``_between_steps``)."""

    def score(
        self, sequences: SequenceABC[tuple[SequenceABC[int], int]], *, temperature: float = 1.0,
        max_tokens: int = 8192,
    ) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence's tokens after its prompt: a prefill pass, no cache.

        ``sequences`` are ``(token_ids, prompt_length)`` pairs (``prompt_length >= 1``); the result holds,
        per sequence, the log-probs of ``token_ids[prompt_length:]`` under ``log_softmax(logits / T)``,
        the formula generation uses. In deterministic mode they equal the log-probs returned when the
        tokens were generated, bit for bit; otherwise they are the prefill-path values (the loop's
        ``rollout.recompute_log_probs``). Runs between two steps, ``max_tokens`` tokens per forward.
        """
        from tandem.models.logprobs import logprobs_from_hidden
        from tandem.ops.batch_invariant import packed_attention

        items = [(list(map(int, ids)), int(p)) for ids, p in sequences]
        for i, (ids, p) in enumerate(items):
            if not 1 <= p <= len(ids):
                raise ValueError(f"score: sequence {i} has prompt_length={p}; must be in [1, {len(ids)}]")
            if len(ids) > self.model.args.max_position_embeddings:
                raise ValueError(f"score: sequence {i} has {len(ids)} tokens, more than the model's context "
                                 f"{self.model.args.max_position_embeddings}")
        device = self.cache.device
        out: list[list[float]] = [[] for _ in items]
        with self._between_steps():
            self._check_weights_held("score()")  # an asleep engine scores, unless sleep freed its weights
            self._restore_asleep(keep=self._packed)  # weights held quantized: their plain copies back, unless a
            # packed copy serves them (awake)
            numerics = (batch_invariant_mode(packed=self._packed) if self.config.deterministic
                        else fast_linear_mode(packed=self._packed))
            with torch.inference_mode(), numerics:
                start = 0
                while start < len(items):
                    end, total = start, 0
                    while end < len(items) and (end == start or total + len(items[end][0]) <= max_tokens):
                        total += len(items[end][0])
                        end += 1
                    chunk = items[start:end]
                    lengths = torch.tensor([len(ids) for ids, _ in chunk], device=device)
                    cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
                    flat = torch.tensor([t for ids, _ in chunk for t in ids], device=device)
                    positions = torch.cat([torch.arange(n, device=device) for n in lengths.tolist()])
                    with self.adapters.rows([self._policy_adapter] * len(flat) if self._policy_adapter else [],
                                            device):
                        hidden = self.model(flat, positions, packed_attention(cu))
                    rows, targets, owner = [], [], []
                    for k, (ids, p) in enumerate(chunk):
                        base = int(cu[k])
                        rows += range(base + p - 1, base + len(ids) - 1)
                        targets += ids[p:]
                        owner += [k] * (len(ids) - p)
                    if rows:
                        lp = logprobs_from_hidden(hidden[torch.tensor(rows, device=device)], self.model.lm_head.weight,
                                                  torch.tensor(targets, device=device), temperature).tolist()
                        for k, v in zip(owner, lp, strict=True):
                            out[start + k].append(v)
                    start = end
        return out

