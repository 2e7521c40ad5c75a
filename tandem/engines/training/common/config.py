"""Configuration shared by every training engine: the optimizer and LoRA sections of a recipe.

Each engine's config (``FSDPConfig``, ``MegatronConfig``) embeds these unchanged, so a recipe switches
engines without touching its ``optimizer`` or ``lora`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.kernels.config import QuantConfig

__all__ = ["LoRAConfig", "OptimizerConfig"]


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW and gradient clipping. ``grad_clip <= 0`` disables clipping (the norm is still reported)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """Low-rank adapters in peft's layout (fsdp/lora.py, megatron/lora.py). Only adapter weights train; the base
    stays frozen.

    ``sync`` picks what `named_parameters_for_sync` yields: full weights with the adapters merged
    (for an engine without LoRA support) or the adapter tensors alone (peft naming).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    sync: Literal["merged", "adapter"] = "merged"
    # QLoRA: keep the frozen base's linear weights quantized (fp8_block, mxfp8, int4; tandem.kernels),
    # dequantized on the fly (fsdp/qlora.py); the embedded engine serves the same bits
    quantize_base: QuantConfig | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank={self.rank} must be >= 1")
        if not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module")
        if self.quantize_base is not None and self.quantize_base.quantize_activations:
            raise ValueError("quantize_base.quantize_activations: a QLoRA base quantizes weights only")
