"""Tandem: PyTorch-native RL post-training for LLMs.

Importing ``tandem`` is cheap and imports no engine (vllm, sglang, megatron, ray, cupy): adapters
import their engine when they are built. It bounds oneDNN's shape caches (below) unless the environment
already does.
"""

import os as _os

__version__ = "0.1.0"

# oneDNN's shape caches (ideep's descriptors per thread, oneDNN's primitives) hold one ~0.6 MiB entry per
# product shape, row count included, up to 1,024 each: an engine whose batches vary grew by hundreds of MiB.
# Both read these variables at their first use; a value already in the environment wins. Why 64 and what
# it measured: tandem/ops/linear.py, "Bounded shape caches".
ONEDNN_CACHE_CAPACITY = 64
for _var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    _os.environ.setdefault(_var, str(ONEDNN_CACHE_CAPACITY))
del _var
