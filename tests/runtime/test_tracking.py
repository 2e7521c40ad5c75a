"""Metrics backends: JSONL always; TensorBoard, MLflow (local store) and W&B (offline) when enabled."""

from __future__ import annotations

import json
import math

import pytest

from tandem.runtime.tracking import Tracker, TrackingConfig, read_metrics


def test_jsonl_rows_nan_and_resume_trim(tmp_path):
    t = Tracker(TrackingConfig(), tmp_path, run_name="r")
    for step in range(4):
        t.log(step, {"reward/mean": step / 10, "loss/pg": math.nan if step == 2 else 0.5})
    t.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[2]["loss/pg"] == "nan"
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    t = Tracker(TrackingConfig(), tmp_path, run_name="r", resume_step=1)  # resumed after step 1
    t.log(2, {"reward/mean": 0.9})
    t.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(0, 0.0), (1, 0.1), (2, 0.9)]


def test_tensorboard_backend(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(TrackingConfig(tensorboard=True), tmp_path, run_name="r")
    t.log(0, {"reward/mean": 0.25})
    t.log(1, {"reward/mean": 0.5})
    t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.25, 0.5]


def test_mlflow_local_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    t = Tracker(TrackingConfig(mlflow=True, project="tandem-test"), tmp_path, run_name="r",
                config={"model": {"name": "tiny"}})
    t.log(0, {"reward/mean": 0.25, "loss/pg": math.nan})
    t.log(1, {"reward/mean": 0.75})
    t.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("tandem-test")
    run = client.search_runs([exp.experiment_id])[0]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward.mean")] == [0.25, 0.75]
    assert run.data.params["model.name"] == "tiny"


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(TrackingConfig(wandb=True, project="tandem-test"), tmp_path, run_name="r")
    t.log(0, {"reward/mean": 0.5})
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())
