"""The draft head of speculative rollouts: a small network on the policy's own hidden states, trained
online from the rollouts the engine produces (``rollout.speculative.drafter: draft_head``).

Eagle-style (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"): the
head reads the target's last hidden state ``h_t`` (after the final norm, what the vocabulary projection
reads) and the embedding of the token ``x_{t+1}`` sampled from it, and predicts the next hidden state,
``f_{t+1} = h_t + W_2 silu(W_1 [h_t; e(x_{t+1})])``; the draft token is the argmax of ``f_{t+1}`` projected on a
draft vocabulary (the ``draft_vocab`` most frequent tokens of the rollouts, rows initialised from the
target's output embedding: a full-vocabulary projection per draft token would cost a fifth of a decode
step of SmolLM2). Further draft tokens feed ``f`` back in place of ``h``. Drafts are point masses (the
argmax), so `speculative.speculative_sample` keeps the target's distribution exactly, whatever the head
has learned.

Training: every sequence's hidden states and tokens are kept while it decodes (the rows that produced
its tokens); finished sequences go to a buffer of the newest ``head_buffer_tokens`` rows. At each weight
update the head takes ``head_epochs`` passes of Adam over the buffer, with a cross-entropy loss on
``x_{t+2}`` (over the draft vocabulary) plus a smooth-L1 loss pulling ``f_{t+1}`` towards ``h_{t+1}``, then
the buffer is cleared: the head follows the policy as its weights change, on the hidden states the policy
itself produced. Before its first training the head drafts nothing (plain decoding).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.speculative import SpeculativeConfig
from tandem.engines.inference.torch.speculative import DraftDist

__all__ = ["DraftHead", "HeadDrafter"]

log = logging.getLogger(__name__)


class DraftHead(nn.Module):
    """``f = h + W_2 silu(W_1 [h; e(x)])``; draft logits ``f @ out^T`` over ``token_ids``."""

    def __init__(self, hidden: int, out_rows: torch.Tensor, token_ids: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2 * hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.fc2.weight)  # starts as f = h: drafts what h itself predicts
        nn.init.zeros_(self.fc2.bias)
        self.out = nn.Parameter(out_rows.detach().float().clone())
        self.register_buffer("token_ids", token_ids.long().clone())
        index = torch.full((vocab,), -1, dtype=torch.long)
        index[token_ids] = torch.arange(len(token_ids))
        self.register_buffer("index", index)  # vocabulary id -> draft-vocabulary row (-1: outside)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.silu(self.fc1(torch.cat([h, embedded], dim=-1))))

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.out.T


class HeadDrafter:
    """Collects the engine's hidden states, trains the `DraftHead`, and drafts for a batch of sequences."""

    needs_hidden = True

    def __init__(self, model, config: SpeculativeConfig) -> None:
        self.model, self.config = model, config
        self.head: DraftHead | None = None
        self.buffer: list[tuple[torch.Tensor, torch.Tensor]] = []  # (hidden [n, H] fp32, tokens [n])
        self.buffered = 0
        self._live: dict[int, object] = {}  # sequences with rows not yet collected
        self.stats = {"spec_head_trainings": 0, "spec_head_loss": 0.0, "spec_head_token_accuracy": 0.0,
                      "spec_head_vocab_coverage": 0.0, "spec_head_train_s": 0.0}

    # -- what the engine tells it ----------------------------------------------------------------------

    def observe(self, seq, hidden: torch.Tensor, tokens: list[int]) -> None:
        """``hidden [m, H]`` produced ``tokens`` (in order) for ``seq``."""
        rows = hidden.detach().float()
        seq.spec_hidden.append((rows, torch.tensor(tokens, dtype=torch.long)))
        seq.spec_last = rows[-1]
        self._live[id(seq)] = seq

    def observe_rows(self, sequences, hidden: torch.Tensor, tokens: list[int]) -> None:
        """One row and one token per sequence (a decode step, or a prompt's last row)."""
        self._sweep()
        for i, (seq, token) in enumerate(zip(sequences, tokens, strict=True)):
            self.observe(seq, hidden[i : i + 1], [token])

    def _sweep(self) -> None:
        from tandem.engines.inference.torch.scheduler import Phase

        for key, seq in list(self._live.items()):
            if seq.phase is Phase.DONE:
                del self._live[key]
                self.collect(seq)

    def collect(self, seq) -> None:
        """A finished sequence: its rows join the training buffer (the newest ``head_buffer_tokens``)."""
        if not seq.spec_hidden:
            return
        hidden = torch.cat([h for h, _ in seq.spec_hidden])
        tokens = torch.cat([t for _, t in seq.spec_hidden])
        seq.spec_hidden, seq.spec_last = [], None
        if len(tokens) < 2:
            return
        self.buffer.append((hidden, tokens))
        self.buffered += len(tokens)
        while self.buffered - len(self.buffer[0][1]) >= self.config.head_buffer_tokens:
            self.buffered -= len(self.buffer.pop(0)[1])

    # -- training ----------------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """``head_epochs`` passes over the buffer, then clear it; the losses of the last pass."""
        self._sweep()
        if not self.buffer or self.config.head_epochs == 0:
            return {}
        start = time.perf_counter()
        embed = self.model.model.embed_tokens.weight.detach()
        h_in, x_next, h_next, x_target = [], [], [], []
        for hidden, tokens in self.buffer:  # row t produced token t: (h_t, x_{t+1}) -> (h_{t+1}, x_{t+2})
            h_in.append(hidden[:-1])
            x_next.append(tokens[:-1])
            h_next.append(hidden[1:])
            x_target.append(tokens[1:])
        h_in, x_next, h_next, x_target = (torch.cat(v) for v in (h_in, x_next, h_next, x_target))
        if self.head is None:
            self.head = self._new_head(torch.cat([t for _, t in self.buffer]))
        head = self.head
        target_rows = head.index[x_target]
        self.stats["spec_head_vocab_coverage"] = float((target_rows >= 0).float().mean())
        optimizer = torch.optim.Adam(head.parameters(), lr=self.config.head_lr)
        generator = torch.Generator().manual_seed(self.stats["spec_head_trainings"])
        batch = 256
        with torch.enable_grad(), torch.inference_mode(False):
            for _ in range(self.config.head_epochs):
                order = torch.randperm(len(x_target), generator=generator)
                total, correct, count = 0.0, 0, 0
                for i in range(0, len(order), batch):
                    rows = order[i : i + batch]
                    inside = target_rows[rows] >= 0
                    f = head(h_in[rows].clone(), embed[x_next[rows]].float())
                    logits = head.logits(f)
                    ce = F.cross_entropy(logits[inside], target_rows[rows][inside]) if inside.any() else logits.sum() * 0
                    loss = ce + F.smooth_l1_loss(f, h_next[rows])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    total += float(loss.detach()) * len(rows)
                    count += len(rows)
                    correct += int((logits.argmax(-1)[inside] == target_rows[rows][inside]).sum())
        self.stats["spec_head_trainings"] += 1
        self.stats["spec_head_loss"] = total / max(count, 1)
        self.stats["spec_head_token_accuracy"] = correct / max(count, 1)
        self.stats["spec_head_train_s"] += time.perf_counter() - start
        self.buffer, self.buffered = [], 0
        return dict(self.stats)

    def _new_head(self, tokens: torch.Tensor) -> DraftHead:
        """A head over the ``draft_vocab`` most frequent tokens of the first buffer (ties by id)."""
        vocab = self.model.args.vocab_size
        counts = np.bincount(tokens.numpy(), minlength=vocab)
        size = min(self.config.draft_vocab, vocab)
        ids = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:size]))
        out_rows = self.model.lm_head.weight.detach()[ids]
        return DraftHead(self.model.args.hidden_size, out_rows, ids, vocab)

    # -- drafting ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def propose_batch(self, sequences, ks: list[int]) -> list[list[int]]:
        """Drafts of ``ks[i]`` tokens per sequence (``[]`` before the head is trained): sampled from the
        head's distribution at the sequence's temperature (kept in ``seq.spec_q`` for verification: at
        ``T = 1`` a sampled draft is accepted with ``sum min(p, q)``, a chosen one only with ``p(argmax)``);
        greedy sequences draft the argmax."""
        if self.head is None or not sequences:
            return [[] for _ in sequences]
        head, embed = self.head, self.model.model.embed_tokens.weight
        f = torch.stack([s.spec_last for s in sequences])
        token = torch.tensor([s.output[-1] for s in sequences], dtype=torch.long)
        temps = torch.tensor([max(s.sampler.temperature, 1e-6) for s in sequences])[:, None]
        greedy = torch.tensor([s.sampler.greedy for s in sequences])
        drafts, dists = [], []
        for _ in range(max(ks)):
            f = head(f, embed[token].float())
            logits = head.logits(f)
            q = torch.softmax(logits.double() / temps, dim=-1)
            uniforms = torch.cat([torch.rand(1, generator=s.sampler.generator, dtype=torch.float64)
                                  for s in sequences])
            cdf = q.cumsum(-1)
            sampled = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
            rows = torch.where(greedy, logits.argmax(-1), sampled.clamp(max=q.shape[-1] - 1))
            token = head.token_ids[rows]
            drafts.append(token)
            dists.append(q)
        table = torch.stack(drafts, dim=1).tolist()  # [B, max k]
        q_all = torch.stack(dists, dim=1)  # [B, max k, Vd]
        out = []
        for i, (seq, k) in enumerate(zip(sequences, ks, strict=True)):
            seq.spec_q = None if greedy[i] else DraftDist(q_all[i, :k], head.token_ids, head.index)
            out.append(table[i][:k])
        return out
