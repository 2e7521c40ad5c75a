"""LoRA in peft's layout, and the policy's weights as HF-named full tensors (merged or adapter-only).

Adapters are injected into the LM in place (`apply_lora`), so the model keeps its own class and every
non-LoRA parameter keeps its HF name; a LoRA'd linear ``X`` holds ``X.base_layer.weight`` plus
``X.lora_A.default.weight`` / ``X.lora_B.default.weight``, peft's names, so an adapter-only export loads in
peft, vLLM and SGLang. The layer is Tandem's own (`LoraLinear`), with peft's arithmetic: importing peft pulls
in transformers' modeling code (~116 MiB resident and seconds of start-up in every trainer process).

Merging follows peft's arithmetic (``LoraLayer.get_delta_weight`` then ``merge``):
``W + (B @ A) * (alpha / rank)``, so a merged export equals ``merge_and_unload`` bit for bit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tandem.engines.training.fsdp.config import LoRAConfig

__all__ = ["LoraLinear", "adapters_disabled", "apply_lora", "frozen_base", "hf_tensors", "linear_module_names"]

ADAPTER = "default"  # peft's adapter name; adapters are saved without it (peft's file naming)
_BASE = ".base_layer."


class LoraLinear(nn.Module):
    """``base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / rank``, peft's vanilla LoRA linear layer.

    Same parameter names, initialisation (``lora_A`` Kaiming-uniform with ``a = sqrt(5)``, drawn in the same
    order from the global generator, ``lora_B`` zero), dtype (the base weight's) and forward as peft's
    ``lora.Linear`` with its defaults (no DoRA, no rsLoRA, no bias on ``lora_B``): tests/engines/training/
    test_lora_layer.py checks them bit for bit against peft's. ``enable_adapters(False)`` runs the base alone."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()})
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(self.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(rank, self.out_features, bias=False)})
        self.scaling = {ADAPTER: alpha / rank}
        nn.init.kaiming_uniform_(self.lora_A[ADAPTER].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[ADAPTER].weight)
        w = base_layer.weight
        dtype = w.dtype if w.dtype.is_floating_point else None  # peft never casts adapters to an integer dtype
        for d in (self.lora_A, self.lora_B):  # a base on the meta device (read later, fsdp/deferred.py): host
            d[ADAPTER] = d[ADAPTER].to(dtype=dtype) if w.is_meta else d[ADAPTER].to(w.device, dtype=dtype)
        self.adapters_enabled = True

    def enable_adapters(self, enabled: bool) -> None:
        self.adapters_enabled = bool(enabled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if not self.adapters_enabled:
            return result
        a, b = self.lora_A[ADAPTER], self.lora_B[ADAPTER]
        x = x if x.dtype == a.weight.dtype else x.to(a.weight.dtype)
        out_dtype = result.dtype
        return (result + b(a(self.lora_dropout[ADAPTER](x))) * self.scaling[ADAPTER]).to(out_dtype)

    def extra_repr(self) -> str:
        return f"rank={self.lora_A[ADAPTER].out_features}, scaling={self.scaling[ADAPTER]}"


def linear_module_names(model: nn.Module) -> list[str]:
    """Short names (last path component) of the linear layers LoRA can target, sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def apply_lora(lm: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Inject adapters into ``lm`` (in place) and freeze everything else; returns ``lm``.

    Every linear layer whose short name is a target gets a `LoraLinear`, in module order (as peft does, so
    the same seed draws the same ``lora_A``). A target that names no linear layer raises ValueError listing
    the ones that exist. Call under one seed on every rank: all ranks must start from the same values.
    """
    available = linear_module_names(lm)
    for target in cfg.target_modules:
        if target not in available:
            raise ValueError(
                f"LoRA target module {target!r} does not exist in the model; its linear layers are: "
                f"{', '.join(available)}"
            )
    targets = set(cfg.target_modules)
    chosen = [(name, m) for name, m in lm.named_modules()
              if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
    for name, m in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = lm.get_submodule(parent_name) if parent_name else lm
        setattr(parent, leaf, LoraLinear(m, cfg.rank, cfg.alpha, cfg.dropout))
    for name, p in lm.named_parameters():
        p.requires_grad_(".lora_" in name)
    return lm


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


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
