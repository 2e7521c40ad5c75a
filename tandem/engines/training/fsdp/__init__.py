"""The FSDP2 training engine (default): sharded training on CPU (gloo) or GPU (NCCL), or one process."""

from tandem.engines.training.fsdp.config import (
    CriticConfig,
    FSDPConfig,
    LoRAConfig,
    OptimizerConfig,
    ParallelConfig,
    RefConfig,
)
from tandem.engines.training.fsdp.engine import FSDPEngine

__all__ = [
    "CriticConfig",
    "FSDPConfig",
    "FSDPEngine",
    "LoRAConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RefConfig",
]
