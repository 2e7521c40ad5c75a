"""A weight sink for transport tests: a real native model whose weights a transport replaces.

`ModuleSink.apply` does what an engine's ``update_weights`` does (validate every name and shape first,
then copy in place), so the transports can be tested without an inference engine in the process.
"""

from __future__ import annotations

import torch

from tandem.models import resolve_model
from tandem.models.transformer import CausalLM
from tandem.sync import checksum


class ModuleSink:
    def __init__(self, model_name: str = "tiny-qwen3") -> None:
        self.model = CausalLM.from_pretrained(resolve_model(model_name))
        self.params = dict(self.model.hf_state_dict())
        self.version = 0

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        for name, t in named:
            if name not in self.params or self.params[name].shape != t.shape:
                raise ValueError(f"unknown tensor {name!r} or shape {tuple(t.shape)}")
        with torch.no_grad():
            for name, t in named:
                self.params[name].copy_(t)
        self.version = version

    def digest(self) -> dict[str, int]:
        return {k: checksum(v) for k, v in self.params.items()}


def perturbed_weights(seed: int, model_name: str = "tiny-qwen3") -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: what a trainer would hold after some steps."""
    g = torch.Generator().manual_seed(seed)
    base = CausalLM.from_pretrained(resolve_model(model_name)).hf_state_dict()
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
