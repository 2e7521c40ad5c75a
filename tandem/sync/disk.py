"""Disk sync: safetensors files in a shared directory, for engines in other jobs.

Layout under ``directory``::

    blobs/<xxh3>.safetensors    one file per sent bucket, named by a hash of its tensors' hashes
    manifests/v<version>.json   every tensor's name -> (blob, tensor hash) for that version
    LATEST                      the newest complete version (written last)

Every file is written to a temporary name, flushed to disk (``fsync``) and renamed into place, and
``LATEST`` only moves after the blobs and the manifest exist, so a reader never sees a partial
version, even after a crash. In **delta** mode the sender hashes every tensor and writes only those
that changed since the previous version; the manifest still lists every tensor (unchanged ones point
to older blobs), and a receiver loads only the tensors whose hash differs from what its engine holds
(with the scale/zero-point companions of a quantized weight, which only make sense together). Old
versions beyond ``keep_versions`` are pruned with the blobs no kept manifest references, in the
background after `send` returns (unlinking a model's worth of files took ~1/4 of a sync).

A receiver reads each tensor, checks its hash against the manifest, and applies the whole version at
once; a corrupted or vanished file fails the poll with `SyncError` and the engine keeps its weights.
``verify`` on the receiver compares the engine's weights with the manifest's hashes afterwards.

**Signed manifests** (``secret``, `tandem.sync.auth`): the sender signs each manifest (HMAC-SHA256 over
its version and every tensor's blob and hash); a receiver with the secret refuses an unsigned or
mis-signed version (`SyncError`, the engine keeps its weights), and one whose manifest names another
version than ``LATEST``. A new sync directory is created private to its user (mode 0700).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.kernels.state_dict import COMPANION_SUFFIXES
from tandem.sync import auth
from tandem.sync.apply import call_apply
from tandem.sync.base import ApplyFn, SyncError, checksum, sync_metrics
from tandem.sync.verify import check_reports

__all__ = ["DiskReceiver", "DiskSender"]

log = logging.getLogger(__name__)


def _fsync_replace(tmp: str, path: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _fsync_replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_latest(root: Path) -> int | None:
    p = root / "LATEST"
    return int(p.read_text()) if p.is_file() else None


def _blob_name(hashes: list[tuple[str, int]]) -> str:
    """Content address of a bucket: a hash of its tensors' names and hashes (no second data pass)."""
    h = xxhash.xxh3_64()
    for name, digest in hashes:
        h.update(name.encode())
        h.update(digest.to_bytes(8, "little"))
    return f"{h.intdigest():016x}.safetensors"


def _signed(key: bytes | None, version: int, tensors: dict[str, dict]) -> bytes:
    manifest: dict[str, Any] = {"version": version, "tensors": tensors}
    if key is not None:
        manifest["tag"] = auth.tag(key, "manifest", json.dumps(manifest, sort_keys=True))
    return json.dumps(manifest).encode()


def _open_manifest(key: bytes | None, raw: str, version: int) -> dict[str, Any]:
    """The tensors of a manifest, its signature checked when ``key`` is given."""
    manifest = json.loads(raw)
    if key is not None:
        tag = manifest.pop("tag", None)
        if tag is None:
            raise SyncError(f"disk sync v{version}: the manifest is not signed (a sender without the sync secret)")
        if not auth.check_tag(key, tag, "manifest", json.dumps(manifest, sort_keys=True)):
            raise SyncError(f"disk sync v{version}: the manifest's signature does not match (not written by the "
                            "sender that holds the sync secret)")
    if manifest.get("version") != version:
        raise SyncError(f"disk sync: LATEST says v{version}, its manifest says v{manifest.get('version')}")
    return manifest["tensors"]


class DiskSender:
    """Writes each version as safetensors blobs + a manifest, atomically (see the module docstring).
    ``secret``: sign each manifest; may also be set as the attribute before the first `send`."""

    def __init__(self, directory: str | Path, *, delta: bool = False, keep_versions: int = 2,
                 secret: bytes | str | None = None) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions} must be >= 1")
        self.root = Path(directory)
        self.secret = auth.as_key(secret)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        self.delta, self.keep_versions = delta, keep_versions
        self._last: dict[str, dict] = {}  # name -> {"blob", "hash"} of the previous version
        # Pruning (unlinking a model's worth of old blobs) runs in the background between syncs; the
        # next send waits for it first, so it never deletes a blob that send is about to reuse.
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="tandem-disk-prune")
        self._pruning: Future | None = None
        latest = _read_latest(self.root)
        if latest is not None and delta:
            self._last = json.loads((self.root / "manifests" / f"v{latest}.json").read_text())["tensors"]

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self._finish_pruning()
        entries: dict[str, dict] = {}
        written = total = 0
        try:
            for bucket in buckets:
                hashes = [(name, checksum(t)) for name, t in bucket]
                changed = []
                for i, ((name, t), (_, h)) in enumerate(zip(bucket, hashes, strict=True)):
                    total += t.numel() * t.element_size()
                    if self._unchanged(name, h):
                        entries[name] = dict(self._last[name])
                    else:
                        changed.append(i)
                if not changed:
                    continue
                blob = _blob_name([hashes[i] for i in changed])
                self._write_blob(blob, {bucket[i][0]: bucket[i][1] for i in changed})
                for i in changed:
                    name, t = bucket[i]
                    entries[name] = {"blob": blob, "hash": hashes[i][1]}
                    written += t.numel() * t.element_size()
            _atomic_write(self.root / "manifests" / f"v{version}.json", _signed(self.secret, version, entries))
            _atomic_write(self.root / "LATEST", str(version).encode())
        except OSError as e:
            raise SyncError(f"disk sync of version {version} to {self.root} failed: {e}") from e
        self._last = entries
        self._pruning = self._pruner.submit(self._prune)
        return sync_metrics(written, time.perf_counter() - t0, bytes_total=total)

    def _unchanged(self, name: str, digest: int) -> bool:
        return self.delta and self._last.get(name, {}).get("hash") == digest

    def _write_blob(self, blob: str, tensors: dict[str, torch.Tensor]) -> None:
        target = self.root / "blobs" / blob
        if target.exists():  # same content already stored (e.g. a re-sent version)
            return
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{blob}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, tmp)
            _fsync_replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _prune(self) -> None:
        manifests = sorted(self.root.glob("manifests/v*.json"), key=lambda p: int(p.stem[1:]))
        for p in manifests[: -self.keep_versions]:
            p.unlink(missing_ok=True)
        live = set()
        for p in self.root.glob("manifests/v*.json"):
            live |= {e["blob"] for e in json.loads(p.read_text())["tensors"].values()}
        for blob in self.root.glob("blobs/*.safetensors"):
            if blob.name not in live:
                blob.unlink(missing_ok=True)

    def _finish_pruning(self) -> None:
        if self._pruning is not None:
            try:
                self._pruning.result()
            except OSError as e:  # a leftover old file is harmless; the next prune retries
                log.warning("pruning old sync versions in %s failed: %s", self.root, e)
            self._pruning = None

    def close(self) -> None:
        self._finish_pruning()
        self._pruner.shutdown()


def _group_key(name: str) -> str:
    """A quantized weight and its companions (``_scale_inv``, ``_packed``, ...) share a key."""
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


class DiskReceiver:
    """Loads the newest complete version into an engine (only changed tensors in delta mode).
    ``secret``: accept only versions whose manifest the sender signed with it."""

    def __init__(self, directory: str | Path, *, secret: bytes | str | None = None) -> None:
        self.root = Path(directory)
        self.secret = auth.as_key(secret)
        self.version: int | None = None
        self._hashes: dict[str, int] = {}  # what the engine holds, by name

    def latest_version(self) -> int | None:
        return _read_latest(self.root)

    def poll(self, apply: ApplyFn, *, verify: bool = False) -> int | None:
        """Apply the newest version if it is newer than the last applied one; return it (or None).

        ``verify``: afterwards compare the engine's weights with the manifest's hashes; a mismatch
        raises `VerifyError` (the update was applied).
        """
        latest = self.latest_version()
        if latest is None or (self.version is not None and latest <= self.version):
            return None
        try:
            manifest = _open_manifest(self.secret, (self.root / "manifests" / f"v{latest}.json").read_text(), latest)
            named = self._load_changed(manifest, latest)
        except OSError as e:  # pruned under us by a fast sender: the next poll reads a newer version
            raise SyncError(f"disk sync v{latest}: could not read {e.filename}: {e.strerror}") from e
        report = call_apply(apply, named, latest, verify=verify)  # raises -> nothing recorded
        self._hashes.update({n: manifest[n]["hash"] for n, _ in named})
        self.version = latest
        if verify:
            check_reports({n: manifest[n]["hash"] for n, _ in named}, {"engine": report}, latest)
        return latest

    def _load_changed(self, manifest: dict[str, Any], version: int) -> list[tuple[str, torch.Tensor]]:
        stale = {_group_key(n) for n, e in manifest.items() if self._hashes.get(n) != e["hash"]}
        wanted: dict[str, list[str]] = {}
        for name, entry in manifest.items():
            if _group_key(name) in stale:
                wanted.setdefault(entry["blob"], []).append(name)
        named = []
        for blob, names in wanted.items():
            with safe_open(str(self.root / "blobs" / blob), framework="pt") as f:
                for n in names:
                    t = f.get_tensor(n)
                    if checksum(t) != manifest[n]["hash"]:
                        raise SyncError(
                            f"disk sync v{version}: tensor {n!r} in {blob} is corrupted (hash mismatch)"
                        )
                    named.append((n, t))
        return named
