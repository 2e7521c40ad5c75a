"""The run config: the tree of component configs that a recipe fills.

Each section is owned by the component that reads it; the runtime hands every component its own
section and nothing else. Sections are added here as their components land.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.models.registry import ModelConfig


@dataclass(kw_only=True, slots=True)
class RunMetaConfig:
    """Where a run writes and how it is seeded."""

    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run: RunMetaConfig = field(default_factory=RunMetaConfig)
    model: ModelConfig
