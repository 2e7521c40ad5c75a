"""What a command may be pointed at: a run, one of its checkpoints, a trainer checkpoint, or a model.

``tandem eval``, ``tandem export`` and ``tandem train --resume`` accept the same targets:

* a **run directory** (``runs/NAME``: it holds ``checkpoints/`` or ``metrics.jsonl``): its latest
  complete checkpoint;
* a **run checkpoint** (``runs/NAME/checkpoints/step_K``: ``state.json`` + ``trainer/``);
* a **trainer checkpoint** (the folder holding the training engine's ``tandem_checkpoint.json``, e.g.
  ``.../step_K/trainer``);
* an **HF folder** (``config.json`` and weights) or a **registry name** (``smollm2-135m-instruct``):
  a model, not a checkpoint (``export`` and ``--resume`` refuse it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tandem.engines.training.common.checkpoint import MARKER

__all__ = ["Target", "TargetError", "resolve_target"]

Kind = Literal["run", "run_checkpoint", "trainer_checkpoint", "model"]


class TargetError(ValueError):
    """A target that is none of the accepted kinds, or a run without a complete checkpoint."""


@dataclass(frozen=True, slots=True)
class Target:
    kind: Kind
    path: str  # as given
    run_dir: Path | None = None  # the run the checkpoint belongs to (run, run_checkpoint)
    run_checkpoint: Path | None = None  # step_K (run, run_checkpoint)
    trainer_checkpoint: Path | None = None  # the engine's checkpoint (every kind but model)
    model: str | None = None  # an HF folder or a registry name (model)

    def require_checkpoint(self, what: str) -> Path:
        """The trainer checkpoint, or `TargetError` for a model target."""
        if self.trainer_checkpoint is None:
            raise TargetError(f"{what}: {self.path!r} is a model, not a checkpoint (give a run directory, "
                              "runs/NAME/checkpoints/step_K, or a trainer checkpoint)")
        return self.trainer_checkpoint


def resolve_target(target: str) -> Target:
    """Classify ``target`` (module docstring); `TargetError` naming what was looked for otherwise."""
    from tandem.runtime.checkpoint import latest_checkpoint

    p = Path(target)
    if p.is_dir():
        if (p / "checkpoints").is_dir() or (p / "metrics.jsonl").is_file():
            ckpt = latest_checkpoint(p)
            if ckpt is None:
                raise TargetError(f"{p} is a run directory without a complete checkpoint "
                                  f"({p / 'checkpoints'} has no LATEST pointing at one)")
            return Target(kind="run", path=target, run_dir=p, run_checkpoint=ckpt, trainer_checkpoint=ckpt / "trainer")
        if (p / "state.json").is_file() and (p / "trainer").is_dir():
            return Target(kind="run_checkpoint", path=target, run_dir=p.parent.parent, run_checkpoint=p,
                          trainer_checkpoint=p / "trainer")
        if (p / MARKER).is_file():
            return Target(kind="trainer_checkpoint", path=target, trainer_checkpoint=p)
        if (p / "config.json").is_file():
            return Target(kind="model", path=target, model=str(p))
        partial = sorted(q.name for q in p.glob(".step_*.partial"))
        hint = f" (an interrupted save left {partial[0]})" if partial else ""
        raise TargetError(f"{p} is neither a run directory, a run checkpoint (state.json + trainer/), a trainer "
                          f"checkpoint ({MARKER}) nor an HF model folder (config.json){hint}")
    if not p.exists() and ("/" in target or target.startswith(".")):
        raise TargetError(f"{target} does not exist (no run directory, checkpoint or model folder there)")
    from tandem.models.registry import ModelNotFoundError, resolve_model

    try:
        resolve_model(target)
    except ModelNotFoundError as e:
        raise TargetError(f"{target!r} is not a directory, and {e}") from None
    return Target(kind="model", path=target, model=target)
