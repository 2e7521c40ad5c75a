"""Run checkpoints: the trainer's DCP checkpoint plus everything else a resume needs, atomically.

``RUN_DIR/checkpoints/step_<k>/`` holds ``trainer/`` (the training engine's checkpoint), ``state.json``
(step, weight version, data position, KL controller, Python/numpy/torch RNG) and ``config.yaml``. The
folder is assembled as ``.step_<k>.partial`` and renamed into place; ``LATEST`` is rewritten (temp +
rename) only afterwards, so a crash mid-save never leaves a checkpoint that looks complete. Older
checkpoints beyond ``keep`` are removed.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.config import save_config

__all__ = ["latest_checkpoint", "load_run_state", "rng_state", "save_run_checkpoint", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(torch.get_rng_state(), buf)
    np_state = np.random.get_state()
    return {
        "python": repr(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(buf.getvalue()).decode(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    t = torch.load(io.BytesIO(base64.b64decode(state["torch"])), weights_only=True)
    torch.set_rng_state(t)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    p = Path(run_dir) / "checkpoints" / "LATEST"
    if not p.is_file():
        return None
    ckpt = p.parent / p.read_text().strip()
    return ckpt if (ckpt / "state.json").is_file() else None


def save_run_checkpoint(run_dir: str | Path, step: int, trainer, state: dict[str, Any], config: Any, *, keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trainer.save(str(tmp / "trainer"))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "rng": rng_state()}))
    save_config(config, tmp / "config.yaml")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / ".LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "LATEST")
    done = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_run_state(ckpt: Path, trainer) -> dict[str, Any]:
    """Restore the trainer from ``ckpt`` and return its ``state.json`` (RNG restored too)."""
    trainer.load(str(ckpt / "trainer"))
    state = json.loads((ckpt / "state.json").read_text())
    set_rng_state(state["rng"])
    return state
