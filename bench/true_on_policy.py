"""Step time of the exact true-on-policy contract vs the default mode, in one run (SmolLM2-135M, CPU).

Three GRPO configurations on the same prompts, seeds and steps:

* ``default``: Tandem's default: stock (fast) kernels on both sides; old log-probs are the trainer's
  pre-update log-probs of the training forward itself (one optimizer step per batch), so no extra pass;
* ``recompute``: as default plus the separate old-log-prob trainer pass most peers run before the
  update (the pass an exact contract makes unnecessary); its time is ``time/old_logprob_s``;
* ``exact``: deterministic (batch-invariant) numerics on the engine and the trainer, the exact
  contract checked every step, and the rollout log-probs used as old log-probs (no extra pass).

The three run ``--repeats`` times (default 3), alternating (default, recompute, exact, default, ...), each
run a fresh process state with ``--warmup`` untimed steps; a mode's figure is the median over all its
timed steps, with the spread of its runs' medians ((max - min) / median). Sampling is not forced to a
fixed length, so seconds per 1k generated tokens (``rollout/response_len_mean`` x samples per step) are
printed next to seconds per step. Ends with ``RESULT {json}`` including
``exact_vs_default_step_time`` (aim <= 1.3), ``exact_vs_recompute_step_time`` and the measured
train/rollout log-prob difference of each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from tandem.config import from_dict
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

MODES = {
    "default": {},
    "recompute": {"algorithm": {"contract": {"old_log_probs": "recompute"}}},
    "exact": {"algorithm": {"contract": {"expect": "exact"}},
              "trainer": {"fsdp": {"deterministic": True}}, "inference": {"torch": {"deterministic": True}}},
}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_mode(name: str, args, work: str) -> list[dict]:
    base = {
        "run": {"name": name, "steps": args.steps + args.warmup, "seed": 0, "save_every": 10_000},
        "model": {"name": args.model, "dtype": args.dtype},
        "data": {"system_prompt": "You are a calculator. Answer with the number only."},
        "rollout": {"prompts_per_step": args.prompts, "n_samples_per_prompt": args.group,
                    "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens}},
        "reward": {"terms": [{"name": "number"}]},
        "trainer": {"fsdp": {"micro_batch_tokens": 4096, "optimizer": {"lr": 1e-5}}},
        "inference": {"torch": {}},
        "tracking": {"progress": False},
    }
    cfg = from_dict(RunConfig, _merge(base, MODES[name]))
    Run(cfg, os.path.join(work, name)).train()
    return read_metrics(os.path.join(work, name))[args.warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's dtype on both sides (bfloat16: on an AMX CPU the exact mode computes each bf16 "
                        "product in float32, docs/inference.md)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    load = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="tandem-top-")
    result: dict = {"model": args.model, "dtype": args.dtype, "timed_steps": args.steps, "repeats": args.repeats,
                    "load_avg_start": round(load, 2)}
    rows: dict[str, list[list[dict]]] = {name: [] for name in MODES}
    for r in range(args.repeats):
        for name in MODES:
            rows[name].append(run_mode(name, args, os.path.join(work, str(r))))
            print(f"repeat {r} {name:10s} " + " ".join(f"{x['time/step_s']:.2f}" for x in rows[name][-1]) + " s/step",
                  flush=True)
    samples = args.prompts * args.group
    med = {}
    for name, runs in rows.items():
        steps = [x for run in runs for x in run]
        med[name] = statistics.median(x["time/step_s"] for x in steps)
        run_medians = [statistics.median(x["time/step_s"] for x in run) for run in runs]
        per_1k = statistics.median(1e3 * x["time/step_s"] / (x["rollout/response_len_mean"] * samples) for x in steps)
        diff = max(x["train_rollout_logprob_abs_diff/max"] for x in steps)
        result[f"{name}_s_per_step"] = round(med[name], 3)
        result[f"{name}_spread"] = round((max(run_medians) - min(run_medians)) / med[name], 3)
        result[f"{name}_s_per_1k_tokens"] = round(per_1k, 3)
        result[f"{name}_train_rollout_abs_diff_max"] = diff
        if name == "recompute":
            result["old_logprob_pass_s"] = round(statistics.median(x["time/old_logprob_s"] for x in steps), 3)
        print(f"{name:10s} {med[name]:7.2f} s/step (spread {result[f'{name}_spread']:.2f}), {per_1k:.2f} s per 1k "
              f"tokens   max |train - rollout| log-prob = {diff:.3g}", flush=True)
    result["exact_vs_default_step_time"] = round(med["exact"] / med["default"], 3)
    result["exact_vs_recompute_step_time"] = round(med["exact"] / med["recompute"], 3)
    result["exact_vs_default_per_1k_tokens"] = round(result["exact_s_per_1k_tokens"] / result["default_s_per_1k_tokens"], 3)
    result["load_avg_end"] = round(os.getloadavg()[0], 2)
    print(f"exact / default = {result['exact_vs_default_step_time']:.2f}x "
          f"({result['exact_vs_default_per_1k_tokens']:.2f}x per 1k tokens), "
          f"exact / recompute = {result['exact_vs_recompute_step_time']:.2f}x")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
