"""Quantize-on-send and dequantize-on-load of HF-named weights, with the names checkpoints use.

For a targeted tensor ``<name>`` (``<module>.weight``, or a fused ``[E, N, K]`` expert tensor):

====================  ==============================================================================
format                tensors produced
====================  ==============================================================================
``fp8_block``         ``<name>`` float8_e4m3fn ``[..., N, K]``; ``<name>_scale_inv`` fp32
                      ``[..., ceil(N/bn), ceil(K/bk)]`` (SGLang/vLLM block-FP8, DeepSeek-V3 layout)
``mxfp8``             ``<name>`` float8_e4m3fn; ``<name>_scale`` uint8 E8M0 ``[..., N, ceil(K/32)]``
``int4_sym/asym``     ``<name>_packed`` uint8 ``[..., N, ceil(K/2)]``; ``<name>_scale`` fp32
                      ``[..., N, ceil(K/g)]``; ``<name>_zero_point`` uint8 (asym only);
                      ``<name>_shape`` int64 (the compressed-tensors names)
====================  ==============================================================================

Every other tensor passes through untouched. The trainer's fake-quant forward (`tandem.kernels.qat`)
uses the same op, so ``dequantize_state_dict(quantize_state_dict(w))`` equals its weight bit for bit.

Each weight `dequantize_state_dict` returns carries its provenance (`dequantized_grid`): an engine that
quantizes on load itself (`tandem.kernels.load`) keeps such a tensor as it is instead of quantizing
it again. Quantizing twice is not always a no-op: a second int4_asym pass moved ~9% (fp32) / ~5%
(bf16) of the elements of a random 1024 x 1024 weight off the first pass's bits (its zero point is
recomputed from a shifted range); fp8_block, mxfp8 and int4_sym changed none there, which is measured,
not proven.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from tandem.kernels.config import QuantConfig
from tandem.kernels.fp8 import dequantize_fp8_block, quantize_fp8_block
from tandem.kernels.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from tandem.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8

__all__ = [
    "companion_names",
    "dequantize_state_dict",
    "dequantize_tensor",
    "dequantized_grid",
    "find_quantized",
    "grid_key",
    "iter_quantized",
    "quantize_state_dict",
    "quantize_tensor",
]

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
FP8_DTYPE = torch.float8_e4m3fn
COMPANION_SUFFIXES = ("_scale_inv", "_scale", "_zero_point", "_shape", "_packed")
_GRID_ATTR = "_tandem_dequantized_grid"  # set on the tensor objects dequantize_state_dict returns


def _items(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    return named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors


def grid_key(cfg: QuantConfig) -> tuple:
    """The settings that decide a quantized weight's bits (not which modules, nor the backend)."""
    return (cfg.format, tuple(cfg.block_size), cfg.group_size, cfg.scale)


def dequantized_grid(tensor: torch.Tensor) -> tuple | None:
    """`grid_key` of the config whose `dequantize_state_dict` returned this very tensor object, else None.

    The mark lives on the Python object: a copy, cast, view or a tensor from another process has none.
    """
    return getattr(tensor, _GRID_ATTR, None)


def find_quantized(named_tensors: NamedTensors) -> str | None:
    """The name of a tensor only a quantized state dict holds (fp8 codes, or a scale/packed/zero-point
    companion next to its weight), or None: a weight merely named ``..._scale`` does not count."""
    items = list(_items(named_tensors))
    names = {name for name, _ in items}
    for name, tensor in items:
        if tensor.dtype == FP8_DTYPE:
            return name
        for suffix in COMPANION_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and (base in names or f"{base}_packed" in names):
                return name
    return None


def _module_name(name: str) -> str:
    return name.removesuffix(".weight")


def is_target(name: str, tensor: torch.Tensor, cfg: QuantConfig) -> bool:
    """Whether the weight ``name`` is quantized under ``cfg`` (a floating matrix of a targeted module)."""
    return tensor.dim() >= 2 and tensor.is_floating_point() and cfg.targets(_module_name(name))


def companion_names(name: str, cfg: QuantConfig) -> list[str]:
    """The tensor names that quantizing ``name`` produces under ``cfg``."""
    if cfg.format == "fp8_block":
        return [name, f"{name}_scale_inv"]
    if cfg.format == "mxfp8":
        return [name, f"{name}_scale"]
    extra = [] if cfg.format == "int4_sym" else [f"{name}_zero_point"]
    return [f"{name}_packed", f"{name}_scale", *extra, f"{name}_shape"]


@torch.no_grad()
def _quantize_one(name: str, w: torch.Tensor, cfg: QuantConfig) -> Iterator[tuple[str, torch.Tensor]]:
    w = w.detach()
    if cfg.format == "fp8_block":
        codes, scale_inv = quantize_fp8_block(w, cfg.block_size, cfg.scale, backend=cfg.backend)
        yield name, codes.view(FP8_DTYPE)
        yield f"{name}_scale_inv", scale_inv
    elif cfg.format == "mxfp8":
        codes, scales = quantize_mxfp8(w, backend=cfg.backend)
        yield name, codes.view(FP8_DTYPE)
        yield f"{name}_scale", scales
    else:
        codes, scales, zero_points = quantize_int4(
            w, cfg.group_size, cfg.format == "int4_sym", backend=cfg.backend
        )
        yield f"{name}_packed", pack_int4(codes, backend=cfg.backend)
        yield f"{name}_scale", scales
        if zero_points is not None:
            yield f"{name}_zero_point", zero_points
        yield f"{name}_shape", torch.tensor(w.shape, dtype=torch.int64)


def iter_quantized(named_tensors: NamedTensors, cfg: QuantConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs with the targeted weights replaced by their quantized tensors
    (for bucketed sending: each input tensor is quantized as it arrives)."""
    for name, tensor in _items(named_tensors):
        if is_target(name, tensor, cfg):
            yield from _quantize_one(name, tensor, cfg)
        else:
            yield name, tensor


def quantize_state_dict(named_tensors: NamedTensors, cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """`iter_quantized` collected into a dict."""
    return dict(iter_quantized(named_tensors, cfg))


def _require(tensors: Mapping[str, torch.Tensor], name: str, owner: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{owner} is quantized but {name} is missing")
    return tensors[name]


def _quantized_bases(tensors: Mapping[str, torch.Tensor], cfg: QuantConfig) -> list[str]:
    if cfg.format.startswith("int4"):
        return [n.removesuffix("_packed") for n in tensors if n.endswith("_packed")]
    return [n for n, t in tensors.items() if t.dtype == FP8_DTYPE]


@torch.no_grad()
def _dequantize_one(base: str, tensors: Mapping[str, torch.Tensor], cfg: QuantConfig, dtype: torch.dtype):
    if cfg.format == "fp8_block":
        scale_inv = _require(tensors, f"{base}_scale_inv", base)
        return dequantize_fp8_block(tensors[base], scale_inv, cfg.block_size, dtype, backend=cfg.backend)
    if cfg.format == "mxfp8":
        scales = _require(tensors, f"{base}_scale", base)
        return dequantize_mxfp8(tensors[base], scales, dtype, backend=cfg.backend)
    packed = tensors[f"{base}_packed"]
    shape = tuple(int(d) for d in _require(tensors, f"{base}_shape", base).tolist())
    scales = _require(tensors, f"{base}_scale", base)
    zero_points = None if cfg.format == "int4_sym" else _require(tensors, f"{base}_zero_point", base)
    codes = unpack_int4(packed, shape[-1], backend=cfg.backend).view(shape)
    return dequantize_int4(codes, scales, zero_points, cfg.group_size, dtype, backend=cfg.backend)


def dequantize_state_dict(named_tensors: NamedTensors, cfg: QuantConfig,
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_state_dict` for an engine that loads quantized weights: every quantized
    weight comes back under its original name in ``dtype``; other tensors pass through unchanged.

    Raises ValueError for a quantized weight missing a companion tensor, or a companion whose weight
    is missing (a scale without its weight would otherwise be dropped silently). Each dequantized
    weight is marked with its `grid_key` (`dequantized_grid`).
    """
    tensors = dict(_items(named_tensors))
    bases = _quantized_bases(tensors, cfg)
    anchors = {companion_names(base, cfg)[0]: base for base in bases}  # where each weight was
    consumed = {n for base in bases for n in companion_names(base, cfg)}
    out = {}
    for name, tensor in tensors.items():
        if name in anchors:
            weight = _dequantize_one(anchors[name], tensors, cfg, dtype)
            setattr(weight, _GRID_ATTR, grid_key(cfg))
            out[anchors[name]] = weight
        elif name not in consumed:
            owner = _companion_owner(name, tensors)
            if owner is not None:
                raise ValueError(f"{name} belongs to {owner}, which is not quantized as {cfg.format}")
            out[name] = tensor
    return out


def _companion_owner(name: str, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The weight that ``name`` would be a scale/zero-point/shape/packed tensor of, if it is present."""
    for suffix in COMPANION_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and (base in tensors or f"{base}_packed" in tensors):
            return base
    return None


def quantize_tensor(name: str, w: torch.Tensor, cfg: QuantConfig) -> list[tuple[str, torch.Tensor]]:
    """One weight quantized under ``cfg``: its tensors under `companion_names` (``name`` first)."""
    return list(_quantize_one(name, w, cfg))


def dequantize_tensor(name: str, tensors: Mapping[str, torch.Tensor], cfg: QuantConfig,
                      dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_tensor`: ``dequantize(quantize(w))`` in ``dtype``, the bits
    `tandem.kernels.fake_quantize_weight` gives (a QLoRA base and the engine serving it agree)."""
    return _dequantize_one(name, tensors, cfg, dtype)
