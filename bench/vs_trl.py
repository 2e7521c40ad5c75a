"""Tandem vs TRL's GRPOTrainer on the same GRPO job, in one run (CPU, SmolLM2-135M-Instruct).

Both sides get the same model (fp32), prompts (the synthetic addition task through the chat
template), group size, prompts per step, max new tokens, temperature, learning rate, no KL term and
one optimizer step per generation batch. Reported:

* seconds per step (median of the timed steps, after warm-up steps) for TRL and for Tandem (sync
  mode), and ``step_time_ratio_vs_trl`` = Tandem / TRL (aim <= 0.5);
* ``async_overlap`` = Tandem's one-step-off wall time per step / max(rollout, train) time per step
  of its sync run (aim <= 1.1: the rollout hides behind training).

Usage: python bench/vs_trl.py [--prompts 8] [--group 4] [--max-new-tokens 64] [--steps 3] [--warmup 1]
Needs the benchmark-only extra: pip install 'tandem-rl[bench]' (TRL). Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from tandem.config import from_dict
from tandem.models import load_tokenizer, resolve_model
from tandem.rollout.tasks import ArithmeticTaskConfig, arithmetic_records
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a calculator. Answer with the number only."


def _records(n: int) -> list[dict]:
    return arithmetic_records(ArithmeticTaskConfig(num_examples=n, seed=0))


def number_reward(completions, label, **_) -> list[float]:
    """TRL-side copy of Tandem's `number` reward: the last number equals the label."""
    import re

    out = []
    for comp, gold in zip(completions, label, strict=True):
        text = comp[-1]["content"] if isinstance(comp, list) else comp
        nums = re.findall(r"-?\d+", text.replace(",", ""))
        out.append(float(bool(nums) and int(nums[-1]) == int(gold)))
    return out


def run_trl(args, workdir: str) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    recs = _records(args.prompts * (args.steps + args.warmup) * 2)
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["prompt"]}],
                             "label": r["label"]} for r in recs])
    times: list[float] = []

    class Timer(TrainerCallback):
        t0 = None

        def on_step_begin(self, a, state, control, **kw):
            Timer.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter() - Timer.t0)

    cfg = GRPOConfig(
        output_dir=workdir, use_cpu=True, use_vllm=False, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_new_tokens, learning_rate=args.lr, beta=0.0,
        temperature=1.0, top_p=1.0, top_k=0, max_steps=args.steps + args.warmup, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, bf16=False,
    )
    trainer = GRPOTrainer(model=str(resolve_model(MODEL)), reward_funcs=[number_reward], args=cfg, train_dataset=ds,
                          processing_class=load_tokenizer(MODEL), callbacks=[Timer()])
    trainer.train()
    return times[args.warmup:]


def run_tandem(args, workdir: str, mode: str) -> list[dict]:
    cfg = from_dict(RunConfig, {
        "run": {"name": f"bench-{mode}", "steps": args.steps + args.warmup, "seed": 0, "save_every": 10_000},
        "model": {"name": MODEL},
        "data": {"system_prompt": SYSTEM, "arithmetic": {"num_examples": 2000, "seed": 0}},
        "rollout": {"prompts_per_step": args.prompts, "n_samples_per_prompt": args.group,
                    "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens}},
        "reward": {"terms": [{"name": "number"}]},
        "algorithm": {"advantage": {"estimator": "grpo"}, "policy_loss": {"aggregation": "token-mean"},
                      **({"off_policy": {"mode": "tis"}} if mode != "sync" else {})},
        "trainer": {"fsdp": {"micro_batch_tokens": 4096, "optimizer": {"lr": args.lr}}},
        "runtime": {"mode": mode},
        "tracking": {"progress": False},
    })
    Run(cfg, os.path.join(workdir, mode)).train()
    return read_metrics(os.path.join(workdir, mode))[args.warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--skip-trl", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    work = tempfile.mkdtemp(prefix="tandem-vs-trl-")
    load = os.getloadavg()[0]
    try:
        trl_times = [] if args.skip_trl else run_trl(args, os.path.join(work, "trl"))
        sync_rows = run_tandem(args, work, "sync")
        async_rows = run_tandem(args, work, "one_step_off")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tandem_step = statistics.median(r["time/step_s"] for r in sync_rows)
    rollout = statistics.median(r["time/generate_s"] + r.get("time/reward_s", 0) for r in sync_rows)
    train = statistics.median(r["time/train_s"] + r.get("time/logprob_s", 0) + r.get("time/sync_s", 0) for r in sync_rows)
    async_step = statistics.median(r["time/step_s"] for r in async_rows)
    result = {
        "model": MODEL, "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
        "timed_steps": args.steps, "tandem_sync_s_per_step": round(tandem_step, 2),
        "tandem_rollout_s": round(rollout, 2), "tandem_train_s": round(train, 2),
        "tandem_one_step_off_s_per_step": round(async_step, 2),
        "async_overlap": round(async_step / max(rollout, train), 3),
        "tandem_reward_mean": round(statistics.mean(r["reward/mean"] for r in sync_rows), 3),
        "load_avg_start": round(load, 2), "load_avg_end": round(os.getloadavg()[0], 2),
    }
    if trl_times:
        trl_step = statistics.median(trl_times)
        result |= {"trl_s_per_step": round(trl_step, 2), "step_time_ratio_vs_trl": round(tandem_step / trl_step, 3)}
        print(f"TRL GRPOTrainer: {trl_step:.1f} s/step   Tandem (sync): {tandem_step:.1f} s/step   "
              f"ratio {tandem_step / trl_step:.2f}x")
    print(f"Tandem one-step-off: {async_step:.1f} s/step vs max(rollout {rollout:.1f}, train {train:.1f}) -> "
          f"overlap {result['async_overlap']:.2f}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
