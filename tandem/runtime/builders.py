"""Build the components of a run from its config; each gets its own section and nothing else.

Engines are imported here, lazily, only for the engine a run asks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tandem.core.schedulers import lr_multiplier
from tandem.plugins import Registry
from tandem.rollout.generate import single_turn
from tandem.runtime.config import RunConfig

__all__ = ["GENERATE_FUNCTIONS", "build_inference_engine", "build_training_engine", "resolve_generate"]

# A generate function: (engine, prompts, *, n, sampling, tokenizer, seed, step, first_group,
# routed_experts) -> list[Sample]. Built-ins by name; user functions by import path.
GENERATE_FUNCTIONS: Registry = Registry("generate function", required_params=2)
GENERATE_FUNCTIONS.register("single_turn")(single_turn)


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


def build_inference_engine(cfg: RunConfig):
    if cfg.inference.engine != "torch":
        raise ValueError(f"inference.engine={cfg.inference.engine!r} is not available (choose: torch)")
    from tandem.engines.inference.torch import TorchEngine

    return TorchEngine(torch_engine_config(cfg))
