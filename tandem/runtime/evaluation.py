"""Evaluation on held-out sets: during training (``eval:``), and of any model or checkpoint (``tandem eval``).

An eval set is a data source (any the loop reads: synthetic tasks, JSONL, Parquet, HF datasets), its
reward terms (the run's by default), ``n`` samples per prompt and its own sampling settings (greedy by
default). The same prompts and the same seeds are used every time, so two evaluations differ only by
the weights. Samples come from the run's generate function and inference engine, at the engine's
current weight version. Metrics per set, logged as ``eval/<set>/<metric>``:

* ``reward_mean``: mean reward over all samples;
* ``pass@1``: mean fraction of a prompt's samples that pass (reward > 0, as ``rollout/pass_rate``);
* ``pass@k`` for each ``k`` in ``ks`` (``k <= n``): the unbiased estimator of Chen et al. 2021 (HumanEval),
  ``1 - C(n - c, k) / C(n, k)`` per prompt with ``c`` passing samples, averaged over prompts;
* ``maj@k`` where an answer is extractable (``answer``): the answer most of a prompt's first ``k``
  samples give (ties: the first seen) counts as correct if a sample giving it passes;
* ``length_mean`` (response tokens), ``truncated_frac``, ``prompts``, ``samples``.

During training the loop evaluates before the first step, every ``every`` steps and after the last
(docs/runtime.md, "Evaluation"); ``tandem eval`` evaluates a target once and writes JSON.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.core.sample import Sample, SampleStatus
from tandem.rewards.hub import RewardConfig, RewardHub
from tandem.rollout.data import DataConfig, DataSource, PromptRecord
from tandem.rollout.functions import GenerateFunction, RolloutContext
from tandem.rollout.generate import SamplingConfig

__all__ = ["EvalConfig", "EvalSetConfig", "Evaluator", "eval_metrics", "pass_at_k"]

ANSWERS = ("none", "last_number", "first_number")


def _greedy() -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_new_tokens=64)


@dataclass(kw_only=True, slots=True)
class EvalSetConfig:
    """One held-out set (module docstring)."""

    name: str
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig | None = None  # None: the run's reward terms
    n: int = 1  # samples per prompt
    ks: list[int] = field(default_factory=lambda: [1])  # pass@k / maj@k for these k (each <= n)
    sampling: SamplingConfig = field(default_factory=_greedy)
    max_prompts: int = 64  # the set's first prompts, in its order (no shuffle: the same each time)
    answer: Literal["none", "last_number", "first_number"] = "none"  # for maj@k
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"name={self.name!r} must be letters, digits, '-' or '_' (it is a metric key)")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.max_prompts < 1:
            raise ValueError(f"max_prompts={self.max_prompts} must be >= 1")
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad or not self.ks:
            raise ValueError(f"ks={self.ks}: each k must be in [1, n={self.n}]")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """The recipe's ``eval:`` section: the sets, and when the loop evaluates them."""

    sets: list[EvalSetConfig] = field(default_factory=list)
    every: int = 0  # also every this many steps (0: only before and after)
    before: bool = True  # before the first step
    after: bool = True  # after the last step

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every={self.every} must be >= 0")
        names = [s.name for s in self.sets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"eval set name {dupes[0]!r} is used twice")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` pass (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _answer(sample: Sample, how: str) -> str | None:
    if how == "none":
        return None
    from tandem.rewards.builtin import first_number, last_number

    value = (last_number if how == "last_number" else first_number)(sample.response)
    return None if value is None else f"{value:g}"


def _passes(sample: Sample) -> bool:
    return sample.reward is not None and sample.scalar_reward() > 0


def eval_metrics(samples: Sequence[Sample], *, ks: Sequence[int], answer: str = "none") -> dict[str, float]:
    """The set's metrics from its scored samples, grouped by ``group_index`` (one group per prompt)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    if not groups:
        return {"prompts": 0.0, "samples": 0.0}
    rewards = [s.scalar_reward() for s in samples if s.reward is not None]
    out = {
        "prompts": float(len(groups)),
        "samples": float(len(samples)),
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "pass@1": sum(sum(map(_passes, g)) / len(g) for g in groups.values()) / len(groups),
        "length_mean": sum(s.response_length for s in samples) / len(samples),
        "truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
    }
    for k in ks:
        if k > 1:
            out[f"pass@{k}"] = sum(pass_at_k(len(g), sum(map(_passes, g)), k) for g in groups.values()) / len(groups)
        if answer != "none":
            out[f"maj@{k}"] = sum(_majority_correct(g[:k], answer) for g in groups.values()) / len(groups)
    return out


def _majority_correct(group: Sequence[Sample], answer: str) -> bool:
    answers = [(_answer(s, answer), s) for s in group]
    counts = Counter(a for a, _ in answers if a is not None)
    if not counts:
        return False
    best = max(counts.values())
    top = next(a for a, _ in answers if a is not None and counts[a] == best)  # ties: the first seen
    return any(_passes(s) for a, s in answers if a == top)


class _EvalSet:
    def __init__(self, cfg: EvalSetConfig, tokenizer: Any, run_reward: RewardConfig) -> None:
        self.cfg = cfg
        data = DataSource(cfg.data, tokenizer)
        self.records: list[PromptRecord] = data.records[: cfg.max_prompts]
        self.rewards = RewardHub(cfg.reward or run_reward)


class Evaluator:
    """Evaluates every set of an `EvalConfig` through a generate function and an inference engine."""

    def __init__(self, cfg: EvalConfig, *, engine: Any, tokenizer: Any, generate: GenerateFunction,
                 run_reward: RewardConfig, rollout_config: Any = None, routed_experts: bool = False) -> None:
        self.cfg, self.engine, self.tokenizer, self.generate = cfg, engine, tokenizer, generate
        self.rollout_config, self.routed_experts = rollout_config, routed_experts
        self.sets = [_EvalSet(s, tokenizer, run_reward) for s in cfg.sets]

    def due(self, step: int, *, first: int, last: int) -> bool:
        """Whether the loop evaluates at the start of ``step`` (``last``: the run's final step count)."""
        if not self.sets:
            return False
        return ((self.cfg.before and step == first == 0) or (self.cfg.after and step == last)
                or (self.cfg.every > 0 and step % self.cfg.every == 0 and 0 < step < last))

    def run(self) -> dict[str, float]:
        """``eval/<set>/<metric>`` of every set, at the engine's current weights."""
        import time

        out: dict[str, float] = {}
        t0 = time.perf_counter()
        for s in self.sets:
            ctx = RolloutContext(engine=self.engine, tokenizer=self.tokenizer, n=s.cfg.n, sampling=s.cfg.sampling,
                                 routed_experts=self.routed_experts, config=self.rollout_config, seed=s.cfg.seed)
            samples = self.generate.run_step(ctx, s.records, step=0, seed=s.cfg.seed, first_group=0)
            scorable = [x for x in samples if x.status not in (SampleStatus.FAILED, SampleStatus.ABORTED)]
            if scorable:
                s.rewards.score(scorable)
            metrics = eval_metrics(samples, ks=s.cfg.ks, answer=s.cfg.answer)
            out |= {f"eval/{s.cfg.name}/{k}": v for k, v in metrics.items()}
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        for s in self.sets:
            s.rewards.close()
