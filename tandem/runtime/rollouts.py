"""Rollouts of a run: the generate function, then recomputed log-probs, rewards and filters.

One path for every loop mode. `Rollouts.step` produces a step's samples for ``sync`` and
``one_step_off`` (all of the step's groups at once, over up to ``rollout.max_rounds`` rounds until
``prompts_per_step`` groups survive the filters); `Rollouts.group` produces one group for the
fully-async producer. Both go through the run's generate function (`tandem.rollout.functions`), so
``rollout.generate``, ``recompute_log_probs``, routed experts (for routing replay) and the agent
settings mean the same thing in every mode; ``max_rounds`` bounds the groups a fully-async step
consumes the same way (``max_rounds x prompts_per_step``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from tandem.core.filters import filter_samples
from tandem.core.protocols import InferenceEngine, ScoringEngine
from tandem.core.sample import Sample, SampleStatus
from tandem.rewards.hub import RewardHub
from tandem.rollout.agent import agent_metrics
from tandem.rollout.data import DataSource, PromptRecord
from tandem.rollout.functions import GenerateFunction, RolloutContext
from tandem.runtime.config import RunConfig
from tandem.runtime.metrics import rollout_metrics

__all__ = ["Rollouts", "add_metrics", "episode_metrics"]

_NOT_SCORED = (SampleStatus.FAILED, SampleStatus.ABORTED)


def add_metrics(into: dict[str, float], extra: dict[str, float]) -> None:
    """Sum ``extra`` into ``into`` key by key (counts and seconds over rounds or groups)."""
    for k, v in extra.items():
        into[k] = into.get(k, 0.0) + v


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Agent episode counts (turns, tool calls, failure reasons) of the multi-turn samples among ``samples``."""
    return agent_metrics([s for s in samples if "num_turns" in s.metadata])


class Rollouts:
    """Scored, filtered samples from the run's generate function (module docstring)."""

    def __init__(self, cfg: RunConfig, *, generate: GenerateFunction, engine: InferenceEngine, tokenizer,
                 rewards: RewardHub, data: DataSource, routed_experts: bool) -> None:
        self.cfg, self.generate, self.engine = cfg, generate, engine
        self.tokenizer, self.rewards, self.data = tokenizer, rewards, data
        self.routed_experts = routed_experts

    def context(self, stopping: Callable[[], bool] = lambda: False) -> RolloutContext:
        """A fresh context for one event loop (a step's loop, or the fully-async producer's)."""
        rc = self.cfg.rollout
        return RolloutContext(engine=self.engine, tokenizer=self.tokenizer, n=rc.n_samples_per_prompt,
                              sampling=rc.sampling, routed_experts=self.routed_experts, config=rc,
                              seed=self.cfg.run.seed, stopping=stopping)

    # -- sync / one-step-off: a whole step -------------------------------------------------------------

    def step(self, step: int, phase: Callable[[str], None] = lambda _p: None) -> tuple[list[Sample], list[Sample],
                                                                                        dict[str, float]]:
        """``(kept, everything generated, metrics)`` for ``step``: rounds of generation until
        ``prompts_per_step`` groups survive the filters, or ``max_rounds``."""
        rc = self.cfg.rollout
        kept: list[Sample] = []
        everything: list[Sample] = []
        metrics: dict[str, float] = {}
        gen_s = reward_s = 0.0
        rounds = 0
        for round_ in range(rc.max_rounds):
            need = rc.prompts_per_step - len({s.group_index for s in kept})
            if need <= 0:
                break
            rounds += 1
            records = self.data.next_prompts(need)
            phase("generate")
            t0 = time.perf_counter()
            samples = self.generate.run_step(self.context(), records, step=step,
                                             seed=self.cfg.run.seed + 7919 * round_, first_group=len(everything))
            gen_s += time.perf_counter() - t0
            self.recompute_log_probs(samples, metrics)
            phase("reward")
            t0 = time.perf_counter()
            self.score(samples)
            reward_s += time.perf_counter() - t0
            everything += samples
            ok, _dropped, fm = filter_samples(samples, self.cfg.algorithm.filters)
            kept += ok
            add_metrics(metrics, fm)
        metrics |= rollout_metrics(everything, seconds=gen_s) | episode_metrics(everything)
        metrics |= {"time/reward_s": reward_s, "rollout/rounds": float(rounds),
                    "rollout/groups_kept": float(len({s.group_index for s in kept}))}
        return kept, everything, self.finish_metrics(metrics)

    # -- fully async: one group ------------------------------------------------------------------------

    async def group(self, ctx: RolloutContext, record: PromptRecord, *, group_index: int, seed: int
                    ) -> tuple[list[Sample], dict[str, float]]:
        """One group from the generate function, its log-probs recomputed if asked, scored (rewards run in
        a worker thread, off the producer's loop)."""
        samples = await self.generate.run_group(ctx, record, group_index=group_index, seed=seed)
        metrics: dict[str, float] = {}
        self.recompute_log_probs(samples, metrics)
        await asyncio.get_running_loop().run_in_executor(None, self.score, samples)
        return samples, metrics

    # -- shared ------------------------------------------------------------------------------------------

    def score(self, samples: Sequence[Sample]) -> None:
        scorable = [s for s in samples if s.status not in _NOT_SCORED]
        if scorable:
            self.rewards.score(scorable)

    def recompute_log_probs(self, samples: Sequence[Sample], metrics: dict[str, float]) -> None:
        """With ``rollout.recompute_log_probs``: replace decode-time rollout log-probs by a prefill pass of
        the engine (`ScoringEngine.score`; the run was refused at start-up if the engine cannot score)."""
        if not self.cfg.rollout.recompute_log_probs:
            return
        live = [s for s in samples if s.response_length > 0 and s.rollout_log_probs is not None]
        if not live:
            return
        t0 = time.perf_counter()
        scorer: ScoringEngine = self.engine
        scored = scorer.score([(s.tokens, s.prompt_length) for s in live],
                              temperature=self.cfg.rollout.sampling.temperature or 1.0)
        diff = 0.0
        n = 0
        for s, lp in zip(live, scored, strict=True):
            diff += sum(abs(a - b) for a, b in zip(lp, s.rollout_log_probs, strict=True))
            n += len(lp)
            s.rollout_log_probs = lp
        add_metrics(metrics, {"rollout/recompute_abs_diff_sum": diff, "rollout/recompute_tokens": float(n),
                              "time/recompute_logprob_s": time.perf_counter() - t0})

    @staticmethod
    def finish_metrics(metrics: dict[str, Any]) -> dict[str, float]:
        """Turn summed recompute counters into the mean absolute difference."""
        n = metrics.pop("rollout/recompute_tokens", None)
        total = metrics.pop("rollout/recompute_abs_diff_sum", None)
        if n is not None:
            metrics["rollout/recompute_abs_diff_mean"] = (total or 0.0) / max(n, 1.0)
        return metrics
