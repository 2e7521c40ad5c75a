"""How the SGLang adapter moves weights into its servers: a safetensors folder on disk, or a broadcast.

`DiskUpdate` writes the tensors as one safetensors file (plus the model's ``config.json``: SGLang reloads
a model folder) and posts ``/update_weights_from_disk`` to every server. `BroadcastUpdate` makes this
process rank 0 of a process group with every server (``/init_weights_update_group``, rank ``1 + i`` for
server ``i``), then per update posts ``/update_weights_from_distributed`` (names, dtypes, shapes) to every
server while it broadcasts each tensor from rank 0 in that order: SGLang's protocol, with gloo on CPU.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tandem.engines.inference.sglang import protocol as P

__all__ = ["BroadcastUpdate", "DiskUpdate"]

Post = Callable[[str, str, dict[str, Any]], dict[str, Any]]  # (url, path, body) -> json; raises on failure


def _unshared(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """CPU contiguous tensors; tied weights (one storage, two names) copied, as safetensors refuses shared storage."""
    out, seen = {}, set()
    for name, t in items:
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


class DiskUpdate:
    def __init__(self, post: Post, urls: list[str], model_folder: Path, staging_dir: str | None) -> None:
        self.post, self.urls, self.model_folder = post, urls, model_folder
        shm = Path("/dev/shm")
        self.staging_dir = staging_dir or (str(shm) if shm.is_dir() else None)

    def send(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        folder = Path(tempfile.mkdtemp(prefix="tandem-sglang-update-", dir=self.staging_dir))
        try:
            save_file(_unshared(items), str(folder / "model.safetensors"))
            config = self.model_folder / "config.json"
            if config.is_file():
                shutil.copy(config, folder / "config.json")
            body = P.disk_update_body(str(folder), version)
            for url in self.urls:
                self.post(url, "/update_weights_from_disk", body)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        pass


class BroadcastUpdate:
    GROUP = "tandem_weight_update"

    def __init__(self, post: Post, urls: list[str], *, address: str, backend: str, timeout_s: float) -> None:
        self.post, self.urls, self.address, self.backend, self.timeout_s = post, urls, address, backend, timeout_s
        self._pg = None
        self._store = None

    def _connect(self) -> None:
        import torch.distributed as dist

        with socket.socket() as s:  # a free port for the store this rank hosts
            s.bind((self.address, 0))
            port = s.getsockname()[1]
        world = 1 + len(self.urls)
        self._store = dist.TCPStore(self.address, port, world, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout_s))
        bodies = [P.init_group_body(address=self.address, port=port, rank_offset=1 + i, world_size=world,
                                    group=self.GROUP, backend=self.backend) for i in range(len(self.urls))]
        errors = self._concurrently("/init_weights_update_group", bodies, lambda: self._make_pg(world))
        if errors:
            self._pg = None
            raise RuntimeError(f"init_weights_update_group failed: {errors[0]}")

    def _make_pg(self, world: int) -> None:
        import torch.distributed as dist

        store = dist.PrefixStore(f"sglang/{self.GROUP}/", self._store)
        if self.backend == "nccl":
            self._pg = dist.ProcessGroupNCCL(store, 0, world)
        else:
            self._pg = dist.ProcessGroupGloo(store, 0, world, timedelta(seconds=self.timeout_s))

    def send(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        import torch.distributed as dist

        if self._pg is None:
            self._connect()
        device = "cuda" if self.backend == "nccl" else "cpu"
        tensors = [(n, t.detach().to(device).contiguous()) for n, t in items]
        body = P.distributed_update_body([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                                         [list(t.shape) for _, t in tensors], group=self.GROUP, version=version)

        def broadcast() -> None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for _, t in tensors:
                self._pg.broadcast([t], opts).wait()

        errors = self._concurrently("/update_weights_from_distributed", [body] * len(self.urls), broadcast)
        if errors:
            raise errors[0]

    def _concurrently(self, path: str, bodies: list[dict[str, Any]], local: Callable[[], None]) -> list[Exception]:
        """Post ``bodies`` to the servers from threads while ``local`` (this rank's side) runs here."""
        errors: list[Exception] = []

        def call(url: str, body: dict[str, Any]) -> None:
            try:
                self.post(url, path, body)
            except Exception as e:  # noqa: BLE001 - reported after the collective
                errors.append(e)

        threads = [threading.Thread(target=call, args=(u, b), daemon=True) for u, b in zip(self.urls, bodies, strict=True)]
        for t in threads:
            t.start()
        try:
            local()
        except Exception as e:  # noqa: BLE001
            errors.append(RuntimeError(f"{path}: this rank's side failed: {e}"))
        for t in threads:
            t.join(self.timeout_s)
        return errors

    def close(self) -> None:
        if self._pg is not None:
            for url in self.urls:
                try:
                    self.post(url, "/destroy_weights_update_group", {"group_name": self.GROUP})
                except Exception:  # noqa: BLE001, S110 - best effort at shutdown
                    pass
        self._pg = self._store = None
