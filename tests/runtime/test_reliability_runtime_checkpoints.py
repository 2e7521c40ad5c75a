"""Issue 23, data loss and corruption: checksummed checkpoints, fallback to a good one, finite weights,
pruning that keeps a good checkpoint, and a checkpoint on SIGINT / SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.config import load_config
from tandem.runtime.checkpoint import CheckpointError, _prune, latest_checkpoint, verify_checkpoint
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.preemption import Preempted, StopSignals
from tandem.runtime.tracking import read_metrics
from tests.runtime.rewards import even_tokens

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
EVEN = ["reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"]


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [*EVEN, *overrides])


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint after each step (step_1, step_2)."""
    run_dir = tmp_path_factory.mktemp("saved")
    Run(_cfg("run.steps=2", "run.save_every=1"), run_dir).train()
    return run_dir


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def test_every_checkpoint_file_is_in_its_manifest(saved):
    ckpt = saved / "checkpoints" / "step_2"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"state.json", "config.yaml"} <= set(files)
    assert any(f.startswith("trainer/") and f.endswith(".distcp") for f in files)
    assert verify_checkpoint(ckpt) is True


def test_a_corrupted_shard_is_refused_and_the_run_resumes_from_the_newest_good_checkpoint(saved, tmp_path, caplog):
    run_dir = _copy(saved, tmp_path)
    shard = next((run_dir / "checkpoints" / "step_2" / "trainer").glob("*.distcp"))
    _flip_bytes(shard)
    with pytest.raises(CheckpointError, match=rf"file trainer/{shard.name} is corrupted"):
        verify_checkpoint(shard.parents[1])
    with caplog.at_level(logging.WARNING):
        run = Run(_cfg("run.steps=3", "run.save_every=1"), run_dir, resume=True)
    assert run.step == 1  # step_2 refused, naming the shard; step_1 is intact
    assert f"trainer/{shard.name} is corrupted" in caplog.text and "using checkpoint" in caplog.text
    run.train()
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    # the new checkpoints replaced the bad one; each verifies
    assert all(verify_checkpoint(p) for p in (run_dir / "checkpoints").glob("step_*"))


def test_a_run_whose_only_checkpoints_are_bad_does_not_resume(saved, tmp_path):
    run_dir = _copy(saved, tmp_path)
    for step in (1, 2):
        _flip_bytes(run_dir / "checkpoints" / f"step_{step}" / "state.json")
    with pytest.raises(FileNotFoundError, match="no complete, intact checkpoint"):
        Run(_cfg("run.steps=3"), run_dir, resume=True)


def test_latest_naming_a_missing_checkpoint_falls_back(saved, tmp_path, caplog):
    run_dir = _copy(saved, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step_2")
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_1"
    assert "step_2 does not exist" in caplog.text


def _poison(run: Run) -> None:
    with torch.no_grad():
        next(run.trainer.policy.module.lm.parameters()).fill_(float("nan"))


def test_non_finite_weights_are_neither_saved_nor_loaded(saved, tmp_path, caplog):
    run_dir = _copy(saved, tmp_path)
    run = Run(_cfg("run.steps=3", "run.save_every=1"), run_dir, resume=True)
    try:
        _poison(run)
        with pytest.raises(CheckpointError, match="step 2: the trainer's weights \\(not saved\\) hold NaN/Inf"):
            run.save()
        # a checkpoint whose files are intact but whose weights are not (written by a broken trainer): its
        # files match the manifest, the load refuses it and the resume falls back
        from tandem.runtime.checkpoint import save_run_checkpoint

        save_run_checkpoint(run_dir, 2, run.trainer, run._state(), run.cfg, keep=5, check_weights=False)
    finally:
        run.close()
    with caplog.at_level(logging.WARNING):
        resumed = Run(_cfg("run.steps=3"), run_dir, resume=True)
    assert resumed.step == 1 and "the loaded weights hold NaN/Inf" in caplog.text
    resumed.close()


def test_pruning_keeps_the_newest_good_checkpoint(saved, tmp_path):
    run_dir = _copy(saved, tmp_path)
    ckpts = run_dir / "checkpoints"
    shutil.copytree(ckpts / "step_2", ckpts / "step_3")
    (ckpts / "step_3" / "state.json").unlink()  # a newer checkpoint that is not complete
    _prune(run_dir, keep=1)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_3"]  # step_1 went, step_2 stays


# -- stop signals ----------------------------------------------------------------------------------------


def test_a_signal_abandons_a_rollout_but_lets_a_training_phase_finish(monkeypatch):
    phase = {"now": "generate"}
    signals = StopSignals(phase=lambda: phase["now"])
    with pytest.raises(Preempted, match="SIGTERM"):
        signals._handle(signal.SIGTERM, None)
    signals = StopSignals(phase=lambda: phase["now"])
    phase["now"] = "train"
    signals._handle(signal.SIGINT, None)  # noted; the step finishes
    signals.check()  # a polled wait inside the training phase does not stop it either
    with pytest.raises(Preempted) as stop:
        signals.check_after_step()
    assert stop.value.exit_code == 130
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    signals._handle(signal.SIGTERM, None)  # a second signal: out at once
    assert exits == [128 + signal.SIGTERM]


_CALLS = {"n": 0}


def interrupting_reward(sample) -> float:
    """`even_tokens`, and SIGINT to this process on the first reward of step 1 (8 rewards per step)."""
    _CALLS["n"] += 1
    if _CALLS["n"] == 9:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the signal reaches the loop's thread, waiting for the rewards
    return even_tokens(sample)


def test_sigint_mid_step_saves_the_last_completed_step_and_the_resume_repeats_the_run(tmp_path):
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the suite runs in the background
    full = tmp_path / "full"
    Run(_cfg("run.steps=3"), full).train()
    part = tmp_path / "part"
    _CALLS["n"] = 0
    run = Run(_cfg("run.steps=3", "reward.terms=[{name: "
                   "'tests.runtime.test_reliability_runtime_checkpoints:interrupting_reward'}]"), part)
    with pytest.raises(Preempted) as stop:
        run.train()
    assert stop.value.signame == "SIGINT" and stop.value.step == 1
    assert stop.value.checkpoint == part / "checkpoints" / "step_1" and verify_checkpoint(stop.value.checkpoint)
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    assert [r["step"] for r in read_metrics(part)] == [0]
    Run(_cfg("run.steps=3"), part, resume=True).train()
    drop = ("time", "rollout/tokens_per_s", "train/tokens_per_s", "train/step_time_s", "sync/seconds", "sync/gbps", "sys/")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(drop)}  # noqa: E731
    assert [strip(r) for r in read_metrics(part)] == [strip(r) for r in read_metrics(full)]


def test_sigterm_to_tandem_train_saves_a_checkpoint_and_exits(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "tandem.cli", "train", str(RECIPE), *EVEN, "run.steps=200",
           "--run-dir", str(run_dir), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert read_metrics(run_dir), "no step completed"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    steps = len(read_metrics(run_dir))
    assert f"tandem: stopped by SIGTERM after step {steps}; saved checkpoint" in err
    assert f"--resume {run_dir}" in err
    ckpt = latest_checkpoint(run_dir)
    assert ckpt == run_dir / "checkpoints" / f"step_{steps}" and verify_checkpoint(ckpt)
    assert json.loads((ckpt / "state.json").read_text())["step"] == steps
    resumed = Run(_cfg(f"run.steps={steps + 1}"), run_dir, resume=True)
    assert resumed.step == steps
    resumed.train()
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(steps + 1))
