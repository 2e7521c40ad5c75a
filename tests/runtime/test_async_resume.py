"""Asynchronous modes resume without losing what was in flight (issue 23).

One-step-off: a checkpoint holds the rollout batch generated while its step trained, so a run resumed
from it is bit-identical to the uninterrupted run. Fully async: a checkpoint holds the queued groups and
requeues the prompts still generating; across a resume every prompt is drawn exactly once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem.config import load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.pending import decode_samples, encode_samples, sample_from_dict, sample_to_dict
from tandem.runtime.tracking import read_metrics

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
EVEN = ["reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"]
DROP = ("time", "rollout/tokens_per_s", "train/tokens_per_s", "train/step_time_s", "sync/seconds", "sync/gbps", "sys/")


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [*EVEN, *overrides])


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(DROP)}


def _weights(run: Run) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in run.trainer.named_parameters_for_sync(1 << 30) for n, t in b}


def _crash_after(full: Path, part: Path, step: int) -> None:
    """``part``: ``full`` as it stood had the process died after the checkpoint of ``step``."""
    shutil.copytree(full, part)
    for ckpt in (part / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > step:
            shutil.rmtree(ckpt)
    (part / "checkpoints" / "LATEST").write_text(f"step_{step}")


def test_samples_round_trip_exactly_through_json():
    import numpy as np

    from tandem.core.sample import Sample, SampleStatus

    s = Sample(prompt=[{"role": "user", "content": "hi"}], response="4", tokens=[5, 6, 7, 8], response_length=2,
               loss_mask=[1, 0], rollout_log_probs=[-0.1234567890123, -1e-30], reward={"score": 0.5, "a": 1.0},
               label=4, status=SampleStatus.TRUNCATED, weight_versions=[3, 4], group_index=2, index=5,
               rollout_routed_experts=np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2),
               metadata={"prompt_index": np.int64(9), "turns": [1, 2]})
    back = sample_from_dict(json.loads(json.dumps(sample_to_dict(s))))
    assert back.rollout_log_probs == s.rollout_log_probs and back.status is SampleStatus.TRUNCATED
    assert back.rollout_routed_experts.dtype == np.int32
    assert np.array_equal(back.rollout_routed_experts, s.rollout_routed_experts)
    assert back.metadata == {"prompt_index": 9, "turns": [1, 2]} and back.reward == s.reward
    assert decode_samples(encode_samples([s, back]))[1].tokens == s.tokens
    with pytest.raises(ValueError, match="does not know"):
        sample_from_dict({**sample_to_dict(s), "extra": 1})


def test_one_step_off_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path):
    mode = ["runtime.mode=one_step_off", "algorithm.off_policy.mode=tis", "run.save_every=2"]
    full = Run(_cfg("run.steps=4", *mode), tmp_path / "full")
    full.train(close=False)
    # the checkpoint of step 2 holds rollout 2, generated with the weights of step 0 (version 1) while
    # step 1 trained
    state = json.loads((tmp_path / "full" / "checkpoints" / "step_2" / "state.json").read_text())
    pending = state["rollouts"]
    assert pending["mode"] == "one_step_off" and pending["samples"]
    assert {v for s in pending["samples"] for v in s["weight_versions"]} == {1}

    part = tmp_path / "part"
    _crash_after(tmp_path / "full", part, 2)
    resumed = Run(_cfg("run.steps=4", *mode), part, resume=True)
    assert resumed.step == 2 and resumed.version == state["version"]
    resumed.train(close=False)
    assert [_strip(r) for r in read_metrics(part)] == [_strip(r) for r in read_metrics(tmp_path / "full")]
    wf, wr = _weights(full), _weights(resumed)
    full.close()
    resumed.close()
    assert all(torch.equal(wf[k], wr[k]) for k in wf)


def test_a_one_step_off_checkpoint_resumed_in_sync_mode_generates_its_prompts_again(tmp_path):
    mode = ["runtime.mode=one_step_off", "algorithm.off_policy.mode=tis", "run.save_every=2", "rollout.dump=true"]
    Run(_cfg("run.steps=3", *mode), tmp_path / "full").train()
    part = tmp_path / "part"
    _crash_after(tmp_path / "full", part, 2)
    state = json.loads((part / "checkpoints" / "step_2" / "state.json").read_text())
    saved = state["rollouts"]
    Run(_cfg("run.steps=3", "rollout.dump=true"), part, resume=True).train()
    prompt_ids = lambda rows: sorted(r["metadata"]["prompt_index"] for r in rows)  # noqa: E731
    regenerated = [json.loads(x) for x in (part / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert prompt_ids(regenerated) == prompt_ids(saved["samples"])  # same prompts, not skipped
    # ... with the checkpoint's weights (on-policy), not the older ones the saved batch was made with
    assert {v for s in saved["samples"] for v in s["weight_versions"]} == {state["version"]}
    assert {v for r in regenerated for v in r["weight_versions"]} == {state["version"] + 1}


def _drawn(run_dir: Path, steps: range, order_places: dict[int, int]) -> list[int]:
    """The prompt places the dumps of ``steps`` trained on (one per group)."""
    out = []
    for step in steps:
        groups = {}
        for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines():
            row = json.loads(line)
            groups[row["group_index"]] = order_places[row["metadata"]["prompt_index"]]
        out += groups.values()
    return out


def _accounted(state: dict, trained: list[int], order: list[int]) -> None:
    """Every prompt the data source handed out up to ``state`` is trained, queued or requeued, once."""
    data, pending = state["data"], state["rollouts"]
    assert data["epoch"] == 0, "the test data must not wrap around"
    queued = [g["prompt"] for g in pending["queued"]]
    requeued = data.get("requeued", [])
    handed_out = trained + queued + requeued
    assert sorted(handed_out) == sorted(order[: data["offset"]]), (trained, queued, requeued, data)


@pytest.mark.parametrize("queue_groups", [4])
def test_fully_async_resume_loses_and_repeats_no_prompt(tmp_path, queue_groups):
    mode = ["runtime.mode=fully_async", "algorithm.off_policy.mode=tis", "runtime.max_staleness=100",
            "run.save_every=2", "rollout.dump=true", f"runtime.queue_groups={queue_groups}",
            "data.arithmetic.num_examples=200"]
    first = Run(_cfg("run.steps=2", *mode), tmp_path / "run")
    places = {r.index: p for p, r in enumerate(first.data.records)}
    order = first.data._epoch_order(0)
    first.train()
    run_dir = tmp_path / "run"
    state = json.loads((run_dir / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["rollouts"]["mode"] == "fully_async"
    trained = _drawn(run_dir, range(2), places)
    _accounted(state, trained, order)
    assert state["rollouts"]["queued"] or state["data"].get("requeued"), "nothing was in flight at the checkpoint"
    queued = state["rollouts"]["queued"]

    resumed = Run(_cfg("run.steps=4", *mode), run_dir, resume=True)
    resumed.train()
    # the queued groups are trained first, as they were saved (same tokens and weight versions)
    first_rows = [json.loads(x) for x in (run_dir / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    for group in queued[:2]:
        want = [(s["tokens"], s["weight_versions"]) for s in group["samples"]]
        got = [(r["tokens"], r["weight_versions"]) for r in first_rows if places[r["metadata"]["prompt_index"]]
               == group["prompt"] and r["group_index"] == group["samples"][0]["group_index"]]
        assert got == want
    final = json.loads((run_dir / "checkpoints" / "step_4" / "state.json").read_text())
    _accounted(final, _drawn(run_dir, range(4), places), order)


def test_a_one_step_off_run_stopped_mid_rollout_saves_and_generates_that_rollout_again(tmp_path):
    """SIGINT while rollout 1 is generating (during step 0): the checkpoint of step 1 cannot hold rollout 1;
    it records the data position before it, so the resumed run generates the same prompts again."""
    from tandem.runtime.preemption import Preempted
    from tests.runtime import test_reliability_runtime_checkpoints as ckpt_tests

    mode = ["runtime.mode=one_step_off", "algorithm.off_policy.mode=tis", "rollout.dump=true", "run.steps=3"]
    Run(_cfg(*mode), tmp_path / "full").train()
    part = tmp_path / "part"
    ckpt_tests._CALLS["n"] = 0
    run = Run(_cfg(*mode, "reward.terms=[{name: "
                   "'tests.runtime.test_reliability_runtime_checkpoints:interrupting_reward'}]"), part)
    with pytest.raises(Preempted) as stop:
        run.train()
    assert stop.value.step == 1
    state = json.loads((part / "checkpoints" / "step_1" / "state.json").read_text())
    assert "rollouts" not in state and state["trainer_ahead"]
    resumed = Run(_cfg(*mode), part, resume=True)
    assert resumed.version == state["version"] + 1  # step 0's update, never sent before the stop
    resumed.train()
    prompts = lambda d, k: sorted(json.loads(x)["metadata"]["prompt_index"]  # noqa: E731
                                  for x in (d / "rollouts" / f"step_{k}.jsonl").read_text().splitlines())
    assert [prompts(part, k) for k in (1, 2)] == [prompts(tmp_path / "full", k) for k in (1, 2)]
    assert [r["step"] for r in read_metrics(part)] == [0, 1, 2]
