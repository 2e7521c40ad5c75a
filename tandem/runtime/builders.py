"""Build the components of a run from its config; each gets its own section and nothing else.

Engines are looked up in the engine registry (`tandem.engines.registry`): a run's ``trainer.engine``
and ``inference.engine`` name an entry (or give its import path), whose ``fill`` completes the engine's
own section from the run's facts and whose capabilities decide what the run may ask of it. Nothing here
names a particular engine. `plan_engines` does that once, at start-up, before anything is built, and
refuses a setting an engine cannot honour with the setting and the reason; `check_built` repeats the
capability check against the built engines' ``info`` (e.g. a sleep mode that exists only on GPUs).

The placement decides where the inference engine runs: in the trainer's process (``colocated``, synced
in-process) or in a process of its own (``separate``: a `RemoteEngine`, synced by broadcast or disk);
`check_placement` refuses a transport that does not fit. Both build from the same `EngineSpec`.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from pathlib import Path
from typing import Any

from tandem.config import ConfigError
from tandem.core.protocols import EngineInfo
from tandem.core.schedulers import lr_multiplier
from tandem.engines.registry import EngineEntry, EngineSpec, RunFacts, Unsupported
from tandem.plugins import PluginError
from tandem.rollout.functions import GenerateFunction, resolve_generate
from tandem.runtime.config import RunConfig
from tandem.runtime.policy import shares_frozen_base
from tandem.runtime.remote_engine import RemoteEngine
from tandem.sync import build_sender
from tandem.sync.inprocess import frozen_base

__all__ = [
    "EnginePlan",
    "build_inference_engine",
    "build_separate",
    "build_training_engine",
    "check_built",
    "check_placement",
    "check_rollout",
    "inference_engine_spec",
    "plan_engines",
    "ray_gpus",
    "resolve_generate",
    "run_facts",
    "training_engine_spec",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EnginePlan:
    """The run's two engines: their entries, filled configs and the facts they were filled from."""

    trainer: EngineEntry
    trainer_config: Any
    engine: EngineEntry
    engine_config: Any
    facts: RunFacts  # with the trainer's facts merged in


def run_facts(cfg: RunConfig) -> RunFacts:
    """What the engine entries may read off the run (before the trainer's own facts are merged in)."""
    alg = cfg.algorithm
    return RunFacts(
        model=cfg.model, seed=cfg.run.seed, max_context=_run_context(cfg),
        rollout_batch=cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt,
        replicas=cfg.inference.replicas,
        temperature=cfg.rollout.sampling.temperature or 1.0, mode=cfg.runtime.mode,
        placement=cfg.runtime.placement, needs_ref=alg.needs_ref, needs_critic=alg.needs_critic,
        recompute_log_probs=cfg.rollout.recompute_log_probs, adapter_sync=cfg.sync.lora_mode == "adapter",
        delta_sync=cfg.sync.delta, verify_sync=cfg.sync.verify, speculative=cfg.rollout.speculative,
    )


def _run_context(cfg: RunConfig) -> int:
    """The longest sequence this run can produce, capped at the model's context."""
    from tandem.models import resolve_model
    from tandem.models.hf_config import read_hf_config

    limit = read_hf_config(resolve_model(cfg.model.name)).max_position_embeddings
    return min(cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens, limit)


def plan_engines(cfg: RunConfig) -> EnginePlan:
    """Both engines' configs, filled from the run; `ConfigError` for a setting an engine cannot honour."""
    try:
        trainer = cfg.trainer.entry
        engine = cfg.inference.entry
        facts = run_facts(cfg)
        trainer_config = trainer.configure(facts, cfg.trainer.config)
        if trainer.describe is not None:
            facts = facts.with_trainer(trainer.describe(trainer_config))
        engine_config = engine.configure(facts, cfg.inference.config)
    except (Unsupported, PluginError) as e:
        raise ConfigError(str(e)) from None
    return EnginePlan(trainer=trainer, trainer_config=trainer_config, engine=engine, engine_config=engine_config,
                      facts=facts)


def training_engine_spec(cfg: RunConfig, plan: EnginePlan | None = None) -> EngineSpec:
    """What builds the run's training engine (a picklable LR schedule, for ranks in other processes)."""
    plan = plan or plan_engines(cfg)
    lr_lambda = functools.partial(lr_multiplier, cfg=cfg.algorithm.lr_schedule)
    return plan.trainer.spec(plan.trainer_config, lr_lambda=lr_lambda)


def inference_engine_spec(cfg: RunConfig, plan: EnginePlan | None = None) -> EngineSpec:
    """What builds the run's inference engine, in this process or another one."""
    plan = plan or plan_engines(cfg)
    return plan.engine.spec(plan.engine_config)


def build_training_engine(cfg: RunConfig, plan: EnginePlan | None = None):
    return _build(training_engine_spec(cfg, plan), (plan or plan_engines(cfg)).trainer)


def build_inference_engine(cfg: RunConfig, plan: EnginePlan | None = None, *, trainer: Any = None):
    """The engine in this process (colocated placement). ``trainer``: the run's, in this process; where the run
    shares a LoRA base (`shares_frozen_base`) and the engine's entry ``takes_base``, the engine is built on the
    trainer's frozen base (`tandem.sync.inprocess.frozen_base`) instead of reading its own copy
    (`tandem.sync.inprocess.share_frozen_base` then shares what is left)."""
    plan = plan or plan_engines(cfg)
    spec = inference_engine_spec(cfg, plan)
    base = frozen_base(trainer) if trainer is not None and plan.engine.takes_base and shares_frozen_base(cfg) else None
    if base is not None:
        spec = dataclasses.replace(spec, kwargs={**spec.kwargs, "base": base})
    return _build(spec, plan.engine)


def _build(spec: EngineSpec, entry: EngineEntry):
    try:
        return spec.build()
    except ImportError as e:
        if entry.install is None:
            raise
        raise ImportError(f"{entry.kind} engine {entry.name!r} needs a package that is not installed ({e}); "
                          f"{entry.install}") from e


def ray_gpus(cfg: RunConfig, plan: EnginePlan) -> dict[str, float]:
    """GPUs per trainer-rank and per replica bundle: ``ray.*_gpus``, else the engine entries' own count."""
    return {"trainer_gpus": plan.trainer.bundle_gpus(plan.trainer_config, cfg.ray.trainer_gpus),
            "engine_gpus": plan.engine.bundle_gpus(plan.engine_config, cfg.ray.engine_gpus)}


def check_built(plan: EnginePlan, trainer_info: EngineInfo, engine_info: EngineInfo) -> None:
    """Refuse the run if a built engine lacks a capability the run needs (its ``info`` is authoritative)."""
    try:
        plan.trainer.check_capabilities(plan.trainer.requirements(plan.facts), trainer_info)
        plan.engine.check_capabilities(plan.engine.requirements(plan.facts), engine_info)
    except Unsupported as e:
        raise ConfigError(str(e)) from None
    if trainer_info.routed_experts and not engine_info.moe:
        raise ConfigError(f"the trainer replays routed experts (R3) but {engine_info.name} serves a dense model")


def check_rollout(cfg: RunConfig) -> GenerateFunction:
    """The run's generate function, resolved now (an import path is imported: user code)."""
    try:
        return resolve_generate(cfg.rollout.generate)
    except PluginError as e:
        raise ConfigError(f"rollout.generate: {e}") from None


# The transports that can reach the engine in each placement.
PLACEMENT_TRANSPORTS = {"colocated": ("inprocess",), "separate": ("broadcast", "disk"), "ray": ("ray",)}


def check_load_dump(cfg: RunConfig) -> None:
    """``--debug-train-only DIR`` (``rollout.load_dump``) needs a folder of rollout dumps: refused at start-up."""
    folder = cfg.rollout.load_dump
    if folder and not any(Path(folder).glob("step_*.jsonl")):
        raise FileNotFoundError(f"--debug-train-only {folder}: no rollout dump there (step_0.jsonl, ... are written "
                                "by a run with rollout.dump: true)")


def check_placement(cfg: RunConfig) -> None:
    """Refuse a sync transport that cannot reach the engine where ``runtime.placement`` puts it."""
    placement, transport = cfg.runtime.placement, cfg.sync.transport
    allowed = PLACEMENT_TRANSPORTS[placement]
    if transport not in allowed:
        where = {"colocated": "the engine shares the trainer's process",
                 "separate": "the engine runs in its own process",
                 "ray": "the replicas are Ray actors, synced through the object store"}[placement]
        raise ConfigError(
            f"sync.transport={transport!r} does not fit runtime.placement={placement!r} ({where}): "
            f"use sync.transport: {' or '.join(allowed)}"
            + (", or runtime.placement: separate" if placement == "colocated" and transport in ("broadcast", "disk")
               else "")
        )
    if placement == "ray":
        unsupported = {  # setting -> why the ray placement cannot honour it (yet)
            "rollout.recompute_log_probs": (cfg.rollout.recompute_log_probs,
                                            "the router does not route score() to the replicas"),
            "sync.quantize": (cfg.sync.quantize is not None, "the object-store sync sends full-precision weights"),
        }
        for name, (on, why) in unsupported.items():
            if on:
                raise ConfigError(f"{name} does not work with runtime.placement: ray ({why}); use runtime.placement: "
                                  "colocated or separate")
    if placement == "separate" and cfg.sync.num_receivers != 1:
        raise ConfigError(
            f"sync.num_receivers={cfg.sync.num_receivers}: runtime.placement='separate' runs one engine process "
            "(sync.num_receivers: 1)"
        )


def build_separate(cfg: RunConfig, plan: EnginePlan | None = None):
    """``(RemoteEngine, sender)`` for the separate placement. The sender comes first: a broadcast
    sender hosts the rendezvous on a free port, which the engine process is then told.

    Sender and engine share a secret (``sync.secret``, else ``$TANDEM_SYNC_SECRET``, else a random one
    for this run): the engine process gets it with its spec over its private connection, never on a
    command line or in a file."""
    spec = inference_engine_spec(cfg, plan)
    secret = cfg.sync.resolved_secret() or secrets.token_hex(32)
    sender = build_sender(cfg.sync)
    inner = getattr(sender, "sender", sender)  # under a quantize-on-send wrapper
    inner.secret = secret.encode()  # before the first send (build_sender takes no secret)
    engine_sync = dataclasses.replace(cfg.sync, secret=secret)
    if cfg.sync.transport == "broadcast":
        engine_sync = dataclasses.replace(engine_sync, host=inner.host, port=inner.port)
    try:
        return RemoteEngine(spec, sync=engine_sync), sender
    except BaseException:
        sender.close()
        raise
