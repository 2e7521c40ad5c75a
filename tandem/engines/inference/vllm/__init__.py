"""The vLLM inference adapter (satisfies tandem.core.protocols.InferenceEngine); vLLM is imported lazily.

``import tandem.engines.inference.vllm`` works without vLLM installed; building a `VLLMEngine` without
it raises ImportError naming the install command.
"""

from tandem.engines.inference.vllm.config import VLLMEngineConfig

__all__ = ["SleepNotSupportedError", "VLLMEngine", "VLLMEngineConfig", "vllm_available"]


def __getattr__(name: str):
    if name in ("VLLMEngine", "SleepNotSupportedError", "vllm_available"):
        from tandem.engines.inference.vllm import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
