"""The draft head of speculative rollouts: a small network on the policy's own hidden states, trained
online from the rollouts the engine produces (``rollout.speculative.drafter: draft_head``).

Eagle-style (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"): the
head reads the target's last hidden state ``h_t`` (after the final norm, what the vocabulary projection
reads) and the embedding of the token ``x_{t+1}`` sampled from it, and predicts the next hidden state,
``f_{t+1} = h_t + W_2 silu(W_1 [h_t; e(x_{t+1})])``; the draft token is sampled, at the sequence's temperature,
from ``q = softmax`` of ``f_{t+1}`` projected on a draft vocabulary (the ``draft_vocab`` most frequent tokens of
the rollouts, rows initialised from the target's output embedding: a full-vocabulary projection per draft
token would cost a fifth of a decode step of SmolLM2); greedy sequences draft its argmax. Further draft
tokens feed ``f`` back in place of ``h``. ``q`` goes with the drafts (`speculative.DraftDist`), and
`speculative.speculative_sample` accepts with ``min(1, p/q)`` and resamples from ``max(0, p - q)``, so the
target's distribution is kept exactly, whatever the head has learned; a sampled draft is accepted with
probability ``sum min(p, q)``, a chosen one only with ``p(argmax)``.

Training: every sequence's hidden states, tokens and the log-normaliser of the target's logits at each
row (``logsumexp``, taken by the engine from the logits it sampled from) are kept while it decodes;
finished sequences join a window of the newest ``head_buffer_tokens`` rows. At each weight update the head
trains on the sequences since the last one plus ``head_replay`` times as many rows of older ones drawn
from the window (the policy moves little between syncs, and more data is what the head lacks most; the
cost of a training stays proportional to the new rollouts): ``head_epochs`` passes of Adam, before the new
weights are copied in. The loss distils the target's distribution rather than its samples: at row ``t + 1`` the target sampled from
``p = softmax(h_{t+1} W^T)``, which the window's hidden state and normaliser give exactly over the draft
vocabulary, and the head's ``q`` is pulled towards it by ``KL(p || q)`` (``p`` renormalised over the draft
vocabulary, each row weighted by the mass ``p`` puts there; the acceptance of a sampled draft is ``sum min(p, q) = 1 - TV(p, q)``: matching ``p`` is what raises it; a cross-entropy on the sampled token
is the same objective with the noise of one sample per row), plus a smooth-L1 loss pulling ``f_{t+1}``
towards ``h_{t+1}``. The head is unrolled ``head_unroll`` steps during training, feeding its own ``f`` back
as it does when it drafts (as EAGLE-3's training-time test), so the second and later draft tokens are
trained on the features they will see. Before its first training the head drafts nothing (plain decoding).
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
from tandem.models.lean_ops import silu
from tandem.ops.linear import fast_linear, install_fast_linears

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
        install_fast_linears(self)  # oneDNN inside the engine's fast_linear_scope

    def forward(self, h: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(silu(self.fc1(torch.cat([h, embedded], dim=-1))))  # the deterministic mode's SiLU too

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        return fast_linear(f, self.out)  # oneDNN: ~2x MKL's product with a transposed matrix at a few rows


class HeadDrafter:
    """Collects the engine's hidden states, trains the `DraftHead`, and drafts for a batch of sequences."""

    needs_hidden = True

    def __init__(self, model, config: SpeculativeConfig) -> None:
        self.model, self.config = model, config
        self.head: DraftHead | None = None
        self.buffer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (hidden [n, H], tokens [n], lse [n])
        self.buffered = 0
        self.fresh = 0  # sequences added since the last training (the newest of the buffer)
        self._live: dict[int, object] = {}  # sequences with rows not yet collected
        self.stats = {"spec_head_trainings": 0, "spec_head_loss": 0.0, "spec_head_token_accuracy": 0.0,
                      "spec_head_expected_acceptance": 0.0, "spec_head_vocab_coverage": 0.0, "spec_head_train_s": 0.0}

    # -- what the engine tells it ----------------------------------------------------------------------

    def observe(self, seq, hidden: torch.Tensor, tokens: list[int], lse: torch.Tensor) -> None:
        """``hidden [m, H]`` produced ``tokens`` (in order) for ``seq``; ``lse [m]``: the logsumexp of the
        target's logits at those rows (the engine has them: it sampled from those logits)."""
        rows = hidden.detach().float()
        seq.spec_hidden.append((rows, torch.tensor(tokens, dtype=torch.long), lse.detach().float()))
        seq.spec_last = rows[-1]
        self._live[id(seq)] = seq

    def observe_rows(self, sequences, hidden: torch.Tensor, tokens: list[int], lse: torch.Tensor) -> None:
        """One row and one token per sequence (a decode step, or a prompt's last row)."""
        self._sweep()
        for i, (seq, token) in enumerate(zip(sequences, tokens, strict=True)):
            self.observe(seq, hidden[i : i + 1], [token], lse[i : i + 1])

    def _sweep(self) -> None:
        from tandem.engines.inference.torch.scheduler import Phase

        for key, seq in list(self._live.items()):
            if seq.phase is Phase.DONE:
                del self._live[key]
                self.collect(seq)

    def collect(self, seq) -> None:
        """A finished sequence: its rows join the training window (the newest ``head_buffer_tokens``)."""
        if not seq.spec_hidden:
            return
        hidden, tokens, lse = (torch.cat(parts) for parts in zip(*seq.spec_hidden, strict=True))
        seq.spec_hidden, seq.spec_last = [], None
        if len(tokens) < 2:
            return
        self.buffer.append((hidden, tokens, lse))
        self.buffered += len(tokens)
        self.fresh += 1
        while self.buffered - len(self.buffer[0][1]) >= self.config.head_buffer_tokens:
            self.buffered -= len(self.buffer.pop(0)[1])

    # -- training ----------------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """``head_epochs`` passes over the sequences since the last training and ``head_replay`` times as many
        rows of older ones drawn at random from the window (nothing new: no training); the figures of the last pass:
        ``spec_head_loss`` (KL + feature loss, per unrolled step), ``spec_head_expected_acceptance`` (mean
        ``sum min(p, q)`` of the first draft token at temperature 1, on the training rows),
        ``spec_head_token_accuracy`` (the head's argmax is the token the target sampled)."""
        self._sweep()
        fresh = min(self.fresh, len(self.buffer))
        if not fresh or self.config.head_epochs == 0:
            return {}
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(self.stats["spec_head_trainings"])
        chosen = self.buffer[len(self.buffer) - fresh :]  # the sequences since the last training
        want = self.config.head_replay * sum(len(t) for _, t, _ in chosen)
        for i in torch.randperm(len(self.buffer) - fresh, generator=generator).tolist():  # + older ones, at random
            if want <= 0:
                break
            chosen.append(self.buffer[i])
            want -= len(self.buffer[i][1])
        self.fresh = 0
        hidden, tokens, lse = (torch.cat(parts) for parts in zip(*chosen, strict=True))
        unroll = self.config.head_unroll
        # a start row t needs rows t .. t + unroll of its own sequence: (h_t, x_{t+1}) -> (h_{t+1}, x_{t+2}), ...
        starts, offset = [], 0
        for _, seq_tokens, _ in chosen:
            n = len(seq_tokens)
            steps = min(unroll, n - 1)
            starts.append(torch.arange(offset, offset + n - steps))
            offset += n
        starts = torch.cat(starts)
        ends = torch.cat([torch.full((len(t),), i) for i, (_, t, _) in enumerate(chosen)])  # row -> sequence
        if self.head is None:
            self.head = self._new_head(tokens)
        head = self.head
        embed = self.model.model.embed_tokens.weight.detach()
        out_rows = self.model.lm_head.weight.detach()[head.token_ids].float()  # the target's, for p
        self.stats["spec_head_vocab_coverage"] = float((head.index[tokens] >= 0).float().mean())
        optimizer = torch.optim.Adam(head.parameters(), lr=self.config.head_lr)
        batch = 512
        with torch.enable_grad(), torch.inference_mode(False):
            for _ in range(self.config.head_epochs):
                order = starts[torch.randperm(len(starts), generator=generator)]
                total = accept = correct = count = 0.0
                for i in range(0, len(order), batch):
                    rows = order[i : i + batch]
                    f, loss, size = hidden[rows].clone(), 0.0, len(rows)
                    for s in range(unroll):
                        cur, nxt = rows + s, rows + s + 1
                        valid = (nxt < len(tokens)) & (ends[nxt.clamp(max=len(tokens) - 1)] == ends[rows])
                        if not valid.all():  # a sequence shorter than the unroll: stop its rows there
                            if not valid.any():
                                break
                            f, cur, nxt, rows = f[valid], cur[valid], nxt[valid], rows[valid]
                        f = head(f, embed[tokens[cur]].float())
                        log_q = torch.log_softmax(head.logits(f), dim=-1)
                        with torch.no_grad():
                            p = torch.exp(hidden[nxt] @ out_rows.T - lse[nxt, None])  # the target's p on the draft vocabulary
                            p_draft = p / p.sum(-1, keepdim=True).clamp(min=1e-30)  # p given a draft-vocabulary token
                        # KL(p_draft || q) weighted by the row's draft-vocabulary mass: a row whose sampled
                        # token is mostly outside the draft vocabulary cannot be accepted whatever q is
                        kl = (p * (torch.log(p_draft.clamp(min=1e-30)) - log_q)).sum(-1).mean()
                        loss = loss + (kl + F.smooth_l1_loss(f, hidden[nxt])) / unroll
                        if s == 0:
                            with torch.no_grad():
                                accept += float(torch.minimum(p, log_q.exp()).sum(-1).sum())
                                target = head.index[tokens[nxt]]
                                correct += float((log_q.argmax(-1) == target).sum())
                                count += len(rows)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    total += float(loss.detach()) * size
        self.stats["spec_head_trainings"] += 1
        self.stats["spec_head_loss"] = total / max(count, 1)
        self.stats["spec_head_expected_acceptance"] = accept / max(count, 1)
        self.stats["spec_head_token_accuracy"] = correct / max(count, 1)
        self.stats["spec_head_train_s"] += time.perf_counter() - start
        return dict(self.stats)

    # -- persistence (a run's checkpoints keep the head: a resumed run drafts at once) --------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained head (its weights, draft vocabulary and index) and the count of its trainings; {}
        before its first training. The window of rows is not kept: it refills with the next rollouts."""
        if self.head is None:
            return {}
        state = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
        state["trainings"] = torch.tensor(self.stats["spec_head_trainings"], dtype=torch.long)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state_dict`'s head; a head of another model (hidden size, vocabulary) is refused by name,
        the drafter untouched."""
        hidden, vocab = self.model.args.hidden_size, self.model.args.vocab_size
        need = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "out", "token_ids", "index", "trainings"}
        if missing := sorted(need - set(state)):
            raise ValueError(f"draft head state lacks {missing}")
        token_ids, index = state["token_ids"], state["index"]
        if state["fc2.weight"].shape != (hidden, hidden) or index.shape != (vocab,) or \
                state["out"].shape != (len(token_ids), hidden):
            raise ValueError(
                f"draft head state is for hidden size {tuple(state['fc2.weight'].shape)[0]} and a vocabulary of "
                f"{index.shape[0]}; this engine's model has hidden size {hidden} and vocabulary {vocab}")
        head = DraftHead(hidden, state["out"], token_ids, vocab)
        head.load_state_dict({k: v for k, v in state.items() if k != "trainings"})
        self.head = head
        self.stats["spec_head_trainings"] = int(state["trainings"])

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
