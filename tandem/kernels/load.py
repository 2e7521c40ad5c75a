"""Dequantize on load: the weights an inference engine holds when it serves a quantized format.

An engine configured with a `QuantConfig` holds, for the weight of every linear layer the config
targets, exactly ``fake_quantize_weight(w, cfg)`` in its own dtype: the weight the trainer's
fake-quantized forward (`apply_qat`) computes with. Whatever form a weight arrives in, it is put on
that grid once:

* a full-precision tensor (the model files at start, a trainer's master weights in
  ``update_weights``) is quantized and dequantized (`fake_quantize_weight`);
* quantized tensors with their companions (``<name>`` fp8 + ``<name>_scale_inv``, ``<name>_packed`` +
  ``<name>_scale`` ..., the quantize-on-send layout of `tandem.kernels.state_dict`) are dequantized;
* a tensor that `dequantize_state_dict` already produced on the same grid (the sync layer's
  `WeightApplier` dequantizes before it calls ``update_weights``) is kept as it is, because a second
  pass is not a no-op for every format (int4_asym moves ~9% of the elements).

Other tensors (embeddings, norms, untargeted linears) pass through. With ``quantize_activations`` the
engine also fake-quantizes the input of each targeted linear (`quantize_linear_inputs`).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.config import QuantConfig
from tandem.kernels.qat import fake_quantize_weight, qat_targets, quantize_linear_inputs
from tandem.kernels.state_dict import dequantize_state_dict, dequantized_grid, find_quantized, grid_key

__all__ = ["DequantizeOnLoad"]

NamedList = list[tuple[str, torch.Tensor]]


def _describe(grid: tuple) -> str:
    fmt, block, group, scale = grid
    if fmt == "fp8_block":
        return f"fp8_block {list(block)} {scale}"
    return f"{fmt} group {group}" if fmt.startswith("int4") else fmt


class DequantizeOnLoad:
    """An engine's quantization of ``model`` (its HF-named linears) under ``cfg``.

    Building it checks the targets (`qat_targets`: a pattern that matches nothing, or the output
    projection ``output_module``, raises ValueError). `apply` quantizes the model in place at start;
    `unpack`, `problem` and `served` handle an update, tensor by tensor.
    """

    def __init__(self, model: nn.Module, cfg: QuantConfig, *, output_module: str = "lm_head") -> None:
        self.cfg = cfg
        self.grid = grid_key(cfg)
        self.modules = qat_targets(model, cfg, output_module=output_module)
        self.weight_names = frozenset(f"{name}.weight" for name in self.modules)

    @torch.no_grad()
    def apply(self, model: nn.Module) -> None:
        """Put every targeted weight of ``model`` on the grid, in place (storage kept), and hook the
        targeted linears' inputs when ``quantize_activations`` is set. A weight on the meta device (its
        values come from quantized tensors, already on the grid) is left to its owner."""
        for name in self.modules:
            weight = model.get_submodule(name).weight
            if not weight.is_meta:
                weight.copy_(fake_quantize_weight(weight.detach(), self.cfg))
        self.hooks = quantize_linear_inputs(model, self.cfg, self.modules)

    def unpack(self, named: NamedList, dtype: torch.dtype) -> NamedList:
        """``named`` with quantized tensors and their companions replaced by the dequantized weights
        (in ``dtype``); unchanged when it holds none. Raises ValueError for a missing companion or a
        layout that is not this config's."""
        if find_quantized(named) is None:
            return named
        return list(dequantize_state_dict(named, self.cfg, dtype).items())

    def problem(self, name: str, tensor: torch.Tensor) -> str | None:
        """Why the engine must refuse ``tensor`` for ``name``: it was dequantized on another grid, or
        for a weight this engine does not quantize (the sync's and the engine's configs differ)."""
        grid = dequantized_grid(tensor)
        if grid is None or (grid == self.grid and name in self.weight_names):
            return None
        if name not in self.weight_names:
            return (f"{name} arrives dequantized ({_describe(grid)}) but the engine's quantization does not "
                    f"target it (target_modules={self.cfg.target_modules})")
        return (f"{name} arrives dequantized as {_describe(grid)} but the engine serves {_describe(self.grid)}: "
                "use one QuantConfig for sync.quantize and the engine")

    def served(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What the engine stores for ``tensor`` arriving as ``name`` (its weights are ``dtype``)."""
        if name not in self.weight_names:
            return tensor
        if dequantized_grid(tensor) == self.grid and tensor.dtype == dtype:
            return tensor  # already dequantized on this grid by the sync layer: keep its bits
        return fake_quantize_weight(tensor.detach().to(dtype), self.cfg)
