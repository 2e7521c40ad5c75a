"""What else the draft head could be: the shipped MLP head against a wider one and EAGLE's decoder layer, and
what multi-candidate (tree) drafts would add, offline on the same rollouts (docs/benchmarks.md).

The speculative benchmark (bench/speculative.py) leaves `spec_speedup_bs1` at ~1.4 against an aim of 1.8: at
T = 1 the head (``f = h + W_2 silu(W_1 [h; e(x)])``, tandem/engines/inference/torch/draft_head.py) reaches
~0.40 live acceptance. This script asks whether another head would reach more, on equal data:

1. Rollouts: ``--rounds`` x 32 of the speculative benchmark's prompts (chat word problems asking for the
   reasoning), SmolLM2-135M at T = 1, ``--new-tokens`` each, plain decoding in the embedded engine; the
   draft head drafter collects (without training) what it trains on: every row's final hidden state, the
   token sampled from it and the logsumexp of the target's logits. Kept in ``--data`` (reused if present).
2. Each head in ``--heads`` trains on all but the last 64 sequences (``--epochs`` passes of Adam, lr 3e-3,
   batches of 16 whole sequences, unrolled 2 draft steps, the shipped loss: KL(p || q) on a 4,096-token
   draft vocabulary plus smooth-L1 of the predicted feature), and after each pass is scored on the 64
   held-out sequences: the expected acceptance ``sum min(p, q)`` of a sampled draft at draft depths 1-4
   (the head fed its own features, the real tokens as inputs) and ``1 + a1 + a1 a2 + ...``, an estimate of
   tokens per verification pass at k = 4.
   - ``mlp``: the shipped head (hidden width H).  ``mlp3``: the same with width 3H.
   - ``hybrid``: the MLP plus causal attention (64-wide heads, RoPE) over the sequence's earlier pre-activations,
     its output projection zero-initialised: it starts as the MLP and can only add context.
   - ``eagle``: EAGLE's layout: ``z = fc([h; e(x)])``, one pre-norm decoder layer (attention over the
     earlier ``z``, SwiGLU-free MLP of width 2H), ``f = h + fc_out(.)``.
   Deeper draft steps attend to the true features up to the chain's start plus the chain's own drafts.
3. Tree drafts (``mlp``): the acceptance at depth 1 with 1-4 candidates sampled from ``q`` and recursive
   rejection sampling (a rejected candidate's ``q`` is taken out of the residual ``p``; the target's
   distribution is kept exactly).

    python bench/draft_head_study.py                 # ~40 min on 2 cores (rollouts ~5 min)
    python bench/draft_head_study.py --heads mlp --epochs 6
    python bench/draft_head_study.py --quick         # tiny-llama, seconds (a smoke of the script)

Ends with ``RESULT {json}``: per head its held-out acceptance by depth and estimated tokens per pass after
the last pass (``heads``), per pass (``by_epoch``), and ``tree_acceptance_depth1`` (1-4 candidates).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.speculative import make_prompts  # noqa: E402
from tandem.core.protocols import GenerationRequest, SamplingParams  # noqa: E402
from tandem.core.speculative import SpeculativeConfig  # noqa: E402
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig  # noqa: E402
from tandem.models import ModelConfig  # noqa: E402

HELD_OUT = 64
DRAFT_VOCAB = 4096


def collect(model: str, rounds: int, new_tokens: int, prompts) -> dict:
    """Rows of plain T = 1 rollouts, as the draft head drafter keeps them for training."""
    config = TorchEngineConfig(model=ModelConfig(name=model), max_model_len=512, max_num_seqs=32,
                               speculative=SpeculativeConfig(drafter="draft_head", k=4, max_batch=None,
                                                             head_epochs=0, head_buffer_tokens=10**9))
    engine = TorchEngine(config)
    drafter = engine._drafter  # the drafter's own window: what it would train on
    for r in range(rounds):
        start = time.perf_counter()
        engine.generate([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=1.0, max_new_tokens=new_tokens, seed=r * 1000 + i))
            for i, p in enumerate(prompts[32 * r : 32 * r + 32])])
        drafter._sweep()
        print(f"rollouts {r + 1}/{rounds}: {drafter.buffered} rows ({time.perf_counter() - start:.1f} s)", flush=True)
    return {"buffer": drafter.buffer, "lm_head": engine.model.lm_head.weight.detach().float().clone(),
            "embed": engine.model.model.embed_tokens.weight.detach().float().clone()}


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x [B, L, heads, d]`` at positions ``pos [L]``."""
    half = x.shape[-1] // 2
    angle = pos[:, None, None].float() / theta ** (torch.arange(half).float() * 2 / x.shape[-1])
    c, s = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


class ContextAttention(nn.Module):
    """Causal attention over a chain's context: at draft depth 0 the sequence's own rows (teacher-forced); at
    depth d > 0 the query of chain start t sees the depth-0 keys up to t and the chain's drafts 1..d."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = max(1, hidden // 64)  # 64-wide heads: 9 on SmolLM2-135M
        if hidden % self.heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of 64-wide attention heads")
        self.dim = hidden // self.heads
        self.norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.reset()

    def reset(self) -> None:
        self.k0 = self.v0 = None
        self.extra_k, self.extra_v = [], []

    def forward(self, z: torch.Tensor, depth: int) -> torch.Tensor:
        B, L, H = z.shape
        pos = torch.arange(L) + depth
        q, k, v = self.qkv(self.norm(z)).view(B, L, 3, self.heads, self.dim).unbind(2)
        q, k = rope(q, pos), rope(k, pos)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        if depth == 0:
            self.k0, self.v0 = k, v
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=causal).transpose(1, 2)
        else:
            self.extra_k.append(k)
            self.extra_v.append(v)
            scale = 1 / math.sqrt(self.dim)
            s0 = torch.einsum("bqnd,bknd->bnqk", q, self.k0).masked_fill(~causal, float("-inf")) * scale
            se = torch.stack([(q * kk).sum(-1) for kk in self.extra_k], -1).transpose(1, 2) * scale
            prob = torch.softmax(torch.cat([s0, se], -1), -1)
            a = torch.einsum("bnqk,bknd->bqnd", prob[..., :L], self.v0)
            a = a + torch.einsum("bnqe,ebqnd->bqnd", prob[..., L:], torch.stack(self.extra_v))
        return self.o(a.reshape(B, L, H))


class MLPHead(nn.Module):
    """The shipped head: ``f = h + W_2 silu(W_1 [h; e(x)])`` (``width`` x H inside)."""

    def __init__(self, hidden: int, out_rows: torch.Tensor, width: int = 1, attention: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2 * hidden, width * hidden)
        self.fc2 = nn.Linear(width * hidden, hidden)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)
        self.out = nn.Parameter(out_rows.clone())
        self.attn = ContextAttention(hidden) if attention else None  # "hybrid": zero-initialised context
        if self.attn is not None:
            nn.init.zeros_(self.attn.o.weight)

    def step(self, f: torch.Tensor, e: torch.Tensor, depth: int) -> torch.Tensor:
        z = self.fc1(torch.cat([f, e], -1))
        if self.attn is not None:
            z = z + self.attn(z, depth)
        return f + self.fc2(F.silu(z))


class EagleHead(nn.Module):
    """EAGLE's layout: ``z = fc([h; e(x)])``, one pre-norm decoder layer, ``f = h + fc_out(.)``."""

    def __init__(self, hidden: int, out_rows: torch.Tensor) -> None:
        super().__init__()
        self.fc_in = nn.Linear(2 * hidden, hidden)
        self.attn = ContextAttention(hidden)
        self.norm = nn.RMSNorm(hidden)
        self.w1, self.w2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.fc_out = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.fc_out.weight)
        nn.init.zeros_(self.fc_out.bias)
        self.out = nn.Parameter(out_rows.clone())

    def step(self, f: torch.Tensor, e: torch.Tensor, depth: int) -> torch.Tensor:
        z = self.fc_in(torch.cat([f, e], -1))
        u = z + self.attn(z, depth)
        u = u + self.w2(F.silu(self.w1(self.norm(u))))
        return f + self.fc_out(u)


class Study:
    def __init__(self, data: dict) -> None:
        buffer, self.W, self.E = data["buffer"], data["lm_head"], data["embed"]
        self.H = self.W.shape[1]
        self.train_seqs, test_seqs = buffer[:-HELD_OUT], buffer[-HELD_OUT:]
        self.L = max(len(t) for _, t, _ in buffer)
        counts = np.bincount(torch.cat([t for _, t, _ in self.train_seqs]).numpy(), minlength=self.W.shape[0])
        size = min(DRAFT_VOCAB, self.W.shape[0])
        self.ids = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:size]))
        self.Wd = self.W[self.ids]
        self.train, self.test = self._pad(self.train_seqs), self._pad(test_seqs)

    def _pad(self, seqs):
        B, L, H = len(seqs), self.L, self.H
        h, x = torch.zeros(B, L, H), torch.zeros(B, L, dtype=torch.long)
        lse, mask = torch.zeros(B, L), torch.zeros(B, L, dtype=torch.bool)
        for i, (hh, tt, ll) in enumerate(seqs):
            n = len(tt)
            h[i, :n], x[i, :n], lse[i, :n], mask[i, :n] = hh, tt, ll, True
        return h, x, lse, mask

    def make(self, name: str) -> nn.Module:
        torch.manual_seed(0)
        if name == "eagle":
            return EagleHead(self.H, self.Wd)
        return MLPHead(self.H, self.Wd, width=3 if name == "mlp3" else 1, attention=name == "hybrid")

    def chains(self, head, h, x, depth):
        """``f`` of draft depth ``d`` for every chain start ``t`` at once: it predicts ``h[:, t + d + 1]``."""
        if getattr(head, "attn", None) is not None:
            head.attn.reset()
        f = h
        for d in range(depth):
            f = head.step(f, self.E[torch.roll(x, -d, 1)], d)
            yield d, f

    def run(self, head, data, depth: int, optimizer=None) -> list[float]:
        """Expected acceptance per depth; with ``optimizer``: one step on the shipped loss."""
        h, x, lse, mask = data
        accept, count, loss = [0.0] * depth, [0] * depth, 0.0
        for d, f in self.chains(head, h, x, depth):
            target_h, target_lse = torch.roll(h, -(d + 1), 1), torch.roll(lse, -(d + 1), 1)
            valid = mask & torch.roll(mask, -(d + 1), 1)
            valid[:, self.L - d - 1 :] = False
            log_q = torch.log_softmax(f[valid] @ head.out.T, -1)
            with torch.no_grad():
                p = torch.exp(target_h[valid] @ self.Wd.T - target_lse[valid, None])  # the target's, on the draft vocabulary
                p_draft = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
                accept[d] += float(torch.minimum(p, log_q.exp()).sum())
                count[d] += int(valid.sum())
            if optimizer is not None:
                kl = (p * (torch.log(p_draft.clamp(min=1e-30)) - log_q)).sum(-1).mean()
                loss = loss + kl + F.smooth_l1_loss(f[valid], target_h[valid])
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            (loss / depth).backward()
            optimizer.step()
        return [a / max(c, 1) for a, c in zip(accept, count, strict=True)]

    def fit(self, name: str, epochs: int) -> tuple[nn.Module, list[dict]]:
        head = self.make(name)
        optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
        n, rows, start = len(self.train_seqs), [], time.perf_counter()
        print(f"{name}: {sum(p.numel() for k, p in head.named_parameters() if k != 'out'):,} parameters "
              f"(+ the {len(self.ids)}-row draft vocabulary)", flush=True)
        for epoch in range(epochs):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
            for i in range(0, n, 16):
                self.run(head, tuple(t[order[i : i + 16]] for t in self.train), 2, optimizer)
            with torch.no_grad():
                acc = self.run(head, self.test, 4)
            tokens = 1 + sum(math.prod(acc[: j + 1]) for j in range(4))
            rows.append({"acceptance_by_depth": [round(a, 3) for a in acc], "tokens_per_pass_est": round(tokens, 3)})
            print(f"  pass {epoch + 1}: held-out acceptance by depth {rows[-1]['acceptance_by_depth']}, "
                  f"~{tokens:.2f} tokens a pass ({time.perf_counter() - start:.0f} s)", flush=True)
        return head, rows

    @torch.no_grad()
    def tree(self, head, candidates: int = 4) -> list[float]:
        """Acceptance at depth 1 with 1..``candidates`` iid drafts from ``q`` and recursive rejection sampling."""
        h, x, lse, mask = self.test
        _, f = next(self.chains(head, h, x, 1))
        valid = mask & torch.roll(mask, -1, 1)
        valid[:, self.L - 1 :] = False
        q = torch.softmax(f[valid] @ head.out.T, -1).double()
        p = torch.exp(torch.roll(h, -1, 1)[valid] @ self.Wd.T - torch.roll(lse, -1, 1)[valid, None]).double()
        outside = 1 - p.sum(-1)  # the target's mass off the draft vocabulary: no draft can take it
        residual, mass = p.clone(), torch.ones(len(p), dtype=torch.float64)
        accepted, out = torch.zeros(len(p), dtype=torch.float64), []
        for _ in range(candidates):
            a = torch.minimum(residual / mass[:, None], q).sum(-1)  # this candidate, given the earlier rejected
            accepted = accepted + (1 - accepted) * a
            residual = torch.clamp(residual - mass[:, None] * q, min=0)  # p <- norm(max(p - q, 0)), kept unscaled
            mass = residual.sum(-1) + outside
            out.append(round(float(accepted.mean()), 3))
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=14, help="rollouts of 32 prompts (the last 2 held out)")
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--heads", default="mlp,mlp3,hybrid,eagle")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--data", default="/tmp/tandem-draft-head-study.pt", help="rollout rows (reused if present)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny-llama, short responses, 1 pass")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.model, args.rounds, args.new_tokens, args.epochs = "tiny-llama", 3, 24, 1
        args.data = args.data.replace(".pt", "-quick.pt")
    path = Path(args.data)
    if path.exists():
        data = torch.load(path, weights_only=True)
        print(f"rollout rows from {path}", flush=True)
    else:
        if args.quick:
            from tests.engines.torch_helpers import prompts as random_prompts

            prompts = random_prompts([12] * (32 * args.rounds), seed=1)
        else:
            prompts = make_prompts(args.model, 32 * args.rounds)
        data = collect(args.model, args.rounds, args.new_tokens, prompts)
        torch.save(data, path)
    study = Study(data)
    out = {"model": args.model, "rows": sum(len(t) for _, t, _ in data["buffer"]), "held_out_sequences": HELD_OUT,
           "epochs": args.epochs, "heads": {}, "by_epoch": {}}
    for name in args.heads.split(","):
        head, rows = study.fit(name, args.epochs)
        out["heads"][name], out["by_epoch"][name] = rows[-1], [r["tokens_per_pass_est"] for r in rows]
        if name == "mlp":
            out["tree_acceptance_depth1"] = study.tree(head)
            print(f"  tree drafts at depth 1, 1-4 candidates: acceptance {out['tree_acceptance_depth1']}", flush=True)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
