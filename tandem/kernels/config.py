"""`QuantConfig`: which low-precision format, which blocks, which layers.

One config serves both sides: the trainer's fake-quant forward (`apply_qat`), the sync layer's
quantize-on-send (`quantize_state_dict`) and the engine's dequantize-on-load
(`dequantize_state_dict`). Built from YAML by `tandem.config` like every component config.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DEFAULT_EXCLUDE", "DEFAULT_TARGETS", "FORMATS", "MX_BLOCK", "QuantConfig", "matches_pattern"]

FORMATS = ("fp8_block", "mxfp8", "int4_sym", "int4_asym")
MX_BLOCK = 32  # OCP MX v1.0: every concrete MX format uses k = 32 elements per shared scale
MAX_BLOCK_DIM = 512
MAX_BLOCK_ELEMENTS = 65536

# The projections of every HF decoder family in the registry (Llama, Qwen2/3, Qwen3-MoE, Mistral).
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"]
# lm_head is often tied to the embedding; the MoE router (`mlp.gate`) is precision-sensitive.
DEFAULT_EXCLUDE = ["lm_head", "*.mlp.gate"]


def matches_pattern(name: str, pattern: str) -> bool:
    """Whether the dotted module ``name`` matches one ``target_modules`` / ``exclude_modules`` pattern."""
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(kw_only=True, slots=True)
class QuantConfig:
    """Low-precision format and the modules it applies to.

    format: ``fp8_block`` (e4m3 with one fp32 scale per ``block_size`` block, the SGLang/vLLM
        block-FP8 layout), ``mxfp8`` (OCP MX: e4m3 with one E8M0 scale per 32 elements of a row),
        ``int4_sym`` / ``int4_asym`` (per-group of ``group_size`` elements of a row).
    block_size: ``[rows, cols]`` of an fp8_block weight block; powers of two.
    group_size: int4 group, and the token group (``1 x group_size``) of fp8 activation quantization.
    scale: fp8_block scales as plain fp32 ``amax / 448`` or rounded up to a power of two (UE8M0).
    target_modules / exclude_modules: module-name patterns. A pattern without ``*?[`` matches a
        module whose dotted name equals it or ends with ``.pattern`` (peft style); a pattern with
        glob characters is matched against the whole dotted name (fnmatch). Exclusion wins.
    quantize_activations: `apply_qat` also fake-quantizes the input of each target linear
        (fp8 formats only; W8A8 emulation).
    backend: ``auto`` = the Triton kernel for CUDA tensors, the torch reference otherwise.
    """

    format: Literal["fp8_block", "mxfp8", "int4_sym", "int4_asym"] = "fp8_block"
    # tuple[int, ...] rather than tuple[int, int]: tandem.config mis-converts fixed-length tuples
    block_size: tuple[int, ...] = (128, 128)
    group_size: int = 128
    scale: Literal["fp32", "ue8m0"] = "fp32"
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    exclude_modules: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    quantize_activations: bool = False
    backend: Literal["auto", "torch", "triton"] = "auto"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is not one of {', '.join(FORMATS)}")
        if len(self.block_size) != 2:
            raise ValueError(f"block_size={self.block_size!r} must be [rows, cols]")
        self.block_size = (int(self.block_size[0]), int(self.block_size[1]))
        for dim in self.block_size:
            if not _is_pow2(dim) or dim > MAX_BLOCK_DIM:
                raise ValueError(
                    f"block_size={list(self.block_size)}: each side must be a power of two in [1, {MAX_BLOCK_DIM}]"
                )
        if self.block_size[0] * self.block_size[1] > MAX_BLOCK_ELEMENTS:
            raise ValueError(
                f"block_size={list(self.block_size)} has more than {MAX_BLOCK_ELEMENTS} elements per block"
            )
        if not _is_pow2(self.group_size) or not 8 <= self.group_size <= 1024:
            raise ValueError(f"group_size={self.group_size} must be a power of two in [8, 1024]")
        if self.scale not in ("fp32", "ue8m0"):
            raise ValueError(f"scale={self.scale!r} is not one of fp32, ue8m0")
        if self.scale == "ue8m0" and self.format.startswith("int4"):
            raise ValueError(f"scale='ue8m0' applies to fp8 formats only, not format={self.format!r}")
        if self.quantize_activations and self.format.startswith("int4"):
            raise ValueError(
                f"quantize_activations=True needs an fp8 format (int4 is weight-only), got format={self.format!r}"
            )
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module pattern")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend={self.backend!r} is not one of auto, torch, triton")

    @property
    def is_fp8(self) -> bool:
        return self.format in ("fp8_block", "mxfp8")

    def targets(self, module_name: str) -> bool:
        """Whether the module (dotted name, e.g. ``model.layers.0.mlp.down_proj``) is quantized."""
        if any(matches_pattern(module_name, p) for p in self.exclude_modules):
            return False
        return any(matches_pattern(module_name, p) for p in self.target_modules)
