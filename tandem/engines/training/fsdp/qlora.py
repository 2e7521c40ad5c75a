"""QLoRA: the frozen base of a LoRA run stored quantized (FP8 block, MXFP8 or INT4, `tandem.kernels`).

``trainer.fsdp.lora.quantize_base`` (a `tandem.kernels.QuantConfig`) replaces each targeted linear
layer's full-precision weight by its quantized tensors (codes and scales, as buffers: 1 byte per weight
for FP8, half a byte for INT4). Every forward dequantizes the weight, uses it and drops it; the backward
(the gradient of the input, for the adapters and the layers below) dequantizes it again instead of
keeping it, so no full-precision copy of the base lives between the two. Only the adapters train, so
the optimizer holds state for them alone.

The dequantized weight is ``dequantize(quantize(w))``, bit for bit what the embedded engine serves with
``inference.torch.quantization`` set to the same config (`tandem.kernels.DequantizeOnLoad`): with
adapter-only sync the rollout log-probs still equal the trainer's exactly (deterministic mode).

Targets follow the config's ``target_modules`` / ``exclude_modules`` (`tandem.kernels.qat_targets`);
the output projection never is one (log-probs read its weight directly). Buffers are not sharded by
FSDP: each rank holds the whole quantized base (a quarter of an fp32 copy for FP8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import QuantConfig, qat_targets
from tandem.kernels.state_dict import dequantize_tensor, quantize_tensor

__all__ = ["QuantizedLinear", "quantize_base"]


class _DequantizedLinear(torch.autograd.Function):
    """``F.linear(x, dequantize(base))``; the backward dequantizes again (nothing but ``layer`` is kept)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized(), layer.bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.layer.dequantized()
        return grad @ w.to(grad.dtype), None


class QuantizedLinear(nn.Module):
    """A frozen linear layer holding its weight quantized; computes with ``dequantize(quantize(w))``."""

    def __init__(self, linear: nn.Linear, cfg: QuantConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self._names: dict[str, str] = {}  # buffer -> the tensor name `dequantize_tensor` expects
        for name, t in quantize_tensor("weight", linear.weight.detach(), cfg):
            buffer = "q" + name.removeprefix("weight")
            self.register_buffer(buffer, t.contiguous())
            self._names[buffer] = name
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def quantized_tensors(self, name: str = "weight") -> dict[str, torch.Tensor]:
        """The weight's quantized tensors (the buffers themselves) as `quantize_tensor(name, ...)` names them."""
        return {name + n.removeprefix("weight"): getattr(self, b) for b, n in self._names.items()}

    def dequantized(self) -> torch.Tensor:
        return dequantize_tensor("weight", self.quantized_tensors(), self.cfg, self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a fresh tensor: for merging and export, not for training)."""
        return self.dequantized()

    @property
    def quantized_bytes(self) -> int:
        return sum(getattr(self, b).numel() * getattr(self, b).element_size() for b in self._names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedLinear.apply(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.cfg.format}"


class _NamedView(nn.Module):
    """Modules under the names given (qat_targets looks at module names: show it the HF ones). Not a class
    made per call: a class is its own reference cycle, and one whose method closed over the modules kept every
    replaced float weight alive until the cyclic garbage collector ran (SmolLM2: ~400 MiB through the build)."""

    def __init__(self, named: dict[str, nn.Module]) -> None:
        super().__init__()
        self._named = named

    def named_modules(self, *args, **kwargs):
        return iter(self._named.items())


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


@torch.no_grad()
def quantize_base(lm: nn.Module, cfg: QuantConfig, *, output_module: str | None, deferred=None) -> list[str]:
    """Replace the targeted linears of ``lm`` (already LoRA-injected or not) by `QuantizedLinear`, in place;
    a LoRA'd layer keeps its adapters and gets a quantized ``base_layer``. Returns the targeted names
    (their HF names, without peft's ``base_layer``). Call before sharding. ``deferred``: the model's matrices
    are on the meta device (`fsdp.deferred.DeferredWeights`): each target's weight is read right before it is
    quantized, so the model never exists in full precision (the rest is read later, as it is sharded)."""
    plain = {n.replace(".base_layer", ""): m for n, m in lm.named_modules() if isinstance(m, nn.Linear)
             and ".lora_" not in n}
    targets = qat_targets(_NamedView(plain), cfg, output_module=output_module)
    del plain  # the float weights it names go as each layer is replaced
    if deferred is not None:
        deferred.track(lm)
    for hf_name in targets:
        wrapped = lm.get_submodule(hf_name)
        if deferred is not None:
            deferred.materialize(wrapped)
        if hasattr(wrapped, "base_layer"):  # a LoraLinear (fsdp/lora.py)
            wrapped.base_layer = QuantizedLinear(wrapped.base_layer, cfg)
        else:
            _set(lm, hf_name, QuantizedLinear(wrapped, cfg))
    return targets
