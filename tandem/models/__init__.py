"""Model loading without a hub: a registry of named models and local HF folders."""

from tandem.models.registry import (
    ModelConfig,
    ModelNotFoundError,
    cache_dir,
    list_models,
    load_model,
    load_tokenizer,
    resolve_model,
)

__all__ = [
    "ModelConfig",
    "ModelNotFoundError",
    "cache_dir",
    "list_models",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
