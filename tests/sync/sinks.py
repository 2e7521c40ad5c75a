"""Weights and sinks for the transport tests.

`perturbed_weights` stands in for a trainer after some steps; `ModuleSink` is a bare receiver (a native
model whose weights a transport replaces) for tests of a transport alone; tests that need an engine
use a real `TorchEngine` (tests/sync/engine_worker.py).
"""

from __future__ import annotations

import torch

from tandem.models import resolve_model
from tandem.models.transformer import CausalLM
from tandem.sync import bucketize, checksum


class ModuleSink:
    """``apply`` does what an engine's ``update_weights`` does: validate every name and shape, then copy."""

    def __init__(self, model_name: str = "tiny-qwen3") -> None:
        self.model = CausalLM.from_pretrained(resolve_model(model_name))
        self.params = dict(self.model.hf_state_dict())
        self.version = 0

    @property
    def weight_version(self) -> int:
        return self.version

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
    """The model's weights plus seeded noise: what a trainer would hold after some steps.

    Tied weights appear once (under the embedding's name), as a trainer sends them.
    """
    g = torch.Generator().manual_seed(seed)
    model = CausalLM.from_pretrained(resolve_model(model_name))
    seen, out = set(), {}
    for k, v in model.state_dict().items():
        if id(v) in seen or v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v + 0.01 * torch.randn(v.shape, generator=g)
    return out


def weight_buckets(weights: dict[str, torch.Tensor], nbytes: int = 64 * 1024):
    return bucketize(weights.items(), nbytes)
