"""The embedded torch inference engine: continuous batching with a KV cache on CPU or CUDA."""

from tandem.engines.inference.torch.config import TorchEngineConfig
from tandem.engines.inference.torch.engine import EngineAsleepError, TorchEngine

__all__ = ["EngineAsleepError", "TorchEngine", "TorchEngineConfig"]
