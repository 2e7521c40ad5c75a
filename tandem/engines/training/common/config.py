"""Configuration shared by every training engine: the optimizer section of a recipe.

Each engine's config (``FSDPConfig``, ``MegatronConfig``) embeds this one unchanged, so a recipe switches
engines without touching its ``optimizer`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OptimizerConfig"]


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW and gradient clipping. ``grad_clip <= 0`` disables clipping (the norm is still reported)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
