"""LoRA through peft, and the policy's weights as HF-named full tensors (merged or adapter-only).

Adapters are injected into the LM in place (``peft.inject_adapter_in_model``), so the model keeps its
own class and every non-LoRA parameter keeps its HF name; a LoRA'd linear ``X`` holds
``X.base_layer.weight`` plus ``X.lora_A.default.weight`` / ``X.lora_B.default.weight``.

Merging follows peft's own arithmetic (``LoraLayer.get_delta_weight`` then ``merge``):
``W + (B @ A) * (alpha / rank)``, so a merged export equals ``merge_and_unload`` bit for bit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tandem.engines.training.fsdp.config import LoRAConfig

__all__ = ["adapters_disabled", "apply_lora", "frozen_base", "hf_tensors", "linear_module_names"]

ADAPTER = "default"  # peft's adapter name; adapters are saved without it (peft's file naming)
_BASE = ".base_layer."


def linear_module_names(model: nn.Module) -> list[str]:
    """Short names (last path component) of the linear layers LoRA can target, sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def apply_lora(lm: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Inject adapters into ``lm`` (in place) and freeze everything else; returns ``lm``.

    A target that names no linear layer raises ValueError listing the ones that exist. Call under
    one seed on every rank: ``lora_A`` starts random and all ranks must start from the same values.
    """
    from peft import LoraConfig, inject_adapter_in_model

    available = linear_module_names(lm)
    for target in cfg.target_modules:
        if target not in available:
            raise ValueError(
                f"LoRA target module {target!r} does not exist in the model; its linear layers are: "
                f"{', '.join(available)}"
            )
    peft_cfg = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    inject_adapter_in_model(peft_cfg, lm)
    for name, p in lm.named_parameters():
        p.requires_grad_(".lora_" in name)
    return lm


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    if "peft" not in sys.modules:  # no adapter exists before peft is loaded: spares a plain run its import
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its frozen base (the LoRA reference model); restores trainability after."""
    layers = _lora_layers(model)
    trainable = {id(p): p.requires_grad for p in model.parameters()}
    for layer in layers.values():
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers.values():
            layer.enable_adapters(True)
        for p in model.parameters():  # enable_adapters toggles requires_grad; keep the engine's choice
            p.requires_grad_(trainable[id(p)])


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    from tandem.engines.training.fsdp.qlora import QuantizedLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def _merged(layer: nn.Module, base: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    a = gather(layer.lora_A[ADAPTER].weight)
    b = gather(layer.lora_B[ADAPTER].weight)
    delta = (b @ a) * layer.scaling[ADAPTER]  # peft: transpose(B @ A, fan_in_fan_out) * scaling
    return base + delta.to(base.dtype)


def hf_tensors(
    lm: nn.Module,
    *,
    gather: Callable[[torch.Tensor], torch.Tensor],
    adapter_only: bool = False,
    skip_names: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` for every weight of ``lm``, in state-dict order.

    ``gather`` turns a (possibly sharded) tensor into the full one; under FSDP it is a collective, so
    every rank must drain this iterator. Tied weights appear once (under their first name). With LoRA
    the base weights come merged with their adapters, or, with ``adapter_only``, only the adapters
    under peft's file names (``base_model.model.<module>.lora_A.weight``).
    """
    layers = _lora_layers(lm)
    quantized = _quantized_layers(lm)
    seen: set[int] = set()
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) in seen or name in skip_names:
            continue
        seen.add(id(t))
        module, _, leaf = name.rpartition(".")
        if module in quantized:  # QLoRA: the base weight is its quantized tensors (one name per weight)
            if adapter_only or leaf != "q":
                continue
            owner = module.removesuffix(_BASE[:-1])
            full = quantized[module].dequantized()
            yield f"{owner}.weight", _merged(layers[owner], full, gather) if owner in layers else full
            continue
        if ".lora_" in name:
            if adapter_only:
                yield "base_model.model." + name.replace(f".{ADAPTER}.", "."), gather(t)
            continue
        if adapter_only:
            continue
        if _BASE not in name:
            yield name, gather(t)
            continue
        owner, _, leaf = name.partition(_BASE)
        full = gather(t)
        if leaf == "weight" and owner in layers:
            full = _merged(layers[owner], full, gather)
        yield f"{owner}.{leaf}", full


def frozen_base(lm: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, dict[str, torch.Tensor]]]]:
    """The frozen weights of a LoRA'd ``lm`` as they are held (no copy): ``(HF name, tensor)`` of every
    parameter or buffer that does not train (tied weights once), and ``(HF name of the weight, its quantized
    tensors as `tandem.kernels.state_dict.quantize_tensor` names them)`` for each QLoRA base layer. What a
    colocated engine may hold instead of copies (`TorchEngine.share_weights`)."""
    quantized = _quantized_layers(lm)
    plain, packed = [], []
    seen: set[int] = set()
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) in seen or ".lora_" in name or t.requires_grad:
            continue
        seen.add(id(t))
        module, _, leaf = name.rpartition(".")
        if module not in quantized:
            plain.append((name.replace(_BASE, "."), t.detach()))
        elif leaf == "bias":
            plain.append((f"{module.removesuffix(_BASE[:-1])}.bias", t.detach()))
    for module, layer in quantized.items():
        owner = module.removesuffix(_BASE[:-1])
        tensors = layer.quantized_tensors(f"{owner}.weight")
        packed.append((f"{owner}.weight", {n: t.detach() for n, t in tensors.items()}))
    return plain, packed
