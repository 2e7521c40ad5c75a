"""Disk sync: safetensors files in a shared directory, for engines in other jobs.

Layout under ``directory``::

    blobs/<xxh3>.safetensors    one file per sent bucket, named by the hash of its contents
    manifests/v<version>.json   every tensor's name -> (blob, tensor hash) for that version
    LATEST                      the newest complete version (written last)

Every file is written to a temporary name and renamed into place, and ``LATEST`` only moves after the
blobs and the manifest exist, so a reader never sees a partial version. In **delta** mode the sender
hashes every tensor and writes only those that changed since the previous version; the manifest
still lists every tensor (unchanged ones point to older blobs), and a receiver loads only the tensors
whose hash differs from what it already holds. Old versions beyond ``keep_versions`` are pruned, with
the blobs no kept manifest references.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.sync.base import SyncError, checksum

__all__ = ["DiskReceiver", "DiskSender"]

ApplyFn = Callable[[list[tuple[str, torch.Tensor]], int], None]


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_latest(root: Path) -> int | None:
    p = root / "LATEST"
    return int(p.read_text()) if p.is_file() else None


class DiskSender:
    def __init__(self, directory: str | Path, *, delta: bool = False, keep_versions: int = 2) -> None:
        self.root = Path(directory)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        self.delta, self.keep_versions = delta, keep_versions
        self._last: dict[str, dict] = {}  # name -> {"blob", "hash"} of the previous version
        latest = _read_latest(self.root)
        if latest is not None and delta:
            self._last = json.loads((self.root / "manifests" / f"v{latest}.json").read_text())["tensors"]

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        entries: dict[str, dict] = {}
        written = total = 0
        try:
            for bucket in buckets:
                hashes = {name: checksum(t) for name, t in bucket}
                changed = [
                    (n, t)
                    for n, t in bucket
                    if not self.delta or self._last.get(n, {}).get("hash") != hashes[n]
                ]
                changed_names = {n for n, _ in changed}
                for name, t in bucket:
                    total += t.numel() * t.element_size()
                    if name not in changed_names:
                        entries[name] = dict(self._last[name])
                if not changed:
                    continue
                blob = f"{checksum(t for _, t in changed):016x}.safetensors"
                target = self.root / "blobs" / blob
                if not target.exists():
                    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{blob}.", suffix=".tmp")
                    os.close(fd)
                    save_file({n: t.detach().contiguous().cpu() for n, t in changed}, tmp)
                    os.replace(tmp, target)
                for n, t in changed:
                    entries[n] = {"blob": blob, "hash": hashes[n]}
                    written += t.numel() * t.element_size()
            manifest = {"version": version, "tensors": entries}
            _atomic_write(self.root / "manifests" / f"v{version}.json", json.dumps(manifest).encode())
            _atomic_write(self.root / "LATEST", str(version).encode())
        except OSError as e:
            raise SyncError(f"disk sync of version {version} to {self.root} failed: {e}") from e
        self._last = entries
        self._prune(version)
        dt = time.perf_counter() - t0
        return {
            "sync/bytes": float(written),
            "sync/bytes_total": float(total),
            "sync/seconds": dt,
            "sync/gbps": written / max(dt, 1e-9) / 1e9,
        }

    def _prune(self, newest: int) -> None:
        manifests = sorted(self.root.glob("manifests/v*.json"), key=lambda p: int(p.stem[1:]))
        for p in manifests[: -self.keep_versions]:
            p.unlink(missing_ok=True)
        live = set()
        for p in self.root.glob("manifests/v*.json"):
            live |= {e["blob"] for e in json.loads(p.read_text())["tensors"].values()}
        for blob in self.root.glob("blobs/*.safetensors"):
            if blob.name not in live:
                blob.unlink(missing_ok=True)

    def close(self) -> None:
        pass


class DiskReceiver:
    """Loads the newest complete version into an engine (only changed tensors in delta mode)."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        self.version: int | None = None
        self._hashes: dict[str, int] = {}

    def latest_version(self) -> int | None:
        return _read_latest(self.root)

    def poll(self, apply: ApplyFn) -> int | None:
        """Apply the newest version if it is newer than the last applied one; return it (or None)."""
        latest = self.latest_version()
        if latest is None or (self.version is not None and latest <= self.version):
            return None
        manifest = json.loads((self.root / "manifests" / f"v{latest}.json").read_text())["tensors"]
        wanted: dict[str, list[str]] = {}
        for name, entry in manifest.items():
            if self._hashes.get(name) != entry["hash"]:
                wanted.setdefault(entry["blob"], []).append(name)
        named = []
        for blob, names in wanted.items():
            with safe_open(str(self.root / "blobs" / blob), framework="pt") as f:
                for n in names:
                    t = f.get_tensor(n)
                    if checksum(t) != manifest[n]["hash"]:
                        raise SyncError(
                            f"disk sync v{latest}: tensor {n!r} in {blob} is corrupted (hash mismatch)"
                        )
                    named.append((n, t))
        apply(named, latest)  # raises -> nothing recorded; the engine keeps its weights
        self._hashes.update({n: manifest[n]["hash"] for _, names in wanted.items() for n in names})
        self.version = latest
        return latest
