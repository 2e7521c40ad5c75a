"""Issue 23, hangs and silent no-ops: the progress watchdog, the skipped-step limit, resuming a finished run."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics
from tandem.runtime.watchdog import SkipCounter, SkippedStepsError, Stalled

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
EVEN = ["reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"]
OFF_POLICY = ["algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]
HANG = "rollout.generate=tests.runtime.test_reliability_runtime_progress:hanging_generate"


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [*EVEN, *overrides])


async def hanging_generate(ctx, record, *, group_index: int, seed: int):
    """A generate function that never returns (a stuck tool call, a dead remote judge...)."""
    await asyncio.sleep(3600)


def always_fails(sample) -> float:
    raise RuntimeError("the judge is unreachable")


@pytest.mark.parametrize(("mode", "stuck"), [
    ("sync", "phase 'generate'"),
    ("one_step_off", "phase 'wait for rollouts' (helper threads: tandem-rollout: step 0, phase 'generate')"),
    ("fully_async", "phase 'wait for rollouts'"),
])
def test_the_watchdog_fails_a_run_whose_rollouts_hang(tmp_path, mode, stuck):
    extra = [] if mode == "sync" else OFF_POLICY
    run = Run(_cfg(HANG, f"runtime.mode={mode}", "runtime.watchdog_s=2", *extra), tmp_path)
    start = time.monotonic()
    with pytest.raises(Stalled, match=r"no training step completed for \ds \(runtime.watchdog_s=2\): stuck in "
                                      rf"step 0, {_escape(stuck)}"):
        run.train()
    assert time.monotonic() - start < 30  # the watchdog's 2 s, then a clean stop
    assert getattr(run, "_closed", False)  # the run released its engine, trainer and trackers
    assert not [t for t in threading.enumerate() if t.name == "tandem-watchdog"]


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_the_watchdog_is_off_at_zero_and_quiet_on_a_healthy_run(tmp_path):
    Run(_cfg("run.steps=2", "runtime.watchdog_s=0"), tmp_path / "off").train()
    Run(_cfg("run.steps=2", "runtime.watchdog_s=60"), tmp_path / "on").train()
    assert len(read_metrics(tmp_path / "off")) == len(read_metrics(tmp_path / "on")) == 2


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_reward_that_always_fails_stops_the_run_with_its_error(tmp_path, mode):
    extra = [] if mode == "sync" else OFF_POLICY
    run = Run(_cfg("reward.terms=[{name: 'tests.runtime.test_reliability_runtime_progress:always_fails'}]",
                   "run.steps=10", "runtime.max_skipped_steps=3", f"runtime.mode={mode}", *extra), tmp_path)
    with pytest.raises(SkippedStepsError, match=r"3 consecutive steps were skipped \(steps 0..2, "
                                                r"runtime.max_skipped_steps=3\): no sample survived the filters "
                                                r"\(dropped: failed 8\); errors: reward 'tests.runtime"
                                                r".*always_fails' raised RuntimeError: the judge is unreachable "
                                                r"\(8 samples\)"):
        run.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]  # logged, then stopped: not 10 silent no-op steps
    assert all(r["reward/errors"] == 8 and r["train/no_samples"] == 1 for r in rows)
    (message, count), = run.rewards.error_counts.items()  # every error counted under its message
    assert message.endswith("RuntimeError: the judge is unreachable")
    assert count == 3 * 8 if mode == "sync" else count >= 3 * 8  # fully async scores groups ahead
    assert not (tmp_path / "checkpoints").exists()


def test_steps_without_learning_signal_are_not_failures(tmp_path):
    """Every group all-correct (a converged run) is a zero-std skip: it does not count."""
    cfg = _cfg("reward.terms=[{name: 'tests.runtime.rewards:constant'}]", "algorithm.filters.drop_zero_std_groups=true",
               "run.steps=3", "runtime.max_skipped_steps=1")
    Run(cfg, tmp_path).train()
    assert [r["train/no_samples"] for r in read_metrics(tmp_path)] == [1, 1, 1]


def test_the_skip_counter_counts_refused_updates_and_resets_on_a_good_step():
    counter = SkipCounter(2)
    nan = {"train/skipped_step": 1.0, "train/loss": math.nan, "train/grad_norm": math.inf}
    counter.update(0, nan)
    counter.update(1, {"train/skipped_step": 0.0})  # a good step ends the streak
    counter.update(2, nan)
    with pytest.raises(SkippedStepsError, match=r"steps 2..3.*the trainer refused the update: loss=nan, "
                                                r"grad_norm=inf \(NaN/Inf\)"):
        counter.update(3, nan)
    SkipCounter(0).update(0, nan)  # 0: no limit


def test_resuming_a_run_that_reached_run_steps_is_an_error(tmp_path, capsys):
    Run(_cfg("run.steps=2"), tmp_path).train()
    for steps in (2, 1):
        with pytest.raises(ConfigError, match=rf"--resume: checkpoint .*step_2 is at step 2 and run.steps={steps}: "
                                              r"nothing left to train; set run.steps above 2"):
            Run(_cfg(f"run.steps={steps}"), tmp_path, resume=True)
    from tandem.cli import main

    code = main(["train", str(RECIPE), *EVEN, "run.steps=2", "--resume", str(tmp_path), "--quiet"])
    assert code == 2 and "is at step 2 and run.steps=2" in capsys.readouterr().err
    resumed = Run(_cfg("run.steps=3"), tmp_path, resume=True)  # above it: continues
    resumed.train()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
