"""Per-step metrics: rollout statistics computed from samples, and the process's own resources
(plain floats, ready to log)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np

from tandem.core.sample import Sample, SampleStatus

__all__ = ["process_metrics", "rollout_metrics", "speculation_metrics", "staleness_metrics"]


def process_metrics() -> dict[str, float]:
    """``sys/rss_mib`` (resident memory), ``sys/open_fds``, ``sys/threads`` (Python threads) of this
    process, logged every step so that a leak shows as a trend (Linux /proc; elsewhere only threads)."""
    out = {"sys/threads": float(threading.active_count())}
    try:
        with open("/proc/self/statm") as f:
            out["sys/rss_mib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        out["sys/open_fds"] = float(len(os.listdir("/proc/self/fd")))
    except (OSError, ValueError, IndexError):
        pass
    return out


def rollout_metrics(samples: Sequence[Sample], *, seconds: float) -> dict[str, float]:
    """Reward distribution, pass rate (reward > 0), response lengths, finish statuses, tokens/s."""
    n = len(samples)
    if n == 0:
        return {"rollout/samples": 0.0}
    lengths = np.array([s.response_length for s in samples], dtype=np.float64)
    statuses = [s.status for s in samples]
    rewards = np.array([s.scalar_reward() for s in samples if s.reward is not None], dtype=np.float64)
    out = {
        "rollout/samples": float(n),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": statuses.count(SampleStatus.TRUNCATED) / n,
        "rollout/aborted": float(statuses.count(SampleStatus.ABORTED)),
        "rollout/failed": float(statuses.count(SampleStatus.FAILED)),
        "rollout/tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
        "time/generate_s": seconds,
    }
    if rewards.size:
        q10, q50, q90 = np.quantile(rewards, [0.1, 0.5, 0.9])
        out |= {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/min": float(rewards.min()),
            "reward/max": float(rewards.max()),
            "reward/p10": float(q10),
            "reward/p50": float(q50),
            "reward/p90": float(q90),
            "rollout/pass_rate": float((rewards > 0).mean()),
        }
    groups: dict[int, list[float]] = {}
    for s in samples:
        if s.reward is not None and s.group_index >= 0:
            groups.setdefault(s.group_index, []).append(s.scalar_reward())
    if groups:  # every scored group (the trained batch's, after filters: ``adv/num_groups``, ``adv/zero_std_group_frac``)
        out["reward/num_groups"] = float(len(groups))
        out["reward/zero_std_group_frac"] = float(np.mean([max(g) == min(g) for g in groups.values()]))
    return out


def staleness_metrics(samples: Sequence[Sample], version: int) -> dict[str, float]:
    """How many weight versions behind ``version`` the oldest token of each sample is."""
    lags = [version - min(s.weight_versions) for s in samples if s.weight_versions]
    if not lags:
        return {}
    return {"async/staleness_mean": float(np.mean(lags)), "async/staleness_max": float(max(lags))}


def speculation_metrics(health: dict, last: dict[str, float] | None) -> tuple[dict[str, float], dict[str, float]]:
    """``(metrics, counters)``: a speculative engine's acceptance rate, mean accepted draft tokens and tokens per
    target pass since ``last`` (the counters this returned the step before; None at the first step), from its
    ``health()`` counters; and the draft head's training figures where it reports them."""
    now = {k: float(health.get(f"spec_{k}") or 0) for k in ("passes", "drafted", "accepted", "emitted")}
    last = last or dict.fromkeys(now, 0.0)
    d = {k: now[k] - last[k] for k in now}
    out = {"rollout/spec_passes": d["passes"],
           "rollout/spec_acceptance_rate": d["accepted"] / d["drafted"] if d["drafted"] else 0.0,
           "rollout/spec_mean_accepted": d["accepted"] / d["passes"] if d["passes"] else 0.0,
           "rollout/spec_tokens_per_pass": d["emitted"] / d["passes"] if d["passes"] else 0.0}
    for key in ("spec_head_loss", "spec_head_token_accuracy", "spec_head_expected_acceptance"):  # draft_head
        if isinstance(health.get(key), int | float):
            out[f"rollout/{key}"] = float(health[key])
    return out, now
