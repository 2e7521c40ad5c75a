"""Tandem vs TRL's GRPOTrainer on the same GRPO job, step by step in turn (CPU, SmolLM2-135M-Instruct).

Both sides get the same model (fp32), the same prompts in the same order (the synthetic addition task
through the chat template: TRL's dataset is the list Tandem's data source hands out, in Tandem's order,
with ``shuffle_dataset=False``; the first prompt's token ids of every step are compared and reported as
``same_prompts``), group size, prompts per step, max new tokens, temperature 1, learning rate, no KL term,
one optimizer step per generation batch, and the same activation-checkpointing setting (TRL's
``gradient_checkpointing``, Tandem's ``trainer.fsdp.parallel.activation_checkpointing``), measured both
off (Tandem's default, the headline) and on (TRL's default).

Alternation. Each side lives in its own process (``multiprocessing`` spawn: no shared allocator, RNG or
thread pool) and keeps its model loaded; the parent hands out turns over a pipe. A side takes one
step per turn and reports it, then blocks until its next turn: TRL in a ``TrainerCallback`` at
``on_step_begin`` (the step is timed from there to ``on_step_end``, the span that holds generation,
reward, loss and the optimizer step), Tandem in its loop's ``next step`` phase, after the step's
``time/step_s`` (rollout, training, weight sync) was taken and the step logged. Setup
(``trainer.train()``'s preparation, ``Run.train()``'s start) happens inside the side's first turn, a
side's last report waits for its teardown, and a process exits only when told (after all rounds), so
nothing of one side runs during the other's turn. A pair is one TRL and one Tandem process taking turns,
TRL, Tandem, TRL, Tandem, ... for ``warmup + steps`` rounds; the warm-up rounds are dropped. Three pairs
run one after another (two processes alive at a time: TRL without checkpointing peaks at ~11 GB RSS,
Tandem at ~8 GB, and a third would not fit in this machine's 23 GB): TRL vs Tandem with checkpointing
off, TRL paged vs a fresh Tandem (off), TRL vs Tandem with checkpointing on. Reported per side: median
s/step and spread ((max - min) / median), generated tokens per step and mean completion length (TRL:
the completion ids its generate call returns, EOS included; Tandem: ``rollout/samples x
rollout/response_len_mean``), s per 1k generated tokens (median over steps) and peak RSS. Ratios are
Tandem / TRL of the same pair:

* ``step_time_ratio_vs_trl``, ``s_per_1k_tokens_ratio_vs_trl``: checkpointing off on both sides (aim
  <= 0.33 for the latter); ``..._ckpt_on``: on on both sides;
* ``step_time_ratio_vs_trl_paged`` (and s/1k tokens): TRL's strongest CPU generation setting,
  ``use_transformers_continuous_batching=True`` (the successor of ``use_transformers_paged``, a KV cache
  sized to the job: `PAGED`), checkpointing off; if it fails, ``trl_paged_error`` says why;
* ``async_overlap`` = Tandem's one-step-off s/step / max(rollout, train) s/step of its sync run (aim
  <= 1.1). One-step-off runs alone after the pairs (blocked between steps, its background rollout would
  run on during the other side's turn), ``warmup + steps + 1`` steps: the warm-up steps and the last
  step (it has no rollout to overlap) are dropped.

``--precision bf16`` runs every pair in bf16 on both sides (TRL ``bf16=True``: its forward, generation
included, under autocast; Tandem ``trainer.fsdp.parallel.param_dtype: bfloat16``, the trainer's forward
under autocast, and ``inference.torch.model.dtype: bfloat16``, the engine generating in bf16 from the synced
fp32 weights); fp32 master weights and optimizer state on both. Not the default path of either side: the
fp32 run is the headline.

Usage: python bench/vs_trl.py [--prompts 8] [--group 4] [--max-new-tokens 64] [--steps 5] [--warmup 1]
       [--checkpointing off,on] [--no-paged] [--no-one-step-off] [--precision fp32|bf16]
Needs the benchmark-only extra: pip install 'tandem-rl[bench]' (TRL). Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a calculator. Answer with the number only."
NUM_EXAMPLES = 2000
# TRL's paged side: a KV cache sized to the job (64 pages of 256 tokens, 0.75 GB) instead of the default
# share of free memory (12.6 GB RSS here, and 3x slower steps in a tiny run)
PAGED = {"num_blocks": 64, "max_batch_tokens": 2048}


def _tandem_cfg(a: dict, mode: str, ckpt: bool, allocator: str = "auto"):
    from tandem.config import from_dict
    from tandem.runtime.config import RunConfig

    return from_dict(RunConfig, {
        "run": {"name": f"bench-{mode}", "steps": a["total"], "seed": 0, "save_every": 10_000},
        "model": {"name": MODEL},
        "data": {"system_prompt": SYSTEM, "arithmetic": {"num_examples": NUM_EXAMPLES, "seed": 0}},
        "rollout": {"prompts_per_step": a["prompts"], "n_samples_per_prompt": a["group"],
                    "sampling": {"temperature": 1.0, "max_new_tokens": a["max_new_tokens"]}},
        "reward": {"terms": [{"name": "number"}]},
        "algorithm": {"advantage": {"estimator": "grpo"}, "policy_loss": {"aggregation": "token-mean"},
                      **({"off_policy": {"mode": "tis"}} if mode != "sync" else {})},
        "trainer": {"fsdp": {"micro_batch_tokens": 4096, "optimizer": {"lr": a["lr"]},
                             "parallel": {"activation_checkpointing": ckpt,
                                          "param_dtype": "bfloat16" if a.get("bf16") else None}}},
        # bf16: the engine generates in bf16 too, as TRL's generation runs under its bf16 autocast
        **({"inference": {"torch": {"model": {"name": MODEL, "dtype": "bfloat16"}}}} if a.get("bf16") else {}),
        "runtime": {"mode": mode, "allocator": allocator},
        "tracking": {"progress": False},
    })


def number_reward(completions, label, **_) -> list[float]:
    """TRL-side copy of Tandem's `number` reward: the last number equals the label."""
    import re

    out = []
    for comp, gold in zip(completions, label, strict=True):
        text = comp[-1]["content"] if isinstance(comp, list) else comp
        nums = re.findall(r"-?\d+", text.replace(",", ""))
        out.append(float(bool(nums) and int(nums[-1]) == int(gold)))
    return out


# -- the sides (each in its own process) -------------------------------------------------------------

def _child_setup(log_path: str) -> None:
    """Child output goes to a log file (the parent shows its tail on failure); all cores for torch."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    import torch

    torch.set_num_threads(os.cpu_count() or 2)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _wait_turn(conn) -> None:
    msg = conn.recv()
    if msg != "go":
        raise SystemExit(f"unexpected message {msg!r}")


def active_allocator() -> str:
    from tandem.runtime.allocator import active_allocator as active

    return active()


def _child(conn, side: str, a: dict) -> None:
    """Entry of a side's process: ``side`` is trl, trl_paged, tandem or tandem_one_step_off."""
    try:
        _child_setup(a["log"])
        (_trl_side if side.startswith("trl") else _tandem_side)(conn, side, a)
        conn.recv()  # exit (and free memory) only when the parent says so: not during another side's turn
        conn.send({"done": True, "peak_rss_mib": _peak_rss_mib()})
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on with the other sides
        traceback.print_exc()
        conn.send({"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})


def _trl_side(conn, side: str, a: dict) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tandem.models import load_tokenizer, resolve_model
    from tandem.rollout.data import DataSource

    tok = load_tokenizer(MODEL)
    # Tandem's prompts in the order Tandem's data source hands them out (the same config, seed, shuffle)
    data = DataSource(_tandem_cfg(a, "sync", a["ckpt"]).data, tok)
    recs = data.next_prompts(a["prompts"] * a["total"])
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r.prompt}],
                             "label": r.label} for r in recs])
    paged = side == "trl_paged"
    cfg = GRPOConfig(
        output_dir=a["workdir"], use_cpu=True, use_vllm=False, per_device_train_batch_size=a["prompts"] * a["group"],
        num_generations=a["group"], max_completion_length=a["max_new_tokens"], learning_rate=a["lr"], beta=0.0,
        temperature=1.0, top_p=1.0, top_k=0, max_steps=a["total"], logging_steps=1, save_strategy="no",
        report_to="none", seed=0, bf16=bool(a.get("bf16")), gradient_checkpointing=a["ckpt"], shuffle_dataset=False,
        **({"use_transformers_continuous_batching": True, "transformers_continuous_batching_config": PAGED} if paged else {}),
    )
    state = {"step": None, "pending": None, "first": True}

    def report() -> None:
        if state["pending"] is not None:
            conn.send(state["pending"])
            state["pending"] = None

    class Turns(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            report()
            if not state["first"]:
                _wait_turn(conn)
            state["first"] = False
            state["step"] = {"tokens": 0, "completions": 0, "prompt_ids": None, "rewards": []}
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            s = state["step"]
            state["pending"] = {"step_s": time.perf_counter() - state["t0"], "tokens": s["tokens"],
                                "completions": s["completions"], "prompt_ids": s["prompt_ids"],
                                "reward_mean": statistics.mean(s["rewards"]) if s["rewards"] else None}

    def reward(completions, label, **kw) -> list[float]:
        out = number_reward(completions, label)
        state["step"]["rewards"] += out
        return out

    reward.__name__ = "number_reward"
    trainer = GRPOTrainer(model=str(resolve_model(MODEL)), reward_funcs=[reward], args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Turns()])
    generate = trainer._generate_single_turn

    def counted(prompt_ids, *args, **kw):  # the exact generated token count, and the prompt TRL sends
        completion_ids, logprobs = generate(prompt_ids, *args, **kw)
        s = state["step"]
        if s["prompt_ids"] is None:
            s["prompt_ids"] = [int(t) for t in prompt_ids[0]]
        s["tokens"] += sum(len(c) for c in completion_ids)
        s["completions"] += len(completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = counted
    conn.send({"ready": True, "peak_rss_mib": _peak_rss_mib(), "allocator": active_allocator()})
    _wait_turn(conn)  # the first turn holds trainer.train()'s preparation too (untimed)
    trainer.train()
    report()  # the last step's report waits for the trainer's teardown: nothing runs in the next turn


def _tandem_side(conn, side: str, a: dict) -> None:
    from tandem.runtime.loop import Run

    stepwise = side == "tandem"
    run = Run(_tandem_cfg(a, "sync" if stepwise else "one_step_off", a["ckpt"], a["allocator"]),
              os.path.join(a["workdir"], side))
    first_ids: list[list[int]] = []
    take, log, phase = run.data.next_prompts, run.tracker.log, run.phase

    def next_prompts(n):
        recs = take(n)
        first_ids.append(list(recs[0].prompt_token_ids))
        return recs

    rows: list[dict] = []

    def tracked(step, metrics):
        log(step, metrics)
        m = metrics
        rows.append({"step_s": m["time/step_s"], "tokens": m["rollout/samples"] * m["rollout/response_len_mean"],
                     "completions": m["rollout/samples"], "prompt_ids": first_ids[step] if step < len(first_ids) else None,
                     "reward_mean": m.get("reward/mean"),
                     "rollout_s": m["time/generate_s"] + m.get("time/reward_s", 0.0),
                     "train_s": m["time/train_s"] + m.get("time/logprob_s", 0.0) + m.get("time/sync_s", 0.0)})

    def stepped(step, name):
        if name == "next step" and step < a["total"]:  # the step is logged (and saved when due)
            conn.send(rows[-1])
            if stepwise:
                _wait_turn(conn)  # before the next step's clock starts
        phase(step, name)

    run.data.next_prompts, run.tracker.log, run.phase = next_prompts, tracked, stepped
    conn.send({"ready": True, "peak_rss_mib": _peak_rss_mib(), "allocator": active_allocator()})
    _wait_turn(conn)
    run.train()
    conn.send(rows[-1])  # the last step's report waits for the final checkpoint and the run's teardown


# -- the parent: turns, figures ------------------------------------------------------------------------

class Side:
    """One side's process. It starts with ``a["allocator"]`` preloaded (``LD_PRELOAD`` at its exec, as
    ``tandem train``'s restart does; ``glibc``: nothing preloaded)."""

    def __init__(self, name: str, a: dict, work: str) -> None:
        self.name, self.steps, self.error, self.peak_rss, self.allocator = name, [], None, 0.0, None
        os.makedirs(work, exist_ok=True)
        self.log = os.path.join(work, f"{name}.log")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = a | {"log": self.log, "workdir": os.path.join(work, name)}
        self.proc = ctx.Process(target=_child, args=(child, name.split("-")[0], args), daemon=True)
        saved = os.environ.get("LD_PRELOAD")
        library = _allocator_library(a["allocator"])
        if library:  # spawn execs the interpreter with this process's environment
            os.environ["LD_PRELOAD"] = library
        try:
            self.proc.start()
        finally:
            if library:
                if saved is None:
                    os.environ.pop("LD_PRELOAD", None)
                else:
                    os.environ["LD_PRELOAD"] = saved
        child.close()

    def recv(self, timeout_s: float = 3600) -> dict:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer in {timeout_s:.0f}s")
        msg = self.conn.recv()
        if "error" in msg:
            raise RuntimeError(msg["error"])
        self.peak_rss = max(self.peak_rss, msg.get("peak_rss_mib", 0.0))
        self.allocator = msg.get("allocator", self.allocator)
        return msg

    def fail(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {e}"
        tail = open(self.log).read()[-3000:] if os.path.exists(self.log) else ""
        print(f"--- {self.name} failed: {self.error}\n{tail}\n---", file=sys.stderr, flush=True)
        self.proc.kill()

    def finish(self) -> None:
        try:
            self.conn.send("end")
            self.recv(600)
        except (EOFError, OSError, RuntimeError, TimeoutError):
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def _allocator_library(name: str) -> str | None:
    """The library to preload for allocator ``name`` (None for glibc); an error when it is not installed."""
    from tandem.runtime.allocator import resolve_allocator

    _, path = resolve_allocator(name)
    return str(path) if path else None


def _start(names: list[str], a: dict, work: str) -> list[Side]:
    """Start and load the sides one after another (untimed; no load overlaps another)."""
    sides = []
    for name in names:
        side = Side(name, a, work)
        try:
            side.recv(1800)
            print(f"[{name}] loaded", flush=True)
        except (EOFError, OSError, RuntimeError, TimeoutError) as e:
            side.fail(e)
        sides.append(side)
    return sides


def _rounds(names: list[str], a: dict, work: str) -> list[Side]:
    """``warmup + steps`` rounds of one step per live side, round robin."""
    sides = _start(names, a, work)
    for k in range(a["total"]):
        for side in sides:
            if side.error:
                continue
            try:
                side.conn.send("go")
                row = side.recv()
            except (EOFError, OSError, RuntimeError, TimeoutError) as e:
                side.fail(e)
                continue
            side.steps.append(row)
            print(f"[{side.name}] step {k}: {row['step_s']:.2f} s, {row['tokens']:.0f} tokens", flush=True)
    for side in sides:
        if not side.error:
            side.finish()
    return sides


def _summary(side: Side, drop_first: int, drop_last: int = 0) -> dict:
    rows = side.steps[drop_first:len(side.steps) - drop_last]
    times = [r["step_s"] for r in rows]
    med = statistics.median(times)
    per_1k = statistics.median(r["step_s"] / r["tokens"] * 1000 for r in rows)
    out = {"s_per_step": round(med, 2), "spread": round((max(times) - min(times)) / med, 3),
           "s_per_step_min_max": [round(min(times), 2), round(max(times), 2)], "timed_steps": len(rows),
           "tokens_per_step": round(statistics.mean(r["tokens"] for r in rows), 1),
           "mean_completion_len": round(sum(r["tokens"] for r in rows) / sum(r["completions"] for r in rows), 2),
           "s_per_1k_tokens": round(per_1k, 2), "peak_rss_mib": round(side.peak_rss), "allocator": side.allocator}
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    if rewards:
        out["reward_mean"] = round(statistics.mean(rewards), 3)
    if "rollout_s" in rows[0]:
        out["rollout_s"] = round(statistics.median(r["rollout_s"] for r in rows), 2)
        out["train_s"] = round(statistics.median(r["train_s"] for r in rows), 2)
    return out


def _same_prompts(x: Side, y: Side) -> bool:
    n = min(len(x.steps), len(y.steps))
    return n > 0 and all(x.steps[i]["prompt_ids"] == y.steps[i]["prompt_ids"] for i in range(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--checkpointing", default="off,on", help="activation checkpointing on both sides: off, on or both")
    p.add_argument("--no-paged", action="store_true", help="skip TRL's continuous-batching (paged) baseline")
    p.add_argument("--no-one-step-off", action="store_true")
    p.add_argument("--allocator", default="auto",
                   help="host allocator of both sides' processes in every pair (auto: what `tandem train` uses)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: mixed precision on both sides (TRL bf16=True, Tandem trainer.fsdp.parallel.param_dtype: "
                        "bfloat16; fp32 master weights and optimizer state on both); every pair of the run")
    p.add_argument("--also-allocator", default="glibc",
                   help="one more checkpointing-off pair with both sides on this allocator ('none': skip)")
    args = p.parse_args()
    settings = [s.strip() for s in args.checkpointing.split(",") if s.strip()]
    if not settings or any(s not in ("off", "on") for s in settings):
        p.error("--checkpointing takes off, on or off,on")
    from tandem.runtime.allocator import AllocatorError, resolve_allocator

    try:  # auto -> the name; a named one that is not installed is refused here, not in a child
        allocator = resolve_allocator(args.allocator)[0]
        also = None if args.also_allocator == "none" else resolve_allocator(args.also_allocator)[0]
    except AllocatorError as e:
        p.error(str(e))
    base = {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens, "lr": args.lr,
            "total": args.warmup + args.steps, "allocator": allocator, "bf16": args.precision == "bf16"}
    work = tempfile.mkdtemp(prefix="tandem-vs-trl-")
    load = os.getloadavg()[0]
    t_start = time.perf_counter()
    result: dict = {"model": MODEL, "prompts": args.prompts, "group": args.group,
                    "max_new_tokens": args.max_new_tokens, "warmup_steps": args.warmup, "timed_steps": args.steps,
                    "allocator": allocator, "precision": args.precision}
    try:
        # (key suffix, TRL side, checkpointing, allocator of both): two sides alive at a time (three would
        # not fit in 23 GB)
        pairs = [(sfx, kind, ckpt, alloc) for sfx, kind, ckpt, alloc in
                 (("", "trl", "off", allocator), (f"_{also}", "trl", "off", also),
                  ("_paged", "trl_paged", "off", allocator), ("_ckpt_on", "trl", "on", allocator))
                 if ckpt in settings and alloc and not (kind == "trl_paged" and args.no_paged)
                 and not (sfx == f"_{also}" and also == allocator)]
        same: list[bool] = []
        for sfx, kind, ckpt, alloc in pairs:
            a = base | {"ckpt": ckpt == "on", "allocator": alloc}
            ref, tan = _rounds([f"{kind}-{ckpt}", f"tandem-{ckpt}"], a, os.path.join(work, kind + sfx))
            for key, side in ((f"trl{sfx}", ref), (f"tandem{sfx}", tan)):
                if side.error:
                    result[f"{key}_error"] = side.error
                elif len(side.steps) > args.warmup:
                    result[key] = _summary(side, args.warmup)
            r, t = result.get(f"trl{sfx}"), result.get(f"tandem{sfx}")
            if r and t:
                result[f"step_time_ratio_vs_trl{sfx}"] = round(t["s_per_step"] / r["s_per_step"], 3)
                result[f"s_per_1k_tokens_ratio_vs_trl{sfx}"] = round(t["s_per_1k_tokens"] / r["s_per_1k_tokens"], 3)
                same.append(_same_prompts(tan, ref))
        result["same_prompts"] = bool(same) and all(same)
        if not args.no_one_step_off:
            a = base | {"ckpt": False, "total": args.warmup + args.steps + 1}
            side = _start(["tandem_one_step_off"], a, os.path.join(work, "one_step_off"))[0]
            if not side.error:
                side.conn.send("go")  # no turns: its background rollout would run during another side's turn
                try:
                    for _ in range(a["total"]):
                        side.steps.append(side.recv())
                    side.finish()
                except (EOFError, OSError, RuntimeError, TimeoutError) as e:
                    side.fail(e)
            if side.error:
                result["tandem_one_step_off_error"] = side.error
            else:
                result["tandem_one_step_off"] = off = _summary(side, args.warmup, drop_last=1)
                sync = result.get("tandem")
                if sync:
                    result["async_overlap"] = round(off["s_per_step"] / max(sync["rollout_s"], sync["train_s"]), 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result |= {"load_avg_start": round(load, 2), "load_avg_end": round(os.getloadavg()[0], 2),
               "wall_min": round((time.perf_counter() - t_start) / 60, 1)}
    for sfx, what in (("", f"checkpointing off, {allocator}"), ("_paged", "TRL paged, ckpt off"),
                      ("_ckpt_on", "checkpointing on"), (f"_{also}", f"checkpointing off, {also}")):
        t, r = result.get(f"tandem{sfx}"), result.get(f"trl{sfx}")
        if t and r:
            print(f"{what}: TRL {r['s_per_step']:.1f} s/step ({r['s_per_1k_tokens']:.1f} s/1k tok)  "
                  f"Tandem {t['s_per_step']:.1f} s/step ({t['s_per_1k_tokens']:.1f} s/1k tok)  "
                  f"ratio {result[f'step_time_ratio_vs_trl{sfx}']:.2f}x step, "
                  f"{result[f's_per_1k_tokens_ratio_vs_trl{sfx}']:.2f}x per token")
    if "async_overlap" in result:
        print(f"Tandem one-step-off: {result['tandem_one_step_off']['s_per_step']:.1f} s/step -> overlap "
              f"{result['async_overlap']:.2f}")
    print("RESULT " + json.dumps(result))
    if any(k.endswith("_error") for k in result if not k.startswith("trl_paged")):
        sys.exit(1)


if __name__ == "__main__":
    main()
