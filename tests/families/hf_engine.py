"""An inference engine for the architectures Tandem's embedded engine cannot serve (tests only).

The embedded engine (``inference.engine: torch``) runs Tandem's native model, which implements llama, qwen2,
qwen3 and qwen3_moe; DeepSeek-V3 (MLA) and GLM-4.5 (partial rotary, shared experts, sigmoid routing) have
only the HF implementation. On GPUs their recipes roll out with vLLM; on this CPU a run needs an engine that
runs the HF model, and this is one: the toy engine of tests/runtime/toy_engine.py (token by token, no KV
cache, the shared log-prob convention) with the HF ``AutoModelForCausalLM`` in place of the native model.
The FSDP trainer of these models is the HF model too; the sync sends the checkpoint's names (the
trainer undoes transformers' load-time fusion of MoE experts, tandem/models/hf_names.py), as vLLM and
SGLang expect, so this engine maps each checkpoint name to the elements of its fused parameter. Named in a recipe by import path: ``tests.families.hf_engine:ENTRY``.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch import nn

from tandem.core.contracts import Contract, PairContract
from tandem.core.protocols import EngineInfo
from tandem.engines.registry import EngineEntry, RunFacts, run_section
from tests.runtime.toy_engine import ToyEngine, ToyEngineConfig


class _HFAsNative(nn.Module):
    """The two calls the toy engine makes on a native model (hidden states of one sequence; logits of the
    last ones), served by an HF causal LM. Its state dict is the HF model's own (the sync's names)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, _attention) -> torch.Tensor:
        out = self.lm.model(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(hidden)

    def state_dict(self, *args, **kwargs):
        return self.lm.state_dict(*args, **kwargs)


@dataclasses.dataclass(kw_only=True, slots=True)
class HFEngineConfig(ToyEngineConfig):
    label: str = "hf"


class HFEngine(ToyEngine):
    def __init__(self, config: HFEngineConfig) -> None:  # the toy engine's set-up, with the HF model
        from tandem.models.registry import load_model

        if config.model is None:
            raise ValueError("HFEngineConfig.model is not set")
        self.config = config
        lm = load_model(dataclasses.replace(config.model, dtype="float32", attn_implementation="eager"))
        lm.requires_grad_(False)
        self.model = _HFAsNative(lm).eval()
        self._info = EngineInfo(
            name="hf",
            version="0.0.1",
            dtype="float32",
            max_context=config.max_model_len,
            vocab_size=lm.config.vocab_size,
            exposes_weights=True,
            partial_updates=True,
        )
        self._version = 0
        self._aborted: set[str] = set()
        self._abort_all = 0
        self._lock = threading.Lock()
        self._closed = False
        self._tokens = 0
        self._views = _checkpoint_views(lm)

    def update_weights(self, named_tensors, version: int) -> None:
        weights = self.model.state_dict()
        items = list(named_tensors)
        bad = [n for n, t in items if n not in self._views or tuple(t.shape) != self._views[n][2]]
        if bad:
            raise ValueError(f"update_weights(version={version}) rejected: unknown name or shape {bad[0]!r}")
        with self._lock, torch.no_grad():
            for name, tensor in items:
                owner, index, _ = self._views[name]
                weights[owner].view(-1)[index] = tensor.reshape(-1).to(weights[owner].dtype)
            self._version = int(version)

    def named_weights(self) -> dict[str, torch.Tensor]:
        weights = self.model.state_dict()
        return {name: weights[owner].reshape(-1)[index].view(shape)
                for name, (owner, index, shape) in self._views.items()}


def _checkpoint_views(lm: nn.Module) -> dict[str, tuple[str, torch.Tensor, tuple[int, ...]]]:
    """checkpoint name -> (parameter name, flat indices into it, shape): the reversal of transformers'
    load-time conversion applied to each parameter's element indices (exact in float64)."""
    from tandem.models.hf_names import checkpoint_named

    views = {}
    for owner, t in lm.state_dict().items():
        probe = torch.arange(t.numel(), dtype=torch.float64).view(t.shape)
        for name, part in checkpoint_named(lm, [(owner, probe)]):
            views[name] = (owner, part.reshape(-1).long(), tuple(part.shape))
    return views


def fill(facts: RunFacts, config: HFEngineConfig | None) -> HFEngineConfig:
    cfg, changes = run_section(config, HFEngineConfig, facts)  # the run's model and seed
    return dataclasses.replace(cfg, **changes, max_model_len=min(cfg.max_model_len, facts.max_context))


ENTRY = EngineEntry(
    name="hf",
    kind="inference",
    config="tests.families.hf_engine:HFEngineConfig",
    factory="tests.families.hf_engine:HFEngine",
    fill=fill,
    capabilities=frozenset({"exposes_weights", "partial_updates"}),
    contracts=(
        PairContract(
            trainer="fsdp",
            engine="hf",
            contract=Contract(
                relation="bounded",
                tolerance=1e-3,
                note="HF model on both sides, fp32; the trainer pads, this engine does not",
            ),
        ),
    ),
)
