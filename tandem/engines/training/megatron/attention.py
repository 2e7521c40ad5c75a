"""Scaled-dot-product attention as the core attention of Megatron's local layer spec.

Megatron's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores and their softmax
(``baddbmm``, softmax, ``bmm``) and keeps the probabilities for the backward: memory quadratic in the
sequence, ~1 GiB per layer for one 8k-token sequence of 4 heads in float32. `SDPAttention` computes the
same function with ``torch.nn.functional.scaled_dot_product_attention``, whose fused kernels (CPU flash
attention, and flash / memory-efficient attention on CUDA) keep neither: memory linear in the sequence.
It is a subclass, so the module tree, parameters and checkpoints are Megatron's; the TransformerEngine
spec keeps TE's own fused attention.

The engine's masks are causal (``pad_micro_batch``: right padding needs no padding mask); with this
attention it passes none, which SDPA takes as ``is_causal``. A mask tensor is checked once per tensor:
the causal one becomes ``is_causal`` too, any other is passed on as is.
What SDPA cannot express the same way falls back to Megatron's forward: attention dropout while training
(Megatron draws it from its CUDA RNG tracker), query-key layer scaling, sliding windows, softmax offsets,
packed sequences and attention biases.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

__all__ = ["sdpa_attention", "use_sdpa"]


def _causal(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether ``mask`` (True = masked out) is exactly the causal mask of an ``sq x sk`` square."""
    if sq != sk or mask.shape[-2:] != (sq, sk) or any(d != 1 for d in mask.shape[:-2]):
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return bool(torch.equal(mask.reshape(sq, sk).bool(), causal))


@functools.cache
def sdpa_attention() -> type:
    """The `SDPAttention` class (built on first use: megatron-core is imported lazily)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """``DotProductAttention`` computed by ``F.scaled_dot_product_attention`` (see the module docstring)."""

        _checked: tuple | None = None  # (weak ref to the last mask seen, its version, causal?)

        def _mask_is_causal(self, mask: torch.Tensor, sq: int, sk: int) -> bool:
            # every layer of a micro-batch sees the same mask tensor: check it once
            key = self._checked
            if key is None or key[0]() is not mask or key[1] != mask._version:
                key = self._checked = (weakref.ref(mask), mask._version, _causal(mask, sq, sk))
            return key[2]

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            cfg = self.config
            dropout = self.attention_dropout.p if self.training else 0.0
            if (packed_seq_params is not None or attention_bias is not None or dropout > 0
                    or cfg.apply_query_key_layer_scaling or self.softmax_offset is not None
                    or self.scale_mask_softmax.window_size is not None):
                if attention_mask is None:  # Megatron builds its default causal mask on CUDA only
                    s = query.shape[0]
                    attention_mask = torch.ones(s, s, dtype=torch.bool, device=query.device).triu_(1)[None, None]
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            sq, b, heads, _ = query.shape
            sk, groups = key.shape[0], key.shape[2]
            if heads != groups:  # GQA: as Megatron does (SDPA's enable_gqa may leave the fused kernels)
                key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
            mask, causal = None, False
            if attention_mask is None:
                causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and sq > 1
            elif self._mask_is_causal(attention_mask, sq, sk):
                causal = True
            else:
                mask = ~attention_mask.bool()  # SDPA's boolean mask: True = attend
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)  # [sq, b, hp]

    return SDPAttention


def use_sdpa(block) -> None:
    """Swap the core attention of every standard self-attention layer in ``block`` (Megatron's local
    ``TransformerBlockSubmodules``) for `SDPAttention`, in place; other layers (MLA) keep theirs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for layer in block.layer_specs:
        attention = getattr(layer.submodules, "self_attention", None)
        sub = getattr(attention, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = sdpa_attention()
