"""Build the components of a run from its config; each gets its own section and nothing else.

Engines are imported here, lazily, only for the engine a run asks for. The placement decides where the
inference engine runs: in the trainer's process (``colocated``, synced in-process) or in a process of
its own (``separate``: a `RemoteEngine`, synced by broadcast or disk); `check_placement` refuses a
transport that does not fit. A later placement (Ray actor groups) adds a branch to `build_separate`'s
caller: it gets the same `EngineSpec`, and its engine actors host an `EngineServer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tandem.config import ConfigError
from tandem.core.schedulers import lr_multiplier
from tandem.plugins import Registry
from tandem.rollout.agent import agentic_tool_call, multi_turn
from tandem.rollout.generate import single_turn
from tandem.runtime.config import RunConfig
from tandem.runtime.remote_engine import EngineSpec, RemoteEngine
from tandem.sync import build_sender

__all__ = [
    "GENERATE_FUNCTIONS",
    "build_inference_engine",
    "build_separate",
    "build_training_engine",
    "check_placement",
    "inference_engine_spec",
    "resolve_generate",
]

# A generate function: (engine, prompts, *, n, sampling, tokenizer, seed, step, first_group,
# routed_experts) -> list[Sample]. Built-ins by name; user functions by import path.
GENERATE_FUNCTIONS: Registry = Registry("generate function", required_params=2)
GENERATE_FUNCTIONS.register("single_turn")(single_turn)
GENERATE_FUNCTIONS.register("multi_turn")(multi_turn)  # rollout.agent settings (docs/agentic.md)
GENERATE_FUNCTIONS.register("agentic_tool_call")(agentic_tool_call)


def resolve_generate(name: str) -> Callable[..., Any]:
    return GENERATE_FUNCTIONS.resolve(name)


def fsdp_config(cfg: RunConfig):
    from tandem.engines.training.fsdp.config import CriticConfig, FSDPConfig, RefConfig

    fc = cfg.trainer.fsdp or FSDPConfig(model=cfg.model)
    # The trainer scores tokens with the rollout's temperature: the shared log-prob convention.
    changes: dict[str, Any] = {"seed": cfg.run.seed, "temperature": cfg.rollout.sampling.temperature or 1.0}
    if fc.model is None:
        changes["model"] = cfg.model
    if cfg.algorithm.needs_ref and fc.ref is None:
        changes["ref"] = RefConfig()
    if cfg.algorithm.needs_critic and fc.critic is None:
        changes["critic"] = CriticConfig()
    if cfg.sync.lora_mode == "adapter" and fc.lora is not None:
        changes["lora"] = dataclasses.replace(fc.lora, sync="adapter")
    return dataclasses.replace(fc, **changes)


def torch_engine_config(cfg: RunConfig):
    from tandem.engines.inference.torch.config import TorchEngineConfig

    ec = cfg.inference.torch or TorchEngineConfig(model=cfg.model)
    # A run never needs slots longer than its longest prompt + response: size the KV cache for it.
    changes: dict[str, Any] = {"seed": cfg.run.seed, "max_model_len": min(ec.max_model_len, _run_context(cfg))}
    if ec.model is None:
        changes["model"] = cfg.model
    return dataclasses.replace(ec, **changes)


def vllm_engine_config(cfg: RunConfig):
    """The vLLM adapter's section with the run's model, seed and context; refuses what it cannot serve."""
    from tandem.engines.inference.vllm.config import VLLMEngineConfig

    fsdp = cfg.trainer.fsdp
    unsupported = {  # setting -> why the vLLM adapter cannot honour it
        "rollout.recompute_log_probs": (cfg.rollout.recompute_log_probs, "it has no prefill score()"),
        "trainer.fsdp.routing_replay": (getattr(fsdp, "routing_replay", False), "vLLM returns no routed experts"),
        "sync.delta": (cfg.sync.delta, "vLLM reloads whole layers, so it needs full updates"),
    }
    for name, (on, why) in unsupported.items():
        if on:
            raise ConfigError(
                f"{name}: true does not work with inference.engine: vllm ({why}); use inference.engine: torch"
            )
    ec = cfg.inference.vllm or VLLMEngineConfig(model=cfg.model)
    changes: dict[str, Any] = {"seed": cfg.run.seed, "max_model_len": min(ec.max_model_len, _run_context(cfg))}
    if ec.model is None:
        changes["model"] = cfg.model
    lora = getattr(fsdp, "lora", None)
    if cfg.sync.lora_mode == "adapter" and lora is not None and ec.lora_alpha is None:
        # adapter-only sync: vLLM serves the trainer's adapter with the trainer's scaling
        changes |= {"lora_alpha": lora.alpha, "lora_max_rank": max(ec.lora_max_rank, lora.rank)}
    return dataclasses.replace(ec, **changes)


def _run_context(cfg: RunConfig) -> int:
    """The longest sequence this run can produce, capped at the model's context."""
    from transformers import AutoConfig

    from tandem.models import resolve_model

    limit = AutoConfig.from_pretrained(str(resolve_model(cfg.model.name))).max_position_embeddings
    return min(cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens, limit)


def megatron_config(cfg: RunConfig):
    from tandem.engines.training.megatron.config import MegatronConfig, MegatronRefConfig

    mc = cfg.trainer.megatron or MegatronConfig(model=cfg.model)
    if cfg.algorithm.needs_critic:
        raise ValueError("trainer.engine=megatron has no critic; use trainer.engine=fsdp for PPO with a value model")
    changes: dict[str, Any] = {"seed": cfg.run.seed, "temperature": cfg.rollout.sampling.temperature or 1.0}
    if mc.model is None:
        changes["model"] = cfg.model
    if cfg.algorithm.needs_ref and mc.ref is None:
        changes["ref"] = MegatronRefConfig()
    return dataclasses.replace(mc, **changes)


def build_training_engine(cfg: RunConfig):
    schedule = cfg.algorithm.lr_schedule
    lr_lambda = lambda step: lr_multiplier(step, schedule)  # noqa: E731
    if cfg.trainer.engine == "megatron":
        from tandem.engines.training.megatron import MegatronEngine

        return MegatronEngine(megatron_config(cfg), lr_lambda=lr_lambda)
    from tandem.engines.training.fsdp import FSDPEngine

    return FSDPEngine(fsdp_config(cfg), lr_lambda=lr_lambda)


def inference_engine_spec(cfg: RunConfig) -> EngineSpec:
    """What builds the run's inference engine, in this process or another one."""
    if cfg.inference.engine == "vllm":
        return EngineSpec(factory="tandem.engines.inference.vllm.engine:VLLMEngine",
                          config=vllm_engine_config(cfg))
    if cfg.inference.engine != "torch":
        raise ValueError(f"inference.engine={cfg.inference.engine!r} is not available (choose: torch, vllm)")
    return EngineSpec(factory="tandem.engines.inference.torch:TorchEngine", config=torch_engine_config(cfg))


def build_inference_engine(cfg: RunConfig):
    """The engine in this process (colocated placement)."""
    return inference_engine_spec(cfg).build()


# The transports that can reach the engine in each placement.
PLACEMENT_TRANSPORTS = {"colocated": ("inprocess",), "separate": ("broadcast", "disk")}


def check_placement(cfg: RunConfig) -> None:
    """Refuse a sync transport that cannot reach the engine where ``runtime.placement`` puts it."""
    placement, transport = cfg.runtime.placement, cfg.sync.transport
    allowed = PLACEMENT_TRANSPORTS[placement]
    if transport not in allowed:
        where = ("the engine shares the trainer's process" if placement == "colocated"
                 else "the engine runs in its own process")
        raise ConfigError(
            f"sync.transport={transport!r} does not fit runtime.placement={placement!r} ({where}): "
            f"use sync.transport: {' or '.join(allowed)}"
            + (", or runtime.placement: separate" if placement == "colocated" and transport in ("broadcast", "disk")
               else "")
        )
    if placement == "separate" and cfg.sync.num_receivers != 1:
        raise ConfigError(
            f"sync.num_receivers={cfg.sync.num_receivers}: runtime.placement='separate' runs one engine process "
            "(sync.num_receivers: 1)"
        )


def build_separate(cfg: RunConfig):
    """``(RemoteEngine, sender)`` for the separate placement. The sender comes first: a broadcast
    sender hosts the rendezvous on a free port, which the engine process is then told."""
    sender = build_sender(cfg.sync)
    engine_sync = cfg.sync
    if cfg.sync.transport == "broadcast":
        inner = getattr(sender, "sender", sender)  # under a quantize-on-send wrapper
        engine_sync = dataclasses.replace(cfg.sync, host=inner.host, port=inner.port)
    try:
        return RemoteEngine(inference_engine_spec(cfg), sync=engine_sync), sender
    except BaseException:
        sender.close()
        raise
