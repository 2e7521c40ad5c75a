"""Joining (or starting) Ray and placing the run's actors: one placement group for the whole run.

Bundles: one per trainer rank, then (``disaggregated``) one per inference replica; in the ``colocated``
layout replica ``i`` shares trainer rank ``i % ranks``'s bundle (they take turns: the replica sleeps
while the trainer trains). Inside a bundle an actor asks for a share of the bundle's resources, so two
actors of one bundle fit it. A placement group that Ray cannot place within ``start_timeout_s`` fails the
run with the bundles asked for and what the cluster has.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from tandem.runtime.config import RayConfig
from tandem.runtime.ray import import_ray

__all__ = ["ActorSlot", "Placement", "connect"]

log = logging.getLogger(__name__)


def connect(cfg: RayConfig) -> bool:
    """Join ``cfg.address`` or start a local Ray; True if this run started it (and must shut it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": cfg.namespace, "log_to_driver": True, "include_dashboard": False}
    # actors import the same code as the driver: the folder holding the tandem package, and the working
    # directory for user plug-ins named by import path
    paths = [p for p in {os.getcwd(), _package_root()} if p]
    kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}}
    if cfg.address is None:
        ray.init(num_cpus=cfg.num_cpus, **kwargs)
        return True
    ray.init(address=cfg.address, **kwargs)
    return False


def _package_root() -> str:
    import tandem

    return os.path.dirname(os.path.dirname(os.path.abspath(tandem.__file__)))


@dataclass(frozen=True, slots=True)
class ActorSlot:
    """Where one actor goes: its bundle and the resources it asks for there."""

    bundle: int
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


class Placement:
    """The run's placement group and the slot of every trainer rank and replica."""

    def __init__(self, cfg: RayConfig, *, replicas: int, trainer_gpus: float, engine_gpus: float,
                 with_trainer: bool = True) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group

        self.cfg, self.replicas = cfg, replicas
        self.trainer_gpus = trainer_gpus
        ranks = cfg.trainer_ranks if with_trainer else 0  # replicas only: tandem serve
        trainer = _bundle(cfg.trainer_cpus, trainer_gpus, cfg.trainer_resources, "trainer")
        if cfg.layout == "colocated" and ranks:
            share = max(1, -(-replicas // ranks))  # replicas per trainer bundle
            engine = {k: v / (share + 1) for k, v in trainer.items()}
            self.bundles = [dict(trainer) for _ in range(ranks)]
            self._trainer = [_slot(i, {k: v / (share + 1) for k, v in trainer.items()}) for i in range(ranks)]
            self._replicas = [_slot(i % ranks, engine) for i in range(replicas)]
        else:
            engine = _bundle(cfg.engine_cpus, engine_gpus, cfg.engine_resources, "engine")
            self.bundles = [dict(trainer) for _ in range(ranks)] + [dict(engine) for _ in range(replicas)]
            self._trainer = [_slot(i, trainer) for i in range(ranks)]
            self._replicas = [_slot(ranks + i, engine) for i in range(replicas)]
        _check_fits(self.bundles, ray.cluster_resources(), cfg.strategy)
        self.group = placement_group(self.bundles, strategy=cfg.strategy)
        try:
            ray.get(self.group.ready(), timeout=cfg.start_timeout_s)
        except Exception as e:
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(
                f"Ray could not place the run's bundles {self.bundles} (strategy {cfg.strategy}) within "
                f"{cfg.start_timeout_s:.0f}s: the cluster has {ray.cluster_resources()}; lower the ray.* bundle "
                "sizes, trainer_ranks or inference.replicas, or add nodes"
            ) from e

    def trainer_slot(self, rank: int) -> ActorSlot:
        return self._trainer[rank]

    def replica_slot(self, index: int) -> ActorSlot:
        return self._replicas[index]

    def options(self, slot: ActorSlot) -> dict[str, Any]:
        """Ray actor options that put an actor in ``slot``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus, "resources": slot.resources,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=slot.bundle)}

    def remove(self) -> None:
        ray = import_ray()
        try:
            ray.util.remove_placement_group(self.group)
        except Exception as e:  # noqa: BLE001 - Ray already gone (shut down): nothing left to remove
            log.debug("placement group removal: %s", e)


def _check_fits(bundles: list[dict[str, float]], cluster: dict[str, float], strategy: str) -> None:
    """Fail now, not after ``start_timeout_s``, when the cluster's total resources cannot hold the bundles
    (a cluster that autoscales would have to grow first: raise its minimum size instead)."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    short = {k: (v, cluster.get(k, 0.0)) for k, v in need.items() if v > cluster.get(k, 0.0) + 1e-9}
    if short:
        what = ", ".join(f"{k}: {v:g} needed, {have:g} in the cluster" for k, (v, have) in short.items())
        raise RuntimeError(f"the run's bundles {bundles} (strategy {strategy}) do not fit the Ray cluster ({what}); "
                           "lower ray.trainer_cpus / ray.engine_cpus (they are Ray's logical CPUs), "
                           "ray.trainer_ranks or inference.replicas, or add nodes")


def _bundle(cpus: float, gpus: float, resources: dict[str, float], kind: str) -> dict[str, float]:
    out = {"CPU": float(cpus)} if cpus else {}
    if gpus:
        out["GPU"] = float(gpus)
    out |= {k: float(v) for k, v in resources.items()}
    if not any(out.values()):
        raise ValueError(f"a {kind} bundle needs some resource: set ray.{kind}_cpus, ray.{kind}_gpus or "
                         f"ray.{kind}_resources above 0")
    return out


def _slot(bundle: int, request: dict[str, float]) -> ActorSlot:
    rest = {k: v for k, v in request.items() if k not in ("CPU", "GPU")}
    return ActorSlot(bundle=bundle, num_cpus=request.get("CPU", 0.0), num_gpus=request.get("GPU", 0.0), resources=rest)


def actor_threads(cfg: RayConfig, slot: ActorSlot) -> int:
    """Torch intra-op threads for an actor in ``slot`` (``ray.torch_threads``, else its CPU share)."""
    return cfg.torch_threads or max(1, int(slot.num_cpus))
