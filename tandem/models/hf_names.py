"""HF weight names as the checkpoint on disk has them, for models whose loading converts weights.

transformers 5 converts some checkpoints while loading them: a MoE layer's per-expert ``gate_proj`` /
``up_proj`` / ``down_proj`` weights (``mlp.experts.{e}.gate_proj.weight`` ...) become one fused parameter per
layer (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``). The model's state dict then
names weights that no checkpoint has, while every engine that loads a model folder (vLLM, SGLang, the
embedded engine) knows the checkpoint's names. A weight sync must speak the checkpoint's: `checkpoint_named`
undoes the load-time conversion one tensor at a time, with transformers' own reversal (the one
``save_pretrained`` applies), so a fused tensor goes out as the per-expert tensors it was built from.

Tandem's native models and models without such conversions pass through unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["checkpoint_named", "converts_weights"]


def converts_weights(lm: nn.Module) -> bool:
    """Whether ``lm`` is an HF model whose state-dict names differ from its checkpoint's."""
    # an HF model exists only once transformers' modeling module is loaded: asking first spares a process
    # that runs the native model importing it (~0.4 s, scipy included) just to answer no
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return False
    return isinstance(lm, modeling.PreTrainedModel) and bool(getattr(lm, "_weight_conversions", None))


def checkpoint_named(lm: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``lm``'s state dict -> the same weights under the checkpoint's names
    (a fused tensor becomes the tensors it was fused from). Lazy: one input tensor at a time."""
    if not converts_weights(lm):
        yield from named
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named:
        yield from revert_weight_conversion(lm, {name: tensor}).items()
