"""Trainer ranks of the end-to-end sync test: a 2-rank FSDP2 trainer (gloo) whose rank 0 sends.

`named_parameters_for_sync` is collective: every rank drains it and gets full tensors; only rank 0
hands them to a transport. After each sync rank 0 records the trainer's digest and the sender's
metrics, and waits for the engine process to report the version (``engine_v<version>.json``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, LoRAConfig, OptimizerConfig
from tandem.models import ModelConfig
from tandem.sync import checksum
from tests.engines.training.helpers import make_batch, token_mean_pg
from tests.sync.engine_worker import MODEL, build_engine, engine_digest, wait_for_file

BUCKET_BYTES = 64 * 1024  # several buckets per sync
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def trainer_engine(**overrides) -> FSDPEngine:
    return FSDPEngine(FSDPConfig(model=ModelConfig(name=MODEL), optimizer=OptimizerConfig(lr=1e-2), **overrides))


def train(engine: FSDPEngine, rank: int, world: int, seed: int) -> None:
    batch = make_batch(seed=seed)
    rows = list(range(rank, batch.batch_size, world))
    engine.train_step(batch.select(rows), token_mean_pg)


def trainer_digest(engine: FSDPEngine) -> dict[str, list[int]]:
    """Collective (every rank gathers): ``{name: [xxh3, bytes]}`` of the full tensors the trainer syncs."""
    return {
        n: [checksum(t), t.numel() * t.element_size()]
        for bucket in engine.named_parameters_for_sync(BUCKET_BYTES)
        for n, t in bucket
    }


def sync(engine: FSDPEngine, rank: int, sender, version: int) -> dict[str, float]:
    buckets = engine.named_parameters_for_sync(BUCKET_BYTES)
    if rank == 0:
        return sender.send(buckets, version)
    for _ in buckets:  # the other ranks take part in the gathers and drop the tensors
        pass
    return {}


class EngineActor:
    """A Ray actor hosting a real engine (decorated with ray.remote at run time)."""

    def __init__(self) -> None:
        from tandem.sync import WeightApplier

        torch.set_num_threads(1)
        self.engine = build_engine()
        self.applier = WeightApplier(self.engine)

    def receive_weights(self, refs, headers, version, verify=False):
        from tandem.sync.ray_store import receive_from_refs

        return receive_from_refs(refs, headers, version, self.applier, verify=verify)

    def state(self):
        return {"weight_version": self.engine.weight_version, "digest": engine_digest(self.engine)}


def _ray_sync(engine: FSDPEngine, rank: int, version: int) -> dict:
    """Rank 0 starts a local Ray, puts an engine in an actor and syncs it (``version``); then kills
    the actor and syncs again (``version + 1``), which must fail. The other ranks only gather."""
    if rank != 0:
        sync(engine, rank, None, version)
        sync(engine, rank, None, version + 1)
        return {}
    import ray

    from tandem.sync import SyncError
    from tandem.sync.ray_store import RaySender

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        actor = ray.remote(num_cpus=0)(EngineActor).remote()
        sender = RaySender([actor], verify=True)
        before = ray.get(actor.state.remote())
        metrics = sync(engine, rank, sender, version)
        after = ray.get(actor.state.remote())
        ray.kill(actor)
        _wait_until_dead(ray, actor)
        try:
            sync(engine, rank, sender, version + 1)
            dead = "no error"
        except SyncError as e:
            dead = str(e)
        return {"before": before, "after": after, "metrics": metrics, "dead_actor_error": dead}
    finally:
        ray.shutdown()


def _wait_until_dead(ray, actor, timeout_s: float = 30) -> None:
    """``ray.kill`` is asynchronous: wait until calls to the actor fail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.state.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise TimeoutError("the killed actor still answers")


def trainer_main(rank: int, world: int, out_dir: str, port: int, disk_dir: str, use_ray: bool) -> None:
    from tandem.sync.broadcast import BroadcastSender
    from tandem.sync.disk import DiskSender

    out = Path(out_dir)
    records: dict[str, dict] = {}
    full = trainer_engine()
    broadcast = BroadcastSender(num_receivers=1, port=port, timeout_s=60, verify=True) if rank == 0 else None
    disk = DiskSender(disk_dir, delta=True) if rank == 0 else None

    def record(engine: FSDPEngine, version: int, metrics: dict) -> None:
        digest = trainer_digest(engine)
        if rank == 0:
            engine_state = wait_for_file(out / f"engine_v{version}.json")
            records[str(version)] = {"trainer": digest, "engine": engine_state, "metrics": metrics}

    train(full, rank, world, seed=0)
    record(full, 1, sync(full, rank, broadcast, 1))  # broadcast, with verify
    train(full, rank, world, seed=1)
    record(full, 2, sync(full, rank, disk, 2))  # disk: the first version is written whole
    record(full, 3, sync(full, rank, disk, 3))  # disk delta, nothing changed: nothing written
    lora = trainer_engine(lora=LORA)  # merged LoRA weights (the default)
    train(lora, rank, world, seed=2)
    record(lora, 4, sync(lora, rank, disk, 4))  # everything differs from the full fine-tune
    train(lora, rank, world, seed=3)
    record(lora, 5, sync(lora, rank, disk, 5))  # only the adapted projections changed
    if use_ray:
        ray_result = _ray_sync(full, rank, 6)
        digest = trainer_digest(full)
        if rank == 0:
            records["ray"] = {**ray_result, "trainer": digest}
    if rank == 0:
        broadcast.close()
        (out / "trainer.json").write_text(json.dumps(records))

