"""`RayPlacement`: what a run holds under ``runtime.placement: ray``.

It joins (or starts) Ray, places one bundle per trainer rank and per replica, starts the replicas (they
load the model while the trainer group forms), and puts the replicas behind a `Router`. Weight sync:
trainer rank 0 puts the flat buckets of a version in the object store once (`RayTrainerGroup.publish`)
and every replica fetches them concurrently (Ray moves objects between nodes by itself), so the sync
time grows sub-linearly with the replica count. The latest version's refs are kept: a replica that Ray
restarted (at version 0) is re-synced from them by the router before it takes traffic again. A replica
that is down during a sync does not fail the run (even if every replica is): it stays below the
router's ``min_version``, serves nothing, and is re-synced when it is back. A live replica that refuses
an update (a real error) fails the sync.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tandem.engines.registry import EngineSpec
from tandem.runtime.config import RunConfig
from tandem.runtime.ray import import_ray
from tandem.runtime.ray.cluster import Placement, actor_threads, connect
from tandem.runtime.ray.replica import RayReplicaClient, make_replica
from tandem.runtime.ray.trainer import Published, RayTrainerGroup
from tandem.sync.base import SyncError, sync_metrics

__all__ = ["RayPlacement"]

log = logging.getLogger(__name__)


class RayPlacement:
    """The run's Ray actors: ``trainer`` (a `RayTrainerGroup`) and ``router`` (the replicas)."""

    def __init__(self, cfg: RunConfig, *, trainer_gpus: float = 0.0, engine_gpus: float = 0.0,
                 with_trainer: bool = True) -> None:
        """Join (or start) Ray and place the run's bundles (GPU counts: ``ray.*_gpus``, else what the
        engines' entries say their configs need); `start` then starts the actors."""
        self.ray = import_ray()
        self.cfg = cfg
        self.started = connect(cfg.ray)
        self.placement: Placement | None = None
        self.trainer: RayTrainerGroup | None = None
        self.trainer_spec: EngineSpec | None = None
        self.router: Any = None
        self.clients: list[RayReplicaClient] = []
        self.published: Published | None = None
        self.replica_info = None
        self.trainer_restarts = 0
        try:
            self.placement = Placement(cfg.ray, replicas=cfg.inference.replicas, trainer_gpus=trainer_gpus,
                                       engine_gpus=engine_gpus, with_trainer=with_trainer)
        except BaseException:
            self.close()
            raise

    def start(self, *, trainer_spec: EngineSpec | None, engine_spec: EngineSpec) -> None:
        """The replicas (loading the model) and, meanwhile, the trainer group (none: replicas only, for
        ``tandem serve``); then the router."""
        from tandem.runtime.router import Router, RouterConfig

        cfg = self.cfg
        self.trainer_spec = trainer_spec
        try:
            replica = make_replica(cfg.ray.max_replica_restarts)
            handles = []
            for i in range(cfg.inference.replicas):
                slot = self.placement.replica_slot(i)
                handles.append(replica.options(**self.placement.options(slot)).remote(
                    engine_spec, i, actor_threads(cfg.ray, slot)))
            self.clients = [RayReplicaClient(h, f"replica{i}") for i, h in enumerate(handles)]
            if trainer_spec is not None:  # while the replicas load
                self.trainer = RayTrainerGroup(trainer_spec, self.placement, cfg.ray)
            infos = self.ray.get([h.info.remote() for h in handles], timeout=cfg.ray.start_timeout_s)
            self.replica_info = infos[0]  # the engine's own (weight capabilities: the sync reaches it directly)
            self.router = Router(self.clients, info=infos[0], config=RouterConfig(), resync=self._resync)
        except BaseException:
            self.close()
            raise

    # -- weight sync ------------------------------------------------------------------------------------

    def push_weights(self, version: int) -> dict[str, float]:
        """Publish the trainer's weights as ``version`` and bring every live replica to it."""
        sync = self.cfg.sync
        t0 = time.perf_counter()
        published = self.trainer.publish(version, sync.bucket_bytes, verify=sync.verify)
        self.published = published  # the previous version's objects are released with their refs
        calls = {c.name: c.handle.receive_weights.remote([published.refs], published.headers, version, sync.verify)
                 for c in self.clients}
        reports, down = {}, []
        for name, ref in calls.items():
            try:
                reports[name] = self.ray.get(ref, timeout=sync.timeout_s)
            except self.ray.exceptions.RayTaskError as e:  # the replica is alive and refused the update
                raise SyncError(f"weight sync to version {version}: {name} rejected the update: {e}") from e
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
                # down (restarting) now: the router re-syncs it from the kept objects before it serves again
                down.append(name)
                log.warning("weight sync to version %d: %s is down (%s); it is re-synced when it is back",
                            version, name, type(e).__name__)
        for name in reports:
            self.router.note_weight_version(name, version)
        self.router.min_version = version
        extra: dict[str, float] = {"replicas": float(len(reports)), "replicas_down": float(len(down))}
        if sync.verify:
            from tandem.sync.verify import check_reports

            extra |= check_reports(published.hashes or {}, {n: r.get("report") for n, r in reports.items()}, version)
        return sync_metrics(published.nbytes, time.perf_counter() - t0, **extra)

    def _resync(self, client: RayReplicaClient, version: int) -> None:
        """The router's callback: bring a (restarted) replica to ``version`` from the kept objects."""
        p = self.published
        if p is None or p.version < version:
            if version == 0:  # nothing trained yet: a fresh replica already holds version 0's weights
                return
            raise SyncError(f"no published weights for version {version} to re-sync {client.name} with")
        client.receive(p.refs, p.headers, p.version, timeout_s=self.cfg.sync.timeout_s)
        log.info("%s re-synced to weight version %d", client.name, p.version)

    # -- supervision -------------------------------------------------------------------------------------

    def rebuild_trainer(self) -> RayTrainerGroup:
        """A fresh trainer group in the same bundles (the old one's actors are ended)."""
        if self.trainer is not None:
            self.trainer.close()
        self.published = None  # its objects belonged to the dead rank 0
        self.trainer = RayTrainerGroup(self.trainer_spec, self.placement, self.cfg.ray)
        self.trainer_restarts += 1
        return self.trainer

    def metrics(self) -> dict[str, float]:
        out = self.router.metrics() if self.router is not None else {}
        return out | {"ray/trainer_restarts": float(self.trainer_restarts)}

    def close(self) -> None:
        """End every actor and the placement group (and Ray, if this run started it); idempotent."""
        router, self.router = self.router, None
        if router is not None:
            router.close()
        else:
            for c in self.clients:
                c.close()
        self.clients = []
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            trainer.close()
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
            self.started = False
