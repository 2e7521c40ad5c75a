"""Metrics: JSONL always; TensorBoard, MLflow (local store) and W&B (offline) when enabled and installed.

MLflow writes to ``RUN_DIR/mlflow.db`` (SQLite), TensorBoard to ``RUN_DIR/tensorboard``, W&B to
``RUN_DIR/wandb`` (offline). ``metrics.jsonl`` holds one JSON object per step (``{"step": k, "time": ..., <metric>: float, ...}``),
flushed as it is written, so a crash loses at most the step in flight. On resume, lines after the
checkpoint's step are dropped so the file reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "TrackingConfig", "read_metrics"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    """The recipe's ``tracking:`` section. Backends other than JSONL need the ``[tracking]`` extra."""

    tensorboard: bool = False
    mlflow: bool = False
    wandb: bool = False
    project: str = "tandem"
    progress: bool = True  # a rich progress bar over steps


def read_metrics(run_dir: str | Path, *, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/metrics.jsonl`` ([] without the file).

    A line that is not a JSON object with an integer ``step`` (the half-written last line of a run that
    was killed, a line edited by hand) is skipped with a warning naming its line number, and appended
    to ``skipped`` when given; it never stops a report or a resume.
    """
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    rows = []
    for lineno, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            row, why = None, f"not JSON ({e})"
        else:
            why = "not an object with an integer 'step'"
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
            continue
        log.warning("%s:%d: skipping a bad metrics line: %s", p, lineno, why)
        if skipped is not None:
            skipped.append(lineno)
    return rows


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: str | Path, *, run_name: str, resume_step: int | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and path.exists():
            _keep_until(path, resume_step)
        elif resume_step is None and path.exists():
            path.unlink()
        self._file = path.open("a")
        self._backends: list[Any] = []
        if cfg.tensorboard:
            self._backends.append(_TensorBoard(self.run_dir))
        if cfg.mlflow:
            self._backends.append(_MLflow(self.run_dir, cfg.project, run_name, config or {}))
        if cfg.wandb:
            self._backends.append(_WandB(self.run_dir, cfg.project, run_name, config or {}))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for b in self._backends:
            b.log(step, metrics)

    def rewind(self, last_step: int) -> None:
        """Drop the JSONL lines after ``last_step`` (a run that resumed in place from a checkpoint)."""
        self._file.close()
        _keep_until(self.run_dir / "metrics.jsonl", last_step)
        self._file = (self.run_dir / "metrics.jsonl").open("a")

    def close(self) -> None:
        self._file.close()
        for b in self._backends:
            b.close()


def _keep_until(path: Path, last_step: int) -> None:
    kept = [r for r in read_metrics(path.parent) if r.get("step", -1) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def _need(module: str, extra: str = "tracking"):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"tracking backend needs {module}: pip install 'tandem-rl[{extra}]'") from None


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        tb = _need("torch.utils.tensorboard")
        self.writer = tb.SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step, metrics):
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict) -> None:
        self.mlflow = _need("mlflow")
        # A local SQLite store in the run directory (MLflow's file store is deprecated).
        self.mlflow.set_tracking_uri(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
        if self.mlflow.get_experiment_by_name(project) is None:
            self.mlflow.create_experiment(project, artifact_location=(run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(project)
        self.mlflow.start_run(run_name=name)
        flat = {k: str(v)[:250] for k, v in _flatten(config).items()}
        self.mlflow.log_params(dict(list(flat.items())[:100]))

    def log(self, step, metrics):
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def close(self):
        self.mlflow.end_run()


class _WandB:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict) -> None:
        wandb = _need("wandb")
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode="offline", config=config)

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def close(self):
        self.run.finish()


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
