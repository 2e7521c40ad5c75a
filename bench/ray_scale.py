"""Ray scale-out on this machine: replica scaling, router overhead, async overlap, recovery.

All on SmolLM2-135M-Instruct (fp32), in one local Ray started by the script (2 logical CPUs, one
torch thread per actor), baseline and Tandem alternated over ``--repeats`` repeats (medians, spread):

* ``replica_scaling``: generated tokens/s through the router over 2 replicas / over 1 replica (the same
  requests: ``--prompts`` chat prompts x ``--n`` samples x exactly ``--new-tokens`` tokens). Aim >= 1.7.
  Decoding this model is memory-bound, so the run also measures ``bandwidth_ceiling``: the copy
  bandwidth of two single-thread actors at once / one alone (what two replicas can reach at best here),
  and reports ``replica_scaling_of_ceiling``.
* ``router_overhead``: wall time through the router / the same requests sent straight to that one
  replica (its client's ``submit``, one batch). Aim <= 1.05.
* ``async_speedup_disaggregated``: a GRPO loop, trainer rank on one CPU and one replica on the other:
  median step time of ``sync`` / ``one_step_off``, divided by the ideal (rollout + train) / max(rollout,
  train) measured in the sync run. Aim >= 0.9.
* ``sync_scaling_2_replicas``: weight sync seconds with 2 replicas / with 1 (one publish to the object
  store, every replica fetches it: sub-linear means < 2).
* ``recovery_s``: a replica killed mid-run -> back in rotation at the run's weight version (measured by
  polling the router); ``samples_lost``: samples that came back failed or aborted (or steps that never
  ran). Aim 0.

    .venv/bin/python bench/ray_scale.py                 # ~10 min on 2 cores
    .venv/bin/python bench/ray_scale.py --quick         # fewer tokens and steps, 2 repeats

Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import tempfile
import threading
import time

import ray

from tandem.config import load_config
from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

MODEL = "smollm2-135m-instruct"
RECIPE = "recipes/smollm2-135m/addition-grpo.yaml"


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def prompts(num: int, model: str = MODEL) -> list[list[int]]:
    from tandem.models import load_tokenizer

    tok = load_tokenizer(model)
    out = []
    for i in range(num):
        q = f"Tom has {3 + 7 * i % 89} apples and buys {11 + 13 * i % 97} more. How many now? Explain."
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def requests(ps, n: int, new_tokens: int, seed: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
        n=n, max_new_tokens=new_tokens, temperature=1.0, seed=seed + i, stop_token_ids=())) for i, p in enumerate(ps)]


def tokens(results) -> int:
    return sum(len(c.token_ids) for r in results for c in r.completions)


@ray.remote(num_cpus=1)
class _Copier:
    """Copies a 256 MiB buffer on one thread for ``seconds``: the memory traffic of a decode step."""

    def run(self, seconds: float) -> float:
        import numpy as np

        src, dst = np.ones(1 << 28, dtype=np.uint8), np.empty(1 << 28, dtype=np.uint8)
        np.copyto(dst, src)  # first touch
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            np.copyto(dst, src)
            n += 1
        return n * src.nbytes / (time.perf_counter() - t0) / 1e9


def bandwidth_ceiling(args) -> dict[str, float]:
    """The hardware's own scaling for memory-bound work: copy GB/s of two single-thread actors at once /
    one alone. A decode step of a 135M-parameter fp32 model reads ~0.54 GB of weights: bandwidth-bound."""
    one, two = [], []
    actors = [_Copier.remote() for _ in range(2)]
    for _ in range(args.repeats):
        one.append(ray.get(actors[0].run.remote(3.0)))
        two.append(sum(ray.get([a.run.remote(3.0) for a in actors])))
    ratio = [b / a for a, b in zip(one, two, strict=True)]
    print("copy GB/s, 1 actor:", spread(one), "| 2 actors:", spread(two))
    print("bandwidth_ceiling:", spread(ratio))
    for a in actors:
        ray.kill(a)
    return {"bandwidth_ceiling": statistics.median(ratio), "copy_gbps_1": statistics.median(one),
            "copy_gbps_2": statistics.median(two)}


def replica_benchmarks(args, model: str = MODEL) -> dict[str, float]:
    """Replica scaling and router overhead, on a placement of two replicas (no trainer)."""
    from tandem.runtime import builders
    from tandem.runtime.ray.placement import RayPlacement
    from tandem.runtime.router import Router, RouterConfig

    print(f"-- replicas of {model}", flush=True)
    cfg = load_config(RunConfig, RECIPE, ["runtime.placement=ray", "inference.replicas=2", "ray.torch_threads=1",
                                          f"model.name={model}", "inference.torch.max_num_seqs=64",
                                          "inference.torch.max_model_len=256", "data.max_prompt_tokens=128"])
    entry = cfg.inference.entry
    spec = entry.spec(entry.configure(builders.run_facts(cfg), cfg.inference.config))
    cluster = RayPlacement(cfg, with_trainer=False)
    try:
        cluster.start(trainer_spec=None, engine_spec=spec)
        one = Router(cluster.clients[:1], info=cluster.router.info, config=RouterConfig())
        ps = prompts(args.prompts, model)
        one.generate(requests(ps[:2], 1, 8, 0))  # warm both replicas up
        cluster.router.generate(requests(ps[:4], 1, 8, 0))
        rates = {"one": [], "two": []}
        direct, routed = [], []
        for rep in range(args.repeats):
            work = requests(ps, args.n, args.new_tokens, 1000 * rep)
            for name, router in (("one", one), ("two", cluster.router)):
                t0 = time.perf_counter()
                results = router.generate(work)
                rates[name].append(tokens(results) / (time.perf_counter() - t0))
            # router overhead: the same requests straight to replica 0, then through a router over it
            work = requests(ps, args.n, args.new_tokens, 2000 * rep)
            t0 = time.perf_counter()
            futures = cluster.clients[0].submit(work)
            straight = [f.result() for f in futures]
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            through = one.generate(requests(ps, args.n, args.new_tokens, 2000 * rep))
            routed.append(time.perf_counter() - t0)
            assert tokens(straight) == tokens(through)
            print(f"repeat {rep}: 1 replica {rates['one'][-1]:.1f} tok/s, 2 replicas {rates['two'][-1]:.1f} tok/s; "
                  f"direct {direct[-1]:.2f} s, routed {routed[-1]:.2f} s", flush=True)
        scaling = [b / a for a, b in zip(rates["one"], rates["two"], strict=True)]
        overhead = [r / d for d, r in zip(direct, routed, strict=True)]
        print("tokens/s, 1 replica:", spread(rates["one"]))
        print("tokens/s, 2 replicas:", spread(rates["two"]))
        print("replica_scaling:", spread(scaling))
        print("router_overhead:", spread(overhead))
        return {"replica_scaling": statistics.median(scaling), "router_overhead": statistics.median(overhead),
                "tokens_per_s_1_replica": statistics.median(rates["one"]),
                "tokens_per_s_2_replicas": statistics.median(rates["two"])}
    finally:
        cluster.close()


def loop_config(mode: str, steps: int, extra: list[str]) -> RunConfig:
    return load_config(RunConfig, RECIPE, [
        "runtime.placement=ray", "inference.replicas=1", "ray.torch_threads=1", f"runtime.mode={mode}",
        f"run.steps={steps}", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "eval.sets=[]",
        "tracking.progress=false", *([] if mode == "sync" else ["algorithm.off_policy.mode=tis"]), *extra])


def async_benchmark(args) -> dict[str, float]:
    """Disaggregated: trainer rank and replica each on one CPU; sync vs one-step-off step time."""
    results = {"sync": [], "one_step_off": []}
    phases, sync_s = [], []
    for rep in range(args.repeats):
        for mode in ("sync", "one_step_off"):
            run_dir = tempfile.mkdtemp(prefix="tandem-bench-ray-")
            try:
                Run(loop_config(mode, args.steps, []), run_dir).train()
                rows = [r for r in read_metrics(run_dir) if "time/step_s" in r][1:]  # the first step warms up
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints: a bench leaves nothing behind
            step = statistics.median(r["time/step_s"] for r in rows)
            results[mode].append(step)
            if mode == "sync":
                rollout = statistics.median(r["time/generate_s"] + r["time/reward_s"] for r in rows)
                phases.append((rollout, step - rollout))
                sync_s += [r["sync/seconds"] for r in rows]
            print(f"repeat {rep} {mode}: median step {step:.2f} s", flush=True)
    speedups = [s / o for s, o in zip(results["sync"], results["one_step_off"], strict=True)]
    ideals = [(r + t) / max(r, t) for r, t in phases]
    ratio = [s / i for s, i in zip(speedups, ideals, strict=True)]
    print("sync step:", spread(results["sync"]))
    print("one-step-off step:", spread(results["one_step_off"]))
    print("rollout / train (sync):", [f"{r:.2f}/{t:.2f}" for r, t in phases])
    print("speedup:", spread(speedups), "ideal:", spread(ideals))
    print("async_speedup_disaggregated:", spread(ratio))
    print("weight sync, 1 replica:", spread(sync_s))
    return {"sync_s_1_replica": statistics.median(sync_s),
            "async_speedup_disaggregated": statistics.median(ratio), "async_speedup": statistics.median(speedups),
            "async_ideal": statistics.median(ideals), "sync_step_s": statistics.median(results["sync"]),
            "one_step_off_step_s": statistics.median(results["one_step_off"])}


def recovery_benchmark(args) -> dict[str, float]:
    """Kill replica 0 during each of several steps; time until it serves again at the run's version."""
    run_dir = tempfile.mkdtemp(prefix="tandem-bench-ray-")
    steps = args.kills + 2
    run = Run(loop_config("sync", steps, ["inference.replicas=2", "ray.max_replica_restarts=10"]), run_dir)
    recoveries: list[float] = []

    def killer() -> None:
        for k in range(args.kills):
            while len(read_metrics(run_dir)) < k + 1:
                time.sleep(0.05)
            time.sleep(0.5)  # into the next step's rollout
            client = run.cluster.clients[0]
            before = client.health()["instance"]
            t0 = time.perf_counter()
            ray.kill(client.handle, no_restart=False)
            while True:
                row = next(r for r in run.engine.health()["replicas"] if r["name"] == client.name)
                try:
                    back = client.health()["instance"] != before
                except Exception:  # noqa: BLE001 - still restarting
                    back = False
                if back and not row["quarantined"] and row["weight_version"] >= run.version:
                    break
                time.sleep(0.05)
            recoveries.append(time.perf_counter() - t0)
            print(f"kill {k}: serving again at version {row['weight_version']} after {recoveries[-1]:.2f} s",
                  flush=True)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    run.train()
    thread.join(timeout=120)
    rows = read_metrics(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    # every sample the run asked for came back generated: none failed or aborted (a replica's death
    # re-queues its requests), and every step ran
    lost = sum(r["rollout/failed"] + r["rollout/aborted"] for r in rows)
    sync_s = [r["sync/seconds"] for r in rows[1:] if r.get("sync/replicas") == 2]
    print("weight sync, 2 replicas:", spread(sync_s) if sync_s else "no sync reached both")
    print("recovery_s:", spread(recoveries) if recoveries else "no kill completed",
          f"| steps {len(rows)} of {steps}, samples {sum(r['rollout/samples'] for r in rows):.0f}, lost {lost:.0f}")
    return {"sync_s_2_replicas": statistics.median(sync_s) if sync_s else float("nan"),
            "recovery_s": statistics.median(recoveries) if recoveries else float("nan"),
            "samples_lost": float(lost + (steps - len(rows)) * 16), "kills": float(len(recoveries))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.prompts, args.new_tokens, args.steps, args.kills = 2, 8, 32, 3, 2
    logging.basicConfig(level=logging.WARNING)
    # logical CPUs for Ray's bookkeeping (a trainer bundle + 2 replica bundles); every actor computes on one
    # torch thread, so the 2 physical cores are shared as the comments of each benchmark say
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        result = bandwidth_ceiling(args)
        result |= replica_benchmarks(args)
        result["replica_scaling_of_ceiling"] = result["replica_scaling"] / result["bandwidth_ceiling"]
        result |= async_benchmark(args)
        result |= recovery_benchmark(args)
        # one publish, N fetches: the sync of 2 replicas / of 1 (1 would be free, 2 two sends)
        result["sync_scaling_2_replicas"] = result["sync_s_2_replicas"] / result["sync_s_1_replica"]
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
