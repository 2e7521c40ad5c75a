"""Full fine-tuning vs LoRA vs QLoRA on the demo task: memory, step time, sync size, reward.

The three recipes of SmolLM2-135M-Instruct on single-digit addition (`recipes/smollm2-135m/`):
``addition-grpo.yaml`` (full, fp32), ``addition-grpo-lora.yaml`` (rank-16 adapters on every linear layer,
adapter-only sync to the embedded engine) and ``addition-grpo-qlora.yaml`` (the same with the frozen base
in FP8, served as FP8 by the engine). Same prompts, seeds, steps and checkpointing (the final one) on
every side; no evaluation. Each run is a fresh process (colocated: trainer and engine share it), so its
peak RSS is the run's memory; the runs alternate (full, lora, qlora, then rotated) over ``--repeats``.

Per run: peak RSS, trainer state bytes (parameters, gradients, optimizer state, counted from the
trainer), median seconds per step after the first, sync bytes and seconds per step, generated tokens,
and the reward of every step. Medians over repeats, with the spread (min-max).

    python bench/lora.py                  # 8 steps x 3 repeats (~25 min on 2 cores)
    python bench/lora.py --steps 3 --repeats 1
    python bench/lora.py --decode 64x32   # the engine alone: no adapter / merged adapter / unmerged (~3 min)
    python bench/lora.py --sleep-frees --steps 4   # full fine-tuning, the engine freeing its weights at
                                                   # sleep (sleep_frees_weights) vs keeping them (~14 min)
    python bench/lora.py --fixed-work --steps 3    # the three trainers on one fixed batch (~6 min)

``--fixed-work``: the runs above train on the groups their own rewards keep (``drop_zero_std_groups``), so the
sides' steps differ in work. Here each recipe's run is built (fresh process, alternating) and its trainer takes
``--steps`` optimizer steps on one fixed GRPO batch (`bench/prompt_sharing.py`'s: 8 prompts x 8 responses of
8-48 tokens, random advantages); the first is left out. RESULT keys ``lora_fixed_work_step_ratio``,
``qlora_fixed_work_step_ratio`` (training step time over full fine-tuning's).

Ends with ``RESULT {json}``; keys and aims (issue 20): ``lora_sync_bytes_ratio`` <= 0.02 (of full),
``lora_peak_memory_ratio`` <= 0.6, ``qlora_peak_memory_ratio`` <= 0.45, ``lora_step_time_ratio`` <= 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "full": ROOT / "recipes" / "smollm2-135m" / "addition-grpo.yaml",
    "lora": ROOT / "recipes" / "smollm2-135m" / "addition-grpo-lora.yaml",
    "qlora": ROOT / "recipes" / "smollm2-135m" / "addition-grpo-qlora.yaml",
}
AIMS = {"lora_sync_bytes_ratio": 0.02, "lora_peak_memory_ratio": 0.6, "qlora_peak_memory_ratio": 0.45,
        "lora_step_time_ratio": 1.0}


def _trainer_bytes(trainer) -> dict[str, float]:
    """Parameters (trainable or not, buffers such as a QLoRA base included), gradients, optimizer state."""
    module = trainer.policy.module
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    opt = sum(t.numel() * t.element_size() for state in trainer.policy.optimizer.state.values()
              for t in state.values() if hasattr(t, "numel"))
    return {"params_mib": params / 2**20, "buffers_mib": buffers / 2**20, "grads_mib": grads / 2**20,
            "optimizer_mib": opt / 2**20}


def child(name: str, steps: int, out: Path, overrides: list[str]) -> None:
    """One run in this process; prints one JSON line."""
    from tandem.config import load_config
    from tandem.runtime.allocator import reexec_under
    from tandem.runtime.config import RunConfig
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics

    cfg = load_config(RunConfig, RECIPES[name], [f"run.steps={steps}", "run.save_every=0", "eval.sets=[]",
                                                 "tracking.progress=false", *overrides])
    allocator = reexec_under(cfg.runtime.allocator)  # as `tandem train` does: the default path
    t0 = time.perf_counter()
    run = Run(cfg, out, overwrite=True)
    build_s = time.perf_counter() - t0
    run.train(close=False)
    state = _trainer_bytes(run.trainer)
    run.close()
    rows = read_metrics(out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    print(json.dumps({
        "name": name, "allocator": allocator, "peak_rss_mib": peak, "build_s": build_s, **state,
        "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        "step_s": [r["time/step_s"] for r in rows], "sync_bytes": [r.get("sync/bytes", 0.0) for r in rows],
        "sync_s": [r.get("time/sync_s", 0.0) for r in rows], "reward": [r.get("reward/mean") for r in rows],
        "rollout_s": [r.get("time/generate_s", 0.0) for r in rows], "train_s": [r.get("time/train_s", 0.0) for r in rows],
        "tokens": [r.get("rollout/response_len_mean", 0.0) * r.get("rollout/samples", 0.0) for r in rows],
        "contract_max": max(r.get("train_rollout_logprob_abs_diff/max", 0.0) for r in rows),
    }), flush=True)


def fixed_work_child(name: str, steps: int, out: Path, overrides: list[str]) -> None:
    """The recipe's trainer, built as a run builds it, stepping on one fixed batch; prints one JSON line."""
    from tandem.config import load_config
    from tandem.runtime.allocator import reexec_under
    from tandem.runtime.config import RunConfig
    from tandem.runtime.loop import Run

    sys.path.insert(0, str(ROOT / "bench"))
    from prompt_sharing import make_batch, pg_loss

    cfg = load_config(RunConfig, RECIPES[name], ["run.save_every=0", "eval.sets=[]", "tracking.progress=false",
                                                 *overrides])
    reexec_under(cfg.runtime.allocator)
    run = Run(cfg, out, overwrite=True)
    batch = make_batch(cfg.model.name, 8, 8)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run.trainer.train_step(batch, pg_loss)
        times.append(time.perf_counter() - t)
    run.close()
    print(json.dumps({"name": name, "train_s": times}), flush=True)


def fixed_work(steps: int, repeats: int, overrides: list[str]) -> int:
    names = list(RECIPES)
    runs: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-fixed-") as tmp:
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                r = _run_child(name, steps, Path(tmp) / f"{name}-{rep}", overrides, mode="--fixed-child")
                runs[name].append(_med(r["train_s"][1:]))
                print(f"repeat {rep + 1}/{repeats} {name:>5}: {runs[name][-1]:.2f} s a training step "
                      f"({', '.join(f'{t:.2f}' for t in r['train_s'])})", file=sys.stderr, flush=True)
    med = {n: _med(v) for n, v in runs.items()}
    for n in names:
        print(f"{n:>6}: {med[n]:.2f} s a training step ({_spread(runs[n])})")
    result = {"lora_fixed_work_step_ratio": round(med["lora"] / med["full"], 3),
              "qlora_fixed_work_step_ratio": round(med["qlora"] / med["full"], 3),
              "train_s": {n: round(med[n], 3) for n in names}, "train_s_min_max": {n: _spread(runs[n]) for n in names},
              "steps": steps, "repeats": repeats, "overrides": overrides}
    print("RESULT " + json.dumps(result))
    return 0


def decode(seqs: int, new_tokens: int, repeats: int) -> int:
    """The engine alone: ``seqs`` x ``new_tokens`` sampled tokens with no adapter, with a rank-16 adapter
    on every linear layer merged into the packed weights (the default), and served unmerged
    (``merge_lora=False``); the arms alternate. Prints medians and ``RESULT {json}``."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from rollout_throughput import MODEL, make_prompts, run_tandem

    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import ModelConfig

    def engine(**kw) -> TorchEngine:
        return TorchEngine(TorchEngineConfig(model=ModelConfig(name=MODEL, dtype="float32"), max_num_seqs=seqs,
                                             max_model_len=512, lora_alpha=32.0, **kw))

    engines = {"merged": engine(), "unmerged": engine(merge_lora=False)}
    gen = torch.Generator().manual_seed(0)
    adapter = [(f"base_model.model.{name}.lora_{part}.weight",
                torch.randn(*((16, m.in_features) if part == "A" else (m.out_features, 16)), generator=gen) * 0.01)
               for name, m in engines["merged"].model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS for part in "AB"]
    prompts = make_prompts(seqs)
    for e in engines.values():
        e.load_lora_adapter(adapter, version=1)
        run_tandem(e, prompts[:2], 4)  # warm-up
    assert engines["merged"].health()["lora_merged"] == "policy"
    times: dict[str, list[float]] = {"base": [], "merged": [], "unmerged": [], "merge_s": []}
    for rep in range(repeats):
        for name in ("merged", "unmerged"):
            times[name].append(run_tandem(engines[name], prompts, new_tokens))
        e = engines["merged"]
        e.remove_lora_adapter("policy")
        times["base"].append(run_tandem(e, prompts, new_tokens))
        t0 = time.perf_counter()
        e.load_lora_adapter(adapter, version=rep + 2)  # the sync: parse, fold, re-pack the targeted weights
        times["merge_s"].append(time.perf_counter() - t0)
    tokens = seqs * new_tokens
    for name in ("base", "merged", "unmerged"):
        print(f"{name:>9}: {tokens / _med(times[name]):.1f} tokens/s ({_spread(times[name])} s per rollout)")
    result = {"seqs": seqs, "new_tokens": new_tokens, "repeats": repeats,
              **{f"{k}_s": round(_med(v), 3) for k, v in times.items()},
              "merged_over_unmerged": round(_med(times["unmerged"]) / _med(times["merged"]), 3),
              "merged_over_base": round(_med(times["base"]) / _med(times["merged"]), 3)}
    print("RESULT " + json.dumps(result))
    return 0


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _run_child(name: str, steps: int, out: Path, overrides: list[str], mode: str = "--child") -> dict:
    proc = subprocess.run([sys.executable, __file__, mode, name, "--steps", str(steps), "--out", str(out),
                           *[f"--set={o}" for o in overrides]],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.3g}-{max(xs):.3g}"


def sleep_frees(steps: int, repeats: int, overrides: list[str]) -> int:
    """Full fine-tuning with the colocated engine freeing its packed-only weights at sleep
    (``inference.torch.sleep_frees_weights: true``) vs keeping them (the default), alternating; same recipe,
    prompts and seeds. Prints medians and ``RESULT {json}``."""
    arms = {"freed": "inference.torch.sleep_frees_weights=true", "kept": "inference.torch.sleep_frees_weights=false"}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-sleep-") as tmp:
        for rep in range(repeats):
            for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                r = _run_child("full", steps, Path(tmp) / f"{arm}-{rep}", [*overrides, arms[arm]])
                runs[arm].append(r)
                print(f"repeat {rep + 1}/{repeats} {arm:>5}: peak {r['peak_rss_mib']:.0f} MiB, "
                      f"{_med(r['step_s'][1:]):.2f} s/step (rollout {_med(r['rollout_s'][1:]):.2f}, train "
                      f"{_med(r['train_s'][1:]):.2f}), sync {_med(r['sync_s']):.3f} s", file=sys.stderr, flush=True)
    summary = {}
    for arm, rs in runs.items():
        peaks, faults = [r["peak_rss_mib"] for r in rs], [r["minor_faults"] for r in rs]
        steps_s, rollout, train = ([_med(r[k][1:]) for r in rs] for k in ("step_s", "rollout_s", "train_s"))
        syncs = [_med(r["sync_s"]) for r in rs]
        summary[arm] = {"peak_rss_mib": _med(peaks), "peak_rss_spread": _spread(peaks), "s_per_step": _med(steps_s),
                        "s_per_step_spread": _spread(steps_s), "sync_s": _med(syncs), "sync_s_spread": _spread(syncs),
                        "rollout_s": _med(rollout), "train_s": _med(train), "rewards": [r["reward"] for r in rs]}
        print(f"{arm:>5}: peak RSS {_med(peaks):.0f} MiB ({_spread(peaks)}), {_med(steps_s):.2f} s/step "
              f"({_spread(steps_s)}): rollout {_med(rollout):.2f} s ({_spread(rollout)}), train {_med(train):.2f} s "
              f"({_spread(train)}), sync {_med(syncs):.3f} s ({_spread(syncs)}), minor page faults "
              f"{_med(faults) / 1e6:.2f} M")
    freed, kept = summary["freed"], summary["kept"]
    same = all(a["reward"] == b["reward"] for a, b in zip(runs["freed"], runs["kept"], strict=True))
    print(f"rewards of every step identical in both arms: {same}")
    result = {"steps": steps, "repeats": repeats, "peak_rss_freed_mib": round(freed["peak_rss_mib"]),
              "peak_rss_kept_mib": round(kept["peak_rss_mib"]),
              "peak_saved_mib": round(kept["peak_rss_mib"] - freed["peak_rss_mib"]),
              "step_time_ratio": round(freed["s_per_step"] / kept["s_per_step"], 3),
              "rollout_s_freed": round(freed["rollout_s"], 2), "rollout_s_kept": round(kept["rollout_s"], 2),
              "train_s_freed": round(freed["train_s"], 2), "train_s_kept": round(kept["train_s"], 2),
              "sync_s_freed": round(freed["sync_s"], 3), "sync_s_kept": round(kept["sync_s"], 3),
              "same_rewards": same, "overrides": overrides}
    print("RESULT " + json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override applied to every run (e.g. trainer.fsdp.parallel.activation_checkpointing=true)")
    ap.add_argument("--decode", metavar="SEQSxNEW",
                    help="instead: the engine alone, no adapter vs merged vs unmerged (e.g. 64x32)")
    ap.add_argument("--sleep-frees", action="store_true",
                    help="instead: full fine-tuning, the engine freeing its weights at sleep vs keeping them")
    ap.add_argument("--fixed-work", action="store_true",
                    help="instead: the three trainers' step time on one fixed batch (equal work)")
    ap.add_argument("--child", choices=sorted(RECIPES), help=argparse.SUPPRESS)
    ap.add_argument("--fixed-child", choices=sorted(RECIPES), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2 (the first step is left out of the step time)")
    if args.decode:
        seqs, _, new_tokens = args.decode.partition("x")
        if not (seqs.isdigit() and new_tokens.isdigit() and int(seqs) > 0 and int(new_tokens) > 0):
            ap.error(f"--decode {args.decode!r}: SEQSxNEW, two positive integers (e.g. 64x32)")
        return decode(int(seqs), int(new_tokens), max(args.repeats, 1))
    if args.sleep_frees:
        return sleep_frees(args.steps, max(args.repeats, 1), args.set)
    if args.child:
        child(args.child, args.steps, Path(args.out), args.set)
        return 0
    if args.fixed_child:
        fixed_work_child(args.fixed_child, args.steps, Path(args.out), args.set)
        return 0
    if args.fixed_work:
        return fixed_work(args.steps, max(args.repeats, 1), args.set)
    names = list(RECIPES)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as tmp:
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                r = _run_child(name, args.steps, Path(tmp) / f"{name}-{rep}", args.set)
                runs[name].append(r)
                print(f"repeat {rep + 1}/{args.repeats} {name:>5}: peak {r['peak_rss_mib']:.0f} MiB, "
                      f"{_med(r['step_s'][1:]):.2f} s/step, sync {_med(r['sync_bytes']) / 2**20:.1f} MiB, "
                      f"reward {r['reward'][0]:.2f} -> {r['reward'][-1]:.2f}", file=sys.stderr, flush=True)
    summary: dict[str, dict] = {}
    for name, rs in runs.items():
        step = [_med(r["step_s"][1:]) for r in rs]
        summary[name] = {
            "peak_rss_mib": _med([r["peak_rss_mib"] for r in rs]), "peak_rss_spread": _spread([r["peak_rss_mib"] for r in rs]),
            "s_per_step": _med(step), "s_per_step_spread": _spread(step),
            # the steps timed (the first left out) over the tokens those steps generated
            "s_per_1k_tokens": _med([sum(r["step_s"][1:]) / max(sum(r["tokens"][1:]), 1) * 1000 for r in rs]),
            "sync_mib": _med([_med(r["sync_bytes"]) for r in rs]) / 2**20,
            "sync_s": _med([_med(r["sync_s"]) for r in rs]),
            # the phases of the timed steps: rollout (generation + rewards) and training (log-probs + update)
            "rollout_s": _med([_med(r["rollout_s"][1:]) for r in rs]),
            "train_s": _med([_med(r["train_s"][1:]) for r in rs]),
            "reward_first": _med([r["reward"][0] for r in rs]),
            "reward_last2": _med([statistics.mean(r["reward"][-2:]) for r in rs]),
            "contract_max": max(r["contract_max"] for r in rs), "allocator": rs[0]["allocator"],
            **{k: rs[0][k] for k in ("params_mib", "buffers_mib", "grads_mib", "optimizer_mib")},
        }
    print(f"\nhost allocator: {summary['full']['allocator']} (runtime.allocator; --set runtime.allocator=glibc for glibc)")
    print(f"{'':>6} | peak RSS MiB | s/step (spread) | rollout s | train s | s/1k tok | sync MiB | sync s | state MiB "
          "(params+buffers / grads / optim) | reward step 1 -> last 2")
    for name, s in summary.items():
        print(f"{name:>6} | {s['peak_rss_mib']:>12.0f} | {s['s_per_step']:.2f} ({s['s_per_step_spread']}) | "
              f"{s['rollout_s']:>9.2f} | {s['train_s']:>7.2f} | "
              f"{s['s_per_1k_tokens']:>8.2f} | {s['sync_mib']:>8.1f} | {s['sync_s']:.3f} | "
              f"{s['params_mib'] + s['buffers_mib']:.0f} / {s['grads_mib']:.0f} / {s['optimizer_mib']:.0f} | "
              f"{s['reward_first']:.2f} -> {s['reward_last2']:.2f}")
    full, lora, qlora = summary["full"], summary["lora"], summary["qlora"]
    result = {
        "lora_sync_bytes_ratio": lora["sync_mib"] / full["sync_mib"],
        "lora_peak_memory_ratio": lora["peak_rss_mib"] / full["peak_rss_mib"],
        "qlora_peak_memory_ratio": qlora["peak_rss_mib"] / full["peak_rss_mib"],
        "lora_step_time_ratio": lora["s_per_step"] / full["s_per_step"],
        "qlora_step_time_ratio": qlora["s_per_step"] / full["s_per_step"],
        "steps": args.steps, "repeats": args.repeats, "overrides": args.set, "runs": summary,
    }
    result["aims_met"] = {k: result[k] <= v for k, v in AIMS.items()}
    for k, v in AIMS.items():
        print(f"{k} = {result[k]:.3f} (aim <= {v}): {'met' if result[k] <= v else 'MISSED'}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
