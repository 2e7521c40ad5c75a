"""Learning-rate schedules and KL-coefficient schedules / controllers.

LR: a multiplier of the optimizer's base learning rate per optimizer step (``LambdaLR``): optional
linear warm-up, then constant, cosine or linear decay to ``min_lr_ratio``.

KL coefficient: ``fixed`` (the KL config's ``coef``), ``linear`` / ``cosine`` from ``coef`` to
``final_coef`` over ``steps``, or ``adaptive``: the proportional controller of Ziegler et al. 2019
("Fine-Tuning Language Models from Human Preferences", eq. in section 2.2), as in verl and TRL's PPO:
``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "KLController",
    "KLScheduleConfig",
    "LRScheduleConfig",
    "build_lr_scheduler",
    "lr_multiplier",
]


@dataclass(kw_only=True, slots=True)
class LRScheduleConfig:
    """Shape of the learning rate over optimizer steps (the base LR belongs to the optimizer)."""

    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0  # linear ramp; step s < warmup_steps gets (s + 1) / warmup_steps
    total_steps: int | None = None  # needed by cosine / linear: the step at which decay ends
    min_lr_ratio: float = 0.0  # the multiplier reached at total_steps

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.kind != "constant":
            if self.total_steps is None:
                raise ValueError(f"kind={self.kind!r} needs total_steps (the step where the decay ends)")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(f"total_steps={self.total_steps} must be > warmup_steps={self.warmup_steps}")


def lr_multiplier(step: int, cfg: LRScheduleConfig) -> float:
    """The LR multiplier at optimizer step ``step`` (0-based). Never 0 during warm-up's first step."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    assert cfg.total_steps is not None  # checked in __post_init__
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    if cfg.kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying `lr_multiplier`; call ``scheduler.step()`` after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


@dataclass(kw_only=True, slots=True)
class KLScheduleConfig:
    """How the KL coefficient moves over training steps (its start value is ``KLConfig.coef``)."""

    kind: Literal["fixed", "linear", "cosine", "adaptive"] = "fixed"
    final_coef: float = 0.0  # linear / cosine: the value reached after `steps`
    steps: int = 0  # linear / cosine: length of the schedule in training steps
    target_kl: float = 0.1  # adaptive: the KL the controller steers towards (verl default)
    horizon: int = 10_000  # adaptive: larger = slower reaction (verl / Ziegler et al. default)

    def __post_init__(self) -> None:
        if self.final_coef < 0:
            raise ValueError(f"final_coef={self.final_coef} must be >= 0")
        if self.kind in ("linear", "cosine") and self.steps <= 0:
            raise ValueError(f"kind={self.kind!r} needs steps > 0, got steps={self.steps}")
        if self.target_kl <= 0:
            raise ValueError(f"target_kl={self.target_kl} must be > 0")
        if self.horizon <= 0:
            raise ValueError(f"horizon={self.horizon} must be > 0")


class KLController:
    """The KL coefficient of the current step; ``update`` advances it after each training step.

    ``value`` is what the loss / reward uses now. ``update(current_kl=...)`` feeds the adaptive
    controller the measured KL of the step just taken; the schedules only need the step count.
    ``state_dict`` / ``load_state_dict`` make it checkpointable.
    """

    def __init__(self, init_coef: float, cfg: KLScheduleConfig) -> None:
        if init_coef < 0:
            raise ValueError(f"KL coef={init_coef} must be >= 0")
        self.cfg = cfg
        self.init_coef = float(init_coef)
        self.value = float(init_coef)
        self.step = 0

    def coef_at(self, step: int) -> float:
        """The scheduled coefficient at ``step`` (``fixed`` / ``linear`` / ``cosine`` only)."""
        cfg = self.cfg
        if cfg.kind in ("fixed", "adaptive"):
            return self.init_coef
        progress = min(1.0, max(0, step) / cfg.steps)
        if cfg.kind == "linear":
            w = progress
        else:
            w = 0.5 * (1.0 - math.cos(math.pi * progress))
        return self.init_coef + (cfg.final_coef - self.init_coef) * w

    def update(self, *, current_kl: float | None = None, n_steps: int = 1) -> float:
        """Advance by ``n_steps`` training steps; returns the new ``value``.

        ``adaptive`` needs ``current_kl`` (the mean per-token KL measured this step); a non-finite one
        raises, since it would poison the coefficient for the rest of the run.
        """
        if n_steps < 0:
            raise ValueError(f"n_steps={n_steps} must be >= 0")
        self.step += n_steps
        if self.cfg.kind == "adaptive":
            if current_kl is None:
                raise ValueError("the adaptive KL controller needs current_kl at each update")
            if not math.isfinite(current_kl):
                raise ValueError(f"current_kl={current_kl} is not finite")
            error = min(0.2, max(-0.2, current_kl / self.cfg.target_kl - 1.0))
            self.value *= 1.0 + error * n_steps / self.cfg.horizon
        else:
            self.value = self.coef_at(self.step)
        return self.value

    def state_dict(self) -> dict[str, float | int]:
        return {"value": self.value, "step": self.step}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.value = float(state["value"])
        self.step = int(state["step"])
