"""One rollout path: every rollout setting means the same thing in sync, one-step-off and fully async."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
ASYNC = ["runtime.mode=fully_async", "algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]


def _spy_on_training(run: Run) -> list:
    """The batches the trainer is given (the real engine still trains on them)."""
    batches = []
    train_step = run.trainer.train_step

    def spy(batch, loss_fn, **kw):
        if kw.get("model", "policy") == "policy":
            batches.append(batch)
        return train_step(batch, loss_fn, **kw)

    run.trainer.train_step = spy
    return batches


def test_fully_async_trains_agentic_multi_turn_samples_with_routed_experts(tmp_path):
    cfg = load_config(RunConfig, RECIPE, [
        *ASYNC, "model.name=tiny-qwen3-moe", "trainer.fsdp.routing_replay=true", "run.steps=2",
        "rollout.generate=agentic_tool_call", "rollout.agent.function=tests.runtime.agents:two_turn_agent",
        "rollout.agent.timeout_s=60", "reward.terms=[{name: 'tandem.rollout.agent:agent_reward'}]",
        "rollout.dump=true", "rollout.n_samples_per_prompt=2",
    ])
    run = Run(cfg, tmp_path)
    assert run.rollouts.routed_experts  # the trainer replays routes: every turn asks for them
    batches = _spy_on_training(run)
    run.train()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert len(batches) == 2
    for batch in batches:
        assert batch.routed_experts is not None and batch.routed_experts.shape[0] == batch.batch_size
        multi = 0
        for row, length in zip(batch.loss_mask, batch.response_lengths.tolist(), strict=True):
            mask = row[:length].tolist()
            # the user's turn sits inside the response with loss mask 0, between two model turns
            if 0 in mask and mask[0] == 1 and mask[-1] == 1:
                multi += 1
        assert multi == batch.batch_size, "a trained sample is not a two-turn trajectory"
    rows = read_metrics(tmp_path)
    assert all(r["agent/turns_mean"] == 2 for r in rows)
    for step in (0, 1):
        dumped = [json.loads(line) for line in (tmp_path / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert dumped and all(0 in d["loss_mask"] and d["metadata"]["num_turns"] == 2 for d in dumped)


def test_fully_async_recomputes_log_probs_when_asked(tmp_path):
    run = Run(load_config(RunConfig, RECIPE, [*ASYNC, "rollout.recompute_log_probs=true", "run.steps=2"]), tmp_path)
    run.train()
    rows = read_metrics(tmp_path)
    # the engine's prefill pass replaced the decode-time log-probs (fp32: tiny but measured differences)
    assert all(0 <= r["rollout/recompute_abs_diff_mean"] < 1e-3 and r["time/recompute_logprob_s"] > 0 for r in rows)


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_max_rounds_bounds_a_step_when_no_group_survives(tmp_path, mode):
    """A constant reward leaves no group with signal: each step takes max_rounds x prompts_per_step groups,
    trains on none and ends (fully async used to wait forever for a surviving group)."""
    extra = ASYNC if mode == "fully_async" else []
    cfg = load_config(RunConfig, RECIPE, [
        *extra, "run.steps=2", "rollout.max_rounds=2", "algorithm.filters.drop_zero_std_groups=true",
        "reward.terms=[{name: 'tests.runtime.rewards:constant'}]",
    ])
    Run(cfg, tmp_path).train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollout/samples"] == 2 * 2 * 4  # two rounds of 2 prompts x 4 samples
        assert r["rollout/groups_kept"] == 0 and r["train/no_samples"] == 1


def test_settings_a_mode_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="rollout.load_dump .* works with runtime.mode: sync"):
        load_config(RunConfig, RECIPE, [*ASYNC, "rollout.load_dump=/tmp"])
    with pytest.raises(ConfigError, match="rollout.generate: .*an async generate function must accept"):
        Run(load_config(RunConfig, RECIPE, ["rollout.generate=tests.runtime.test_rollout_modes:bad_generate"]),
            "/nonexistent/never-made")


async def bad_generate(ctx, record):  # no group_index / seed: refused at start-up
    return []
