"""What every training engine's checkpoint shares: the completion marker and the atomic publish.

An engine writes a checkpoint into ``.<name>.partial`` next to the target (`partial_dir`), writes the
marker file (`MARKER`: JSON metadata with the engine's ``format``) last, and renames the directory
into place (`publish_dir`). A crash mid-save leaves at most the ``.partial`` directory, never a
directory that `read_marker` accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "partial_dir", "publish_dir", "quiet_single_process", "read_marker"]

MARKER = "tandem_checkpoint.json"


def partial_dir(final: Path) -> Path:
    """Where a save of ``final`` is staged until it is complete."""
    return final.parent / f".{final.name}.partial"


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, replacing an older ``final`` (single process)."""
    _fsync_tree(tmp)
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(path: str | os.PathLike, expected_format: str, *, what: str = "") -> dict[str, Any]:
    """The metadata of a finished checkpoint of ``expected_format``.

    Raises FileNotFoundError for a directory without the marker (absent, or an interrupted save) and
    ValueError naming both formats for another engine's checkpoint (``what`` ends that message).
    """
    p = Path(path)
    marker = p / MARKER
    if not marker.is_file():
        raise FileNotFoundError(
            f"{p} is not a complete Tandem checkpoint (no {MARKER}; an interrupted save leaves only "
            f".{p.name}.partial)"
        )
    meta = json.loads(marker.read_text())
    if meta.get("format") != expected_format:
        note = f" ({what})" if what else ""
        raise ValueError(f"{p}: checkpoint format {meta.get('format')!r}, expected {expected_format!r}{note}")
    return meta


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Around ``torch.distributed.checkpoint`` calls: without a process group (``no_dist``, asked for on
    purpose) torch warns at every save and load that it "assumes the intent" of one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
