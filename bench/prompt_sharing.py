"""Training with shared prompts fed once (the default) vs once per row, on GRPO-shaped batches.

    .venv/bin/python bench/prompt_sharing.py [--model smollm2-135m-instruct] [--groups 4,8] [--prompts 8]
                                             [--repeats 5] [--threads 2] [--allocator auto]

A GRPO group's responses share their prompt. `trainer.fsdp.share_prompts` (default on) packs it once per
group; off, every row carries it (the layout before 2026-12-06, and what TRL and verl feed). For each group
size, the same batch: ``--prompts`` arithmetic prompts of the vs-TRL bench in SmolLM2's chat template
(system prompt included), each with ``group`` responses whose lengths are drawn from 8..48 tokens (seeded;
the vs-TRL runs average ~28), random token ids (the cost does not depend on them). Two engines from the
same weights, one per arm, in one process; per repeat each takes one optimizer step (``train_step``) and
one no-grad log-prob pass (``forward_logprobs``, the old/ref log-prob pass), the order alternating; one
warm-up of each first. Medians and min-max over ``--repeats``.

The process runs under ``--allocator`` (default ``auto``, `runtime.allocator`: what `tandem train` runs under,
tcmalloc where it is installed; the figures of 2026-12-06 (later) ran before this option, on glibc malloc).

Also checked: the log-probs of the two arms at the same weights (before any step): max abs difference;
the loss of their first step. Fed tokens: what the model actually processes per step.

RESULT keys: ``step_time_ratio_g{G}`` / ``forward_time_ratio_g{G}`` (shared / per-row, lower is better),
``fed_token_ratio_g{G}``, and ``step_time_ratio`` = the first group size's (the vs-TRL shape).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYSTEM = "You are a calculator. Answer with the number only."  # bench/vs_trl.py's


def make_batch(model: str, prompts: int, group: int, seed: int = 0):
    from tandem.core.batch import TrainBatch
    from tandem.core.sample import Sample
    from tandem.models.registry import load_tokenizer
    from tandem.rollout.tasks import ArithmeticTaskConfig, arithmetic_records

    tok = load_tokenizer(model)
    rng = random.Random(seed)
    samples = []
    for g, rec in enumerate(arithmetic_records(ArithmeticTaskConfig(num_examples=prompts, seed=seed))):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rec["prompt"]}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        for _ in range(group):
            r = rng.randint(8, 48)
            tokens = prompt + [rng.randrange(3, tok.vocab_size) for _ in range(r)]
            samples.append(Sample(tokens=tokens, response_length=r, index=len(samples), group_index=g))
    batch = TrainBatch.from_samples(samples, pad_token_id=tok.pad_token_id or 0)
    gen = torch.Generator().manual_seed(seed)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=gen) * batch.loss_mask
    return batch


def pg_loss(out, batch, scale):
    loss = -(out.log_probs * batch.advantages * batch.loss_mask).sum() / scale.num_tokens
    return loss, {"pg/loss": loss.detach()}


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)]


def run_group(model: str, prompts: int, group: int, repeats: int) -> dict:
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine
    from tandem.models import ModelConfig

    batch = make_batch(model, prompts, group)
    arms = {"per_row": False, "shared": True}
    engines = {
        arm: FSDPEngine(FSDPConfig(model=ModelConfig(name=model), micro_batch_tokens=8192, share_prompts=share))
        for arm, share in arms.items()
    }
    lp = {arm: e.forward_logprobs(batch).log_probs for arm, e in engines.items()}
    diff = float((lp["shared"] - lp["per_row"]).abs().max())
    step_s = {arm: [] for arm in arms}
    fwd_s = {arm: [] for arm in arms}
    fed, first_loss = {}, {}
    order = list(arms)
    for rep in range(repeats + 1):  # the first round warms up
        for arm in order if rep % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            m = engines[arm].train_step(batch, pg_loss)
            dt_step = time.perf_counter() - t
            t = time.perf_counter()
            engines[arm].forward_logprobs(batch)
            dt_fwd = time.perf_counter() - t
            fed[arm] = m["train/tokens"]
            first_loss.setdefault(arm, m["train/loss"])
            if rep:
                step_s[arm].append(dt_step)
                fwd_s[arm].append(dt_fwd)
            print(f"  g{group} rep {rep} {arm:8s} step {dt_step:6.2f} s  forward {dt_fwd:5.2f} s  "
                  f"fed {fed[arm]:.0f}", flush=True)
    med = {arm: statistics.median(v) for arm, v in step_s.items()}
    fmed = {arm: statistics.median(v) for arm, v in fwd_s.items()}
    return {
        "rows": batch.batch_size,
        "prompt_tokens_mean": round(float(batch.prompt_lengths.float().mean()), 1),
        "response_tokens_mean": round(float(batch.response_lengths.float().mean()), 1),
        **{f"{arm}_step_s": round(med[arm], 3) for arm in arms},
        **{f"{arm}_step_min_max": spread(step_s[arm]) for arm in arms},
        **{f"{arm}_forward_s": round(fmed[arm], 3) for arm in arms},
        **{f"{arm}_forward_min_max": spread(fwd_s[arm]) for arm in arms},
        **{f"{arm}_fed_tokens": fed[arm] for arm in arms},
        "step_time_ratio": round(med["shared"] / med["per_row"], 3),
        "forward_time_ratio": round(fmed["shared"] / fmed["per_row"], 3),
        "fed_token_ratio": round(fed["shared"] / fed["per_row"], 3),
        "logprob_max_abs_diff": diff,
        "first_loss": {arm: first_loss[arm] for arm in arms},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--groups", default="4,8", help="responses per prompt, comma-separated")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--allocator", choices=("auto", "glibc", "tcmalloc", "jemalloc"), default="auto",
                   help="host allocator (runtime.allocator; auto: the default path)")
    a = p.parse_args()
    groups = [int(g) for g in a.groups.split(",") if g.strip()]
    if not groups or min(groups) < 1:
        p.error(f"--groups needs sizes >= 1, got {a.groups!r}")
    if a.repeats < 3:
        p.error(f"--repeats={a.repeats}: at least 3 for a median and a spread")
    from tandem.runtime.allocator import reexec_under

    allocator = reexec_under(a.allocator)  # as `tandem train` does
    torch.set_num_threads(a.threads)
    load = os.getloadavg()[0]
    out: dict = {"model": a.model, "prompts": a.prompts, "repeats": a.repeats, "threads": a.threads,
                 "allocator": allocator, "load_avg_start": round(load, 2)}
    for g in groups:
        r = run_group(a.model, a.prompts, g, a.repeats)
        print(f"group {g}: per-row {r['per_row_step_s']:.2f} s, shared {r['shared_step_s']:.2f} s a step "
              f"({r['step_time_ratio']:.3f}x); forward {r['forward_time_ratio']:.3f}x; fed tokens "
              f"{r['per_row_fed_tokens']:.0f} -> {r['shared_fed_tokens']:.0f}; |dlogp| max {r['logprob_max_abs_diff']:.2e}",
              flush=True)
        for key in ("step_time_ratio", "forward_time_ratio", "fed_token_ratio"):
            out[f"{key}_g{g}"] = r[key]
        out[f"g{g}"] = r
    out["step_time_ratio"] = out[f"step_time_ratio_g{groups[0]}"]
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
