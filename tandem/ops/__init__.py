"""Numerical building blocks shared by the inference and training engines (batch-invariant mode)."""

from tandem.ops.batch_invariant import (
    KEY_TILE,
    InvariantSharedPrefixAttention,
    InvariantVarlenAttention,
    batch_invariant_mode,
    invariant_attention,
    invariant_linear,
    is_batch_invariant,
    packed_attention,
)
from tandem.ops.linear import fast_linear, fast_linear_mode

__all__ = [
    "KEY_TILE",
    "InvariantSharedPrefixAttention",
    "InvariantVarlenAttention",
    "batch_invariant_mode",
    "fast_linear",
    "fast_linear_mode",
    "invariant_attention",
    "invariant_linear",
    "is_batch_invariant",
    "packed_attention",
]
