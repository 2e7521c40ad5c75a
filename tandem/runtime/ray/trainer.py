"""The trainer as a Ray actor group: one actor per rank, one torch.distributed group, one facade.

`TrainerRank` builds the run's training engine (any registered one) inside an actor. Rank 0 picks a free
port on its node and the driver hands that address to every rank: the ranks rendezvous through Ray,
not a fixed port, and form one process group (gloo on CPU, NCCL on GPU). `RayTrainerGroup` is what the
loop holds: it satisfies `TrainingEngine` by putting the global batch in the object store once and
letting every rank train on its own rows (``engine.local_rows``), so the loop is the same one that runs
in one process. Weights never reach the driver on the training path: rank 0 publishes them to the
object store (``publish``) and the replicas fetch them from there.

A rank that dies fails the call with `TrainerGroupError`; the run then rebuilds the group and resumes
from its last checkpoint (``runtime.max_trainer_restarts``, tandem/runtime/loop.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tandem.core.batch import TrainBatch
from tandem.core.protocols import EngineInfo, LogProbOutput, LossFn
from tandem.engines.registry import EngineSpec
from tandem.runtime.config import RayConfig
from tandem.runtime.ray import import_ray
from tandem.runtime.ray.cluster import Placement, actor_threads

__all__ = ["Published", "RayTrainerGroup", "TrainerGroupError", "TrainerRank"]


class TrainerGroupError(RuntimeError):
    """A trainer rank died or failed; the group's state is lost past the last checkpoint."""


@dataclass(frozen=True, slots=True)
class Published:
    """One weight version in the object store: flat bucket refs (owned by rank 0) and their headers."""

    version: int
    refs: list[Any]
    headers: list[str]
    nbytes: int
    hashes: dict[str, int] | None = None  # per-tensor digests, with sync.verify


class TrainerRank:
    """One rank (the actor class; `RayTrainerGroup` decorates it)."""

    def __init__(self, spec: EngineSpec, rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.spec, self.rank, self.world = spec, rank, world
        self.engine: Any = None

    def node(self) -> str:
        return import_ray().get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        """A free port on this node for the group's rendezvous (asked of rank 0)."""
        ray = import_ray()
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, init_method: str | None, backend: str) -> EngineInfo:
        if self.world > 1:
            import torch.distributed as dist

            os.environ.update({"WORLD_SIZE": str(self.world), "RANK": str(self.rank), "LOCAL_RANK": "0"})
            dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world)
        self.engine = self.spec.build()
        return self.engine.info

    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool, model: str) -> tuple[list[int], LogProbOutput]:
        rows = self.engine.local_rows(batch)
        return rows, self.engine.forward_logprobs(batch.select(rows), with_entropy=with_entropy, model=model)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, model: str) -> dict[str, float]:
        return self.engine.train_step(batch.select(self.engine.local_rows(batch)), loss_fn, model=model)

    def publish(self, version: int, bucket_bytes: int, verify: bool) -> Published | None:
        """Every rank drains the (collective) iterator; rank 0 puts each flat bucket in the object store."""
        from tandem.sync.base import flatten_bucket, tensor_hashes

        ray = import_ray()
        refs, headers, nbytes, hashes = [], [], 0, {}
        for bucket in self.engine.named_parameters_for_sync(bucket_bytes):
            if self.rank != 0:
                continue
            cpu = [(n, t.detach().cpu()) for n, t in bucket]
            flat, header = flatten_bucket(cpu)
            refs.append(ray.put(flat.numpy()))
            headers.append(header.to_json())
            nbytes += flat.numel()
            if verify:
                hashes.update(tensor_hashes(cpu))
        return Published(version, refs, headers, nbytes, hashes if verify else None) if self.rank == 0 else None

    def call(self, method: str, *args: Any) -> Any:
        """save / load / sleep / wake_up / step on this rank's engine."""
        if method not in ("save", "load", "sleep", "wake_up", "step"):
            raise ValueError(f"unknown trainer method {method!r}")
        attr = getattr(self.engine, method)
        return attr if method == "step" else attr(*args)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RayTrainerGroup:
    """The loop's training engine under ``runtime.placement: ray`` (module docstring)."""

    def __init__(self, spec: EngineSpec, placement: Placement, cfg: RayConfig) -> None:
        self.ray = import_ray()
        self.cfg, self.world = cfg, cfg.trainer_ranks
        actor = self.ray.remote(max_restarts=0, max_task_retries=0)(TrainerRank)
        self.actors = []
        for rank in range(self.world):
            slot = placement.trainer_slot(rank)
            self.actors.append(actor.options(**placement.options(slot)).remote(
                spec, rank, self.world, actor_threads(cfg, slot)))
        cuda = placement.trainer_gpus > 0
        init = None
        if self.world > 1:
            host, port = self._get(self.actors[0].address.remote(), what="rendezvous address")
            init = f"tcp://{host}:{port}"
        infos = self._get([a.setup.remote(init, "nccl" if cuda else "gloo") for a in self.actors], what="setup",
                          timeout_s=cfg.start_timeout_s)
        self._info: EngineInfo = infos[0]
        self._step = 0

    # -- TrainingEngine ------------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def step(self) -> int:
        return self._step

    def local_rows(self, batch: TrainBatch) -> list[int]:
        return list(range(batch.batch_size))  # the group as a whole works on the global batch

    def forward_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False, model: str = "policy") -> LogProbOutput:
        ref = self.ray.put(batch)
        parts = self._get([a.forward_logprobs.remote(ref, with_entropy, model) for a in self.actors],
                          what="forward_logprobs")
        width = int(batch.loss_mask.shape[1])
        out = {k: torch.zeros(batch.batch_size, width) for k in ("log_probs", "entropy", "values")}
        present = set()
        for rows, o in parts:
            index = torch.as_tensor(rows, dtype=torch.long)
            for k in out:
                value = getattr(o, k)
                if value is not None and len(rows):
                    out[k][index, : value.shape[1]] = value
                    present.add(k)
        return LogProbOutput(log_probs=out["log_probs"], entropy=out["entropy"] if "entropy" in present else None,
                             values=out["values"] if "values" in present else None)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, model: str = "policy") -> dict[str, float]:
        ref = self.ray.put(batch)
        metrics = self._get([a.train_step.remote(ref, loss_fn, model) for a in self.actors], what="train_step")
        if model == "policy":
            self._step += 1
        return metrics[0]  # every rank reports the global metrics

    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights through the driver (for inspection and tests; a run's sync uses `publish`)."""
        from tandem.sync.base import BucketHeader, unflatten_bucket

        published = self.publish(-1, bucket_bytes)
        for ref, header in zip(published.refs, published.headers, strict=True):
            flat = torch.from_numpy(self.ray.get(ref).copy())
            yield list(unflatten_bucket(flat, BucketHeader.from_json(header)))

    def publish(self, version: int, bucket_bytes: int, *, verify: bool = False) -> Published:
        results = self._get([a.publish.remote(version, bucket_bytes, verify) for a in self.actors], what="publish")
        return results[0]

    def save(self, path: str) -> None:
        self._all("save", os.path.abspath(path))

    def load(self, path: str) -> None:
        self._all("load", os.path.abspath(path))
        self._step = int(self._get(self.actors[0].call.remote("step"), what="step"))

    def sleep(self) -> None:
        self._all("sleep")

    def wake_up(self) -> None:
        self._all("wake_up")

    def close(self) -> None:
        """Close every rank (its process group too) and end the actors; idempotent."""
        actors, self.actors = self.actors, []
        if not actors:
            return
        try:
            self.ray.get([a.close.remote() for a in actors], timeout=30)
        except Exception:  # noqa: BLE001 - a dead rank has nothing left to close
            pass
        for a in actors:
            self.ray.kill(a)

    def kill_rank(self, rank: int) -> None:
        """End one rank's actor (fault injection in tests and benchmarks)."""
        self.ray.kill(self.actors[rank])

    def nodes(self) -> list[str]:
        """The Ray node id of every rank."""
        return self._get([a.node.remote() for a in self.actors], what="node")

    # -- helpers ---------------------------------------------------------------------------------------------

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._get([a.call.remote(method, *args) for a in self.actors], what=method)

    def _get(self, refs: Any, *, what: str, timeout_s: float | None = None) -> Any:
        try:
            return self.ray.get(refs, timeout=timeout_s)
        except self.ray.exceptions.RayActorError as e:
            raise TrainerGroupError(f"a trainer rank died during {what}: {e}") from e
        except self.ray.exceptions.GetTimeoutError as e:
            raise TrainerGroupError(f"the trainer group did not answer {what} within {timeout_s:.0f}s") from e
