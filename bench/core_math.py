"""Benchmark: Tandem's RL math vs verl's own functions (`verl.trainer.ppo.core_algos`), same inputs, same run.

Workload (one training step's math, 4,096 samples x 2,048 response tokens, float32, groups of 8):
GRPO advantages -> PPO-clip loss (clip 0.2 / 0.28, dual clip 3) x token-level TIS (cap 2) + k3 KL term
(coef 0.001), token-mean aggregation -> backward. Both sides are timed on the full batch.

* tandem: ``compute_advantages`` + the policy ``LossFn`` (``build_loss_fn``) + backward.
* verl:   ``compute_grpo_outcome_advantage`` (verl's ``grpo`` estimator) ->
          ``rollout_corr_helper.compute_rollout_correction_weights`` (token TIS) ->
          ``compute_policy_loss_vanilla`` (its ``rollout_is_weights``) + ``kl_penalty("low_var_kl")`` ->
          ``agg_loss("token-mean")``, composed as verl's ``workers/utils/losses.py:ppo_loss`` does -> backward.
* verl, TIS inline (a reference): the same, with verl's TIS formula written out in place of
          ``compute_rollout_correction_weights``, whose 14 diagnostics (``compute_is_metrics``) dominate it.

Eager is timed against eager and compiled against compiled: ``PolicyLossConfig(compile=True)`` compiles
Tandem's loss terms (advantages stay eager); on the verl side the same span (TIS weights + policy loss +
KL + aggregation) is wrapped in ``torch.compile(dynamic=True)``, verl's advantage function stays eager.
Sides alternate within each repeat; medians and min/max are printed. Before any timing both sides run on
the full batch and must give the same loss and gradient.

verl is not a Tandem dependency; install it (and the four small packages ``core_algos`` needs to import)
without letting pip touch torch — the script prints the command and exits 2 when verl is missing:

    .venv/bin/pip install --no-deps verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3
    .venv/bin/pip install omegaconf==2.4.0 codetiming==1.4.0
    .venv/bin/python bench/core_math.py [--samples 4096] [--tokens 2048] [--repeats 5]

Ends with one line ``RESULT {json}`` holding ``speedup_vs_verl_eager`` and ``speedup_vs_verl_compiled``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tandem.core.advantages import AdvantageConfig, compute_advantages
from tandem.core.batch import TrainBatch
from tandem.core.kl import KLConfig
from tandem.core.losses import PolicyLossConfig, build_loss_fn, loss_scale_from_masks
from tandem.core.offpolicy import OffPolicyConfig
from tandem.core.protocols import LogProbOutput

CLIP_LOW, CLIP_HIGH, DUAL_CLIP_C, KL_COEF, TIS_CAP, STD_EPS = 0.2, 0.28, 3.0, 0.001, 2.0, 1e-6
VERL_PIN = "verl==0.9.1"
INSTALL = (
    f".venv/bin/pip install --no-deps {VERL_PIN} tensordict==0.15.3 pyvers==0.2.3 && "
    ".venv/bin/pip install omegaconf==2.4.0 codetiming==1.4.0"
)


# -- inputs ---------------------------------------------------------------------------------------


def make_inputs(num_samples: int, width: int, group_size: int, seed: int = 0) -> dict[str, Any]:
    """One batch, in each framework's own format (built once, outside the timing)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (num_samples,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    base = -torch.rand(num_samples, width, generator=g) * 3
    noise = lambda s: s * torch.randn(num_samples, width, generator=g)  # noqa: E731
    rewards = torch.randint(0, 2, (num_samples,), generator=g).float()
    group_index = torch.randperm(num_samples, generator=g) // group_size
    # verl's format: the scalar reward on the last response token, prompt uids as a numpy object array
    token_level_rewards = torch.zeros(num_samples, width)
    token_level_rewards[torch.arange(num_samples), lengths - 1] = rewards
    return {
        "mask": mask,
        "rewards": rewards,
        "group_index": group_index,
        "log_probs": (base + noise(0.05)) * mask,
        "old": base * mask,
        "ref": (base + noise(0.1)) * mask,
        "rollout": (base + noise(0.02)) * mask,
        "token_level_rewards": token_level_rewards,
        "uid": np.array([f"uid-{int(i)}" for i in group_index], dtype=object),
    }


def shrink(x: dict[str, Any], rows: int) -> dict[str, Any]:
    return {k: v[:rows] for k, v in x.items()}


# -- tandem ---------------------------------------------------------------------------------------


def tandem_loss_fn(compile: bool):
    return build_loss_fn(
        PolicyLossConfig(
            clip_eps_low=CLIP_LOW, clip_eps_high=CLIP_HIGH, dual_clip_c=DUAL_CLIP_C,  # verl: always c = 3
            aggregation="token-mean", compile=compile,
        ),
        kl=KLConfig(estimator="k3", placement="loss", coef=KL_COEF),
        off_policy=OffPolicyConfig(mode="tis", level="token", tis_cap=TIS_CAP),
    )  # fmt: skip


def tandem_advantages(x: dict[str, Any]) -> TrainBatch:
    b = x["mask"].shape[0]
    batch = TrainBatch(
        input_ids=torch.zeros(b, 1, dtype=torch.long),
        seq_lengths=torch.ones(b, dtype=torch.long),
        prompt_lengths=torch.ones(b, dtype=torch.long),
        loss_mask=x["mask"],
        rewards=x["rewards"],
        group_index=x["group_index"],
        old_log_probs=x["old"],
        ref_log_probs=x["ref"],
        rollout_log_probs=x["rollout"],
    )
    batch, _ = compute_advantages(batch, AdvantageConfig(estimator="grpo", std_eps=STD_EPS))
    return batch


def tandem_step(x: dict[str, Any], compile: bool) -> tuple[float, torch.Tensor]:
    """Tandem's path: compute_advantages + the policy LossFn + backward."""
    batch = tandem_advantages(x)
    loss_fn = tandem_loss_fn(compile)
    log_probs = x["log_probs"].clone().requires_grad_()
    loss, _ = loss_fn(LogProbOutput(log_probs=log_probs), batch, loss_scale_from_masks([x["mask"]]))
    loss.backward()
    return float(loss.detach()), log_probs.grad


# -- verl -----------------------------------------------------------------------------------------


class Verl:
    """verl's functions, composed as its actor loss (``workers/utils/losses.py:ppo_loss``) composes them."""

    def __init__(self) -> None:
        import verl
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config.actor import ActorConfig

        self.version = verl.__version__
        self.ca, self.rc = core_algos, rollout_corr_helper
        self.config = ActorConfig(
            strategy="fsdp", rollout_n=8, ppo_micro_batch_size_per_gpu=1,
            clip_ratio=CLIP_LOW, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=DUAL_CLIP_C,
            loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=KL_COEF,
        )  # fmt: skip
        self.policy_loss = core_algos.get_policy_loss_fn("vanilla")  # compute_policy_loss_vanilla
        self.compiled = {
            tis: torch.compile(functools.partial(self.loss, tis=tis), dynamic=True)
            for tis in ("verl", "inline")
        }
        # verl's metrics call .item() (and branch on tensors): dynamo splits the span at each of them.
        # They are counted and reported instead of logged one warning each.
        logging.getLogger("torch._dynamo").setLevel(logging.ERROR)

    def advantages(self, x: dict[str, Any], vectorized: bool = False) -> torch.Tensor:
        fn = (
            self.ca.compute_grpo_vectorized_outcome_advantage if vectorized
            else self.ca.compute_grpo_outcome_advantage
        )  # fmt: skip
        adv, _ = fn(
            x["token_level_rewards"], x["mask"], x["uid"], epsilon=STD_EPS, norm_adv_by_std_in_grpo=True
        )
        return adv

    def tis_weights(self, old, rollout, mask) -> torch.Tensor:
        weights, _ = self.rc.compute_rollout_correction_weights(
            log_ratio=old - rollout, response_mask=mask, rollout_is="token", rollout_is_threshold=TIS_CAP
        )
        return weights

    @staticmethod
    def tis_weights_inline(old, rollout, mask) -> torch.Tensor:
        """verl's token-TIS formula (rollout_corr_helper, SAFETY_BOUND 20) without its metrics."""
        return (torch.exp(torch.clamp(old - rollout, -20.0, 20.0)) * mask).clamp(max=TIS_CAP).detach()

    def loss(self, log_prob, old, adv, mask, ref, rollout, tis: str = "verl") -> torch.Tensor:
        if tis == "verl":
            weights = self.tis_weights(old, rollout, mask)
        else:
            weights = self.tis_weights_inline(old, rollout, mask)
        response_mask = mask.to(bool)  # as ppo_loss does
        pg_loss, _ = self.policy_loss(
            old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=response_mask,
            loss_agg_mode="token-mean", config=self.config, rollout_is_weights=weights,
        )  # fmt: skip
        kld = self.ca.kl_penalty(logprob=log_prob, ref_logprob=ref, kl_penalty=self.config.kl_loss_type)
        kl_loss = self.ca.agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode="token-mean")
        return pg_loss + kl_loss * self.config.kl_loss_coef

    def step(self, x: dict[str, Any], compile: bool, tis: str = "verl") -> tuple[float, torch.Tensor]:
        """``tis="inline"``: verl's TIS formula written out, skipping compute_is_metrics (a reference)."""
        adv = self.advantages(x)
        log_prob = x["log_probs"].clone().requires_grad_()
        fn = self.compiled[tis] if compile else functools.partial(self.loss, tis=tis)
        loss = fn(log_prob, x["old"], adv, x["mask"], x["ref"], x["rollout"])
        loss.backward()
        return float(loss.detach()), log_prob.grad


def load_verl() -> Verl:
    try:
        return Verl()
    except ImportError as e:
        print(
            f"verl is not importable ({e}). Install it without touching torch:\n  {INSTALL}", file=sys.stderr
        )
        raise SystemExit(2) from None


# -- checks and timing ----------------------------------------------------------------------------


def check_same(label: str, a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> dict[str, float]:
    """Same loss (rel 1e-5) and gradient (max |diff| <= 1e-4 x max |grad|) or an AssertionError."""
    (la, ga), (lb, gb) = a, b
    loss_rel = abs(la - lb) / max(abs(lb), 1e-12)
    grad_rel = float((ga - gb).abs().max() / gb.abs().max().clamp(min=1e-30))
    assert loss_rel <= 1e-5, f"{label}: loss tandem {la!r} != verl {lb!r} (rel {loss_rel:.2e})"
    assert grad_rel <= 1e-4, f"{label}: gradients differ, max |diff| / max |grad| = {grad_rel:.2e}"
    print(
        f"check {label}: loss tandem {la:.7f} == verl {lb:.7f} (rel {loss_rel:.1e}); grad rel {grad_rel:.1e}"
    )
    return {"loss_rel_diff": loss_rel, "grad_rel_diff": grad_rel}


def time_alternating(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each repeat runs every side once; the order flips each repeat (load drift hits both sides)."""
    names, times = list(sides), {name: [] for name in sides}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def summary(ts: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(ts) * 1e3, 1),
        "min_ms": round(min(ts) * 1e3, 1),
        "max_ms": round(max(ts) * 1e3, 1),
    }


def count_graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="alternating repeats per side (>= 3 for a spread)")
    ap.add_argument("--no-compile", action="store_true", help="time eager only (no compiled pair)")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    args = ap.parse_args()
    verl = load_verl()
    torch.manual_seed(0)
    x = make_inputs(args.samples, args.tokens, args.group_size)
    tokens = int(x["mask"].sum())
    load_start = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; verl {verl.version}; {args.samples} "
        f"samples x {args.tokens} tokens, groups of {args.group_size}, {tokens:,} loss tokens; "
        f"load {load_start:.2f}"
    )

    # correctness first, on the full batch; these calls also compile and warm every timed side
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    sides: dict[str, Callable[[], tuple[float, torch.Tensor]]] = {}
    for mode in modes:
        c = mode == "compiled"
        sides[f"tandem_{mode}"] = lambda c=c: tandem_step(x, compile=c)
        sides[f"verl_{mode}"] = lambda c=c: verl.step(x, compile=c)
        sides[f"verl_inline_tis_{mode}"] = lambda c=c: verl.step(x, compile=c, tis="inline")
    checks: dict[str, dict[str, float]] = {}
    graph_breaks: dict[str, int] = {}
    for mode in modes:
        outs = {}
        for side in ("tandem", "verl", "verl_inline_tis"):
            before, t0 = count_graph_breaks(), time.perf_counter()
            outs[side] = sides[f"{side}_{mode}"]()
            first = time.perf_counter() - t0
            if mode == "compiled":
                graph_breaks[side] = count_graph_breaks() - before
            print(f"  {side} {mode}: first call {first:.1f} s")
        checks[mode] = check_same(f"{mode}, verl", outs["tandem"], outs["verl"])
        checks[f"{mode}_inline_tis"] = check_same(
            f"{mode}, verl inline TIS", outs["tandem"], outs["verl_inline_tis"]
        )
        del outs
    if graph_breaks:
        print("  torch.compile graph breaks: " + ", ".join(f"{k} {v}" for k, v in graph_breaks.items()))
    # the vectorized verl estimator (not verl's default ``grpo``) must agree too; checked on the advantages
    adv_t = tandem_advantages(x).advantages
    for vectorized in (False, True):
        assert torch.allclose(adv_t, verl.advantages(x, vectorized), rtol=1e-5, atol=1e-6), vectorized
    del adv_t

    times = time_alternating(sides, args.repeats)
    stats = {name: summary(ts) for name, ts in times.items()}

    stage_stats: dict[str, dict[str, float]] = {}
    if not args.no_stages:
        mask, old, rollout = x["mask"], x["old"], x["rollout"]
        stages: dict[str, Callable[[], object]] = {
            "adv_tandem": lambda: tandem_advantages(x),
            "adv_verl_grpo": lambda: verl.advantages(x),
            "adv_verl_grpo_vectorized": lambda: verl.advantages(x, vectorized=True),
            "tis_verl": lambda: verl.tis_weights(old, rollout, mask),
            "tis_verl_inline": lambda: verl.tis_weights_inline(old, rollout, mask),
        }
        stage_stats = {n: summary(ts) for n, ts in time_alternating(stages, args.repeats).items()}

    print(
        f"GRPO advantages + PPO-clip/dual-clip x token TIS + k3 KL + token-mean + backward, median of {args.repeats}"
    )
    labels = {
        "tandem": "tandem",
        "verl": "verl core_algos + rollout_corr_helper",
        "verl_inline_tis": "verl, TIS inline (no compute_is_metrics)",
    }
    speedups: dict[str, float] = {}
    for mode in modes:
        print(
            f" {mode}"
            + (" (tandem: compile=True; verl: its loss span torch.compile'd)" if mode == "compiled" else "")
        )
        for side, label in labels.items():
            s = stats[f"{side}_{mode}"]
            print(f"  {label:<42} {s['median_ms']:8.0f} ms  (min {s['min_ms']:.0f}, max {s['max_ms']:.0f})")
        speedups[mode] = stats[f"verl_{mode}"]["median_ms"] / stats[f"tandem_{mode}"]["median_ms"]
        speedups[f"{mode}_inline_tis"] = (
            stats[f"verl_inline_tis_{mode}"]["median_ms"] / stats[f"tandem_{mode}"]["median_ms"]
        )
    for name, s in stage_stats.items():
        print(f"  stage {name:<36} {s['median_ms']:8.1f} ms  (min {s['min_ms']:.1f}, max {s['max_ms']:.1f})")
    print("speedup vs verl: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedups.items()))

    result: dict[str, Any] = {
        "speedup_vs_verl_eager": round(speedups["eager"], 2),
        "speedup_vs_verl_compiled": round(speedups["compiled"], 2) if "compiled" in speedups else None,
        "speedup_vs_verl_inline_tis_eager": round(speedups["eager_inline_tis"], 2),
        "speedup_vs_verl_inline_tis_compiled": (
            round(speedups["compiled_inline_tis"], 2) if "compiled" in speedups else None
        ),
    }
    for name, s in stats.items():
        result[f"{name}_ms"] = s["median_ms"]
        result[f"{name}_min_max_ms"] = [s["min_ms"], s["max_ms"]]
    for name, s in stage_stats.items():
        result[f"stage_{name}_ms"] = s["median_ms"]
    result |= {
        "check": {k: {kk: float(f"{vv:.2g}") for kk, vv in v.items()} for k, v in checks.items()},
        "graph_breaks": graph_breaks or None,
        "verl": verl.version,
        "torch": torch.__version__,
        "samples": args.samples,
        "tokens": args.tokens,
        "loss_tokens": tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "load_avg_start": round(load_start, 2),
        "load_avg_end": round(os.getloadavg()[0], 2),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
