"""The Megatron-core training engine: tensor, pipeline, expert and data parallelism behind the same
`TrainingEngine` protocol as the FSDP engine. megatron-core is imported when an engine is built, so
importing this package needs only the base install (``pip install 'tandem-rl[megatron]'`` adds it)."""

from tandem.engines.training.megatron.config import (
    LoRAConfig,
    MegatronConfig,
    MegatronParallelConfig,
    MegatronRefConfig,
    OptimizerConfig,
)
from tandem.engines.training.megatron.engine import MegatronEngine

__all__ = [
    "LoRAConfig",
    "MegatronConfig",
    "MegatronEngine",
    "MegatronParallelConfig",
    "MegatronRefConfig",
    "OptimizerConfig",
]
