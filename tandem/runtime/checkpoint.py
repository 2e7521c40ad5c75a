"""Run checkpoints: the trainer's DCP checkpoint plus everything else a resume needs, atomically, checksummed.

``RUN_DIR/checkpoints/step_<k>/`` holds ``trainer/`` (the training engine's checkpoint), ``state.json``
(step, weight version, data position, KL controller, Python/numpy/torch RNG), ``config.yaml``,
``draft_head.safetensors`` when the engine's speculative draft head was trained (`read_drafter_state`) and
``manifest.json`` (every other file's size and xxh3-64, computed from the files on disk). The folder is
assembled as ``.step_<k>.partial`` and renamed into place; ``LATEST`` is rewritten (temp + rename) only
afterwards, so a crash mid-save never leaves a checkpoint that looks complete.

Loading verifies the manifest first (a missing, resized or changed file is refused, naming it), then the
trainer's weights must be finite. `latest_checkpoint` falls back from a ``LATEST`` that names a missing
or bad checkpoint to the newest good one, saying so. A save refuses non-finite weights, and pruning
(beyond ``keep``) never removes the newest checkpoint that verifies.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from tandem.config import ConfigError, save_config

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "check_finite_weights",
    "check_resume_target",
    "checkpoints",
    "drafter_state",
    "latest_checkpoint",
    "load_run_state",
    "read_drafter_state",
    "restore_drafter",
    "restore_latest",
    "rng_state",
    "save_run_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DRAFT_HEAD = "draft_head.safetensors"
_MANIFEST_FORMAT = "tandem-run-checkpoint-1"
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupted or holds non-finite weights; the message names what."""


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


# -- the manifest ---------------------------------------------------------------------------------------


def _file_digest(path: Path, *, fsync: bool = False) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _files(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            yield p


def _write_manifest(root: Path) -> None:
    """Hash (and flush to disk) every file under ``root``; write the manifest last."""
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "xxh3": _file_digest(p, fsync=True)}
             for p in _files(root)}
    with open(root / MANIFEST, "w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(ckpt: str | Path) -> bool:
    """Check every file of ``ckpt`` against its manifest; raise `CheckpointError` naming the first bad one.

    Returns False for a checkpoint written before manifests existed (nothing to check against), True
    once verified.
    """
    ckpt = Path(ckpt)
    if not (ckpt / "state.json").is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no state.json)")
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable ({e})") from None
    for rel, want in files.items():
        p = ckpt / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: file {rel} is missing")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt}: file {rel} has {size} bytes, the manifest says {want['bytes']}")
        if _file_digest(p) != want["xxh3"]:
            raise CheckpointError(f"checkpoint {ckpt}: file {rel} is corrupted (its xxh3 checksum does not match "
                                  "the manifest)")
    return True


# -- finding, saving and loading ------------------------------------------------------------------------


def _step_of(p: Path) -> int:
    return int(p.name.split("_")[1])


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The published ``step_<k>`` folders of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name.split("_")[1].isdigit()]
    return sorted(found, key=_step_of)


def _candidates(run_dir: Path) -> list[Path]:
    """What ``LATEST`` names first, then every other checkpoint, newest first."""
    root = run_dir / "checkpoints"
    ordered = list(reversed(checkpoints(run_dir)))
    latest = root / "LATEST"
    if latest.is_file():
        named = root / latest.read_text().strip()
        ordered = [named, *(p for p in ordered if p != named)]
    return ordered


def _good_checkpoints(run_dir: str | Path, *, skip: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Checkpoints that verify, newest (or ``LATEST``'s) first; each one passed over is logged."""
    run_dir = Path(run_dir)
    rejected: list[str] = []
    for ckpt in _candidates(run_dir):
        if ckpt in skip:
            continue
        try:
            if not ckpt.is_dir():
                raise CheckpointError(f"{ckpt} does not exist")
            if not verify_checkpoint(ckpt):
                log.warning("checkpoint %s has no %s (written by an older Tandem): not verified", ckpt, MANIFEST)
        except CheckpointError as e:
            rejected.append(str(e))
            log.error("%s; looking for an older checkpoint", e)
            continue
        if rejected:
            log.warning("using checkpoint %s instead (passed over: %s)", ckpt, "; ".join(rejected))
        yield ckpt


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``LATEST`` names if it verifies, else the newest one that does (logged); None if none."""
    return next(_good_checkpoints(run_dir), None)


def check_resume_target(run_dir: str | Path, steps: int, *, step: int | None = None, ckpt: Path | None = None) -> None:
    """Refuse (`ConfigError`, naming both numbers) to resume a run whose checkpoint is at or past ``steps``.

    Without ``step``: the step of the checkpoint ``LATEST`` names, read without verifying it (a cheap check
    before anything is built; an unreadable one is left to the restore, which reports it).
    """
    if step is None:
        candidates = _candidates(Path(run_dir))
        if not candidates:
            return
        ckpt = candidates[0]
        try:
            step = int(json.loads((ckpt / "state.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return
    if step >= steps:
        raise ConfigError(f"--resume: checkpoint {ckpt} is at step {step} and run.steps={steps}: nothing left to "
                          f"train; set run.steps above {step} to continue the run")


def check_finite_weights(trainer, bucket_bytes: int = 1 << 28, *, what: str = "the trainer's weights") -> None:
    """Raise `CheckpointError` if any weight the trainer would sync is NaN or Inf (names the tensor)."""
    bad = None
    for bucket in trainer.named_parameters_for_sync(bucket_bytes):  # drained fully: it may be collective
        for name, t in bucket:
            if bad is None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = name
    if bad is not None:
        raise CheckpointError(f"{what} hold NaN/Inf values (first: {bad})")


def save_run_checkpoint(run_dir: str | Path, step: int, trainer, state: dict[str, Any], config: Any, *, keep: int,
                        check_weights: bool = True, bucket_bytes: int = 1 << 28,
                        drafter_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Save ``step`` (``state`` may carry its own ``rng``: the state of an earlier moment, e.g. the last
    completed step). Refuses non-finite weights; prunes beyond ``keep``, never the newest good checkpoint.
    ``drafter_state``: the engine's draft head (`TorchEngine.drafter_state`), kept beside the trainer."""
    if check_weights:
        check_finite_weights(trainer, bucket_bytes, what=f"step {step}: the trainer's weights (not saved)")
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trainer.save(str(tmp / "trainer"))
    (tmp / "state.json").write_text(json.dumps({"rng": rng_state(), **state, "step": step}))
    if drafter_state:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in drafter_state.items()}, str(tmp / DRAFT_HEAD))
    save_config(config, tmp / "config.yaml")
    _write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / ".LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "LATEST")
    _prune(run_dir, keep)
    return final


def _prune(run_dir: str | Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints, except the newest one with a complete manifest."""
    done = checkpoints(run_dir)
    protected = next((p for p in reversed(done) if _looks_complete(p)), None)
    for old in done[:-keep]:
        if old != protected:
            shutil.rmtree(old, ignore_errors=True)


def _looks_complete(ckpt: Path) -> bool:
    """Every file of the manifest present with its size (the cheap part of `verify_checkpoint`)."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        return all((ckpt / rel).is_file() and (ckpt / rel).stat().st_size == f["bytes"] for rel, f in files.items())
    except (OSError, ValueError, KeyError):
        return False


def load_run_state(ckpt: Path, trainer, *, verify: bool = True, bucket_bytes: int = 1 << 28) -> dict[str, Any]:
    """Restore the trainer from ``ckpt`` and return its ``state.json`` (RNG restored too).

    ``verify``: check the files against the manifest first. The loaded weights must be finite.
    """
    if verify:
        verify_checkpoint(ckpt)
    trainer.load(str(ckpt / "trainer"))
    check_finite_weights(trainer, bucket_bytes, what=f"checkpoint {ckpt}: the loaded weights")
    state = json.loads((ckpt / "state.json").read_text())
    set_rng_state(state["rng"])
    return state


def restore_latest(run_dir: str | Path, trainer, *, bucket_bytes: int = 1 << 28) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest good checkpoint into ``trainer``: ``(path, state)``, or None if there is none.

    A checkpoint that fails (bad files, non-finite weights) is logged and the next older one is tried;
    a failed load leaves nothing behind, as the next load replaces every weight and optimizer state.
    """
    failed: tuple[Path, ...] = ()
    while True:
        ckpt = next(_good_checkpoints(run_dir, skip=failed), None)
        if ckpt is None:
            return None
        try:
            return ckpt, load_run_state(ckpt, trainer, verify=False, bucket_bytes=bucket_bytes)
        except CheckpointError as e:
            log.error("%s; looking for an older checkpoint", e)
            failed += (ckpt,)


def read_drafter_state(ckpt: str | Path) -> dict[str, torch.Tensor] | None:
    """The draft head a checkpoint kept (None when it has none); the manifest covers the file."""
    path = Path(ckpt) / DRAFT_HEAD
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))


def drafter_state(engine) -> dict[str, torch.Tensor] | None:
    """The engine's trained draft head, when the engine is in this process and has one (engines behind a
    process or Ray boundary keep theirs: their heads learn again after a resume)."""
    state = getattr(engine, "drafter_state", None)
    return state() if state is not None else None


def restore_drafter(ckpt: str | Path, engine) -> None:
    """Put the checkpoint's draft head back into ``engine`` (a resume); one that no longer fits (another
    drafter or model) is logged and left: the head learns again, the run goes on."""
    state = read_drafter_state(ckpt)
    load = getattr(engine, "load_drafter_state", None)
    if state is None or load is None:
        return
    try:
        load(state)
        log.info("the draft head resumed from %s (%d trainings)", ckpt, int(state["trainings"]))
    except ValueError as e:
        log.warning("the checkpoint's draft head was not restored: %s", e)
