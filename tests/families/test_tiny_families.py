"""Every architecture a recipe under recipes/<family>/ names runs 2 GRPO steps on CPU, as its tiny random model:
FSDP trainer (the native model where Tandem implements the architecture, the HF model elsewhere) and the
embedded engine (``inference.engine: torch``), which serves native architectures only. DeepSeek-V3 and GLM-4.5
roll out with tests/families/hf_engine.py (the HF model, no KV cache) instead: the embedded engine refuses them,
and a test says so."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

from tandem.config import load_config
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-sync.yaml"
HF_ENGINE = "tests.families.hf_engine:ENTRY"
# tiny model -> (its family's HF model_type, the inference engine its CPU run uses, whether the trainer is native)
TINY = {
    "tiny-llama": ("llama", "torch", True),
    "tiny-qwen3": ("qwen3", "torch", True),
    "tiny-qwen3-moe": ("qwen3_moe", "torch", True),
    "tiny-deepseek-v3": ("deepseek_v3", HF_ENGINE, False),
    "tiny-glm4-moe": ("glm4_moe", HF_ENGINE, False),
}


def test_every_recipe_architecture_has_a_tiny_model():
    from tandem.plan.archs import ARCHS, resolve_arch

    named = {yaml.safe_load(p.read_text())["model"]["name"] for p in (ROOT / "recipes").rglob("*.yaml")}
    # their recipes were withdrawn on 2026-12-07 (docs/plan.md, "Recipes"); their tiny models stay, for the HF path
    named |= {"deepseek-ai/DeepSeek-V3", "zai-org/GLM-4.5-Air"}
    families = {ARCHS[n].family for n in named if n in ARCHS}
    assert families == {family for family, _, _ in TINY.values()}
    for name, (family, _, _) in TINY.items():
        tiny = resolve_arch(name)
        big = next(a for a in ARCHS.values() if a.family == family and a.name in named)
        # the same kind of model: MoE or dense, MLA or GQA, shared experts, leading dense layers, tied head
        assert (tiny.family, tiny.moe, tiny.mla, tiny.shared_intermediate > 0, tiny.first_dense > 0) == (
            big.family,
            big.moe,
            big.mla,
            big.shared_intermediate > 0,
            big.first_dense > 0,
        ), name
        assert tiny.total_params() < 500_000


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_embedded_engine_refuses_what_it_does_not_implement(name):
    from tandem.engines.inference.torch.config import TorchEngineConfig
    from tandem.engines.inference.torch.engine import TorchEngine
    from tandem.models.registry import ModelConfig
    from tandem.models.transformer import UnsupportedModelError

    with pytest.raises(
        UnsupportedModelError, match=f"model_type '{TINY[name][0]}' has no native implementation"
    ):
        TorchEngine(TorchEngineConfig(model=ModelConfig(name=name)))


def _checkpoint(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from tandem.models import resolve_model

    out: dict[str, torch.Tensor] = {}
    for file in sorted(resolve_model(name).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _trainer_weights(run: Run) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in run.trainer.named_parameters_for_sync(1 << 30) for n, t in b}


@pytest.mark.parametrize("name", list(TINY))
def test_two_grpo_steps_on_cpu(name, tmp_path):
    _, engine, native = TINY[name]
    cfg = load_config(
        RunConfig,
        RECIPE,
        [
            f"model.name={name}",
            f"inference.engine={engine}",
            "run.steps=2",
            "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]",
        ],
    )
    start = time.perf_counter()
    run = Run(cfg, tmp_path)
    assert run.trainer.native is native
    before = _trainer_weights(run)
    # the sync speaks the checkpoint's names and tensors (what vLLM and SGLang load), whatever transformers
    # fused at load time (the MoE experts of the HF fallback)
    disk = _checkpoint(name)
    assert set(before) <= set(disk) and set(disk) - set(before) <= {"lm_head.weight"}, set(before) ^ set(disk)
    assert all(torch.equal(before[k], disk[k].to(before[k].dtype)) for k in before)
    run.train(close=False)
    after = _trainer_weights(run)
    served = run.engine.named_weights()
    run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["rollout/response_len_mean"] > 0 and r["train/grad_norm"] > 0 for r in rows)
    # the rollout engine and the trainer compute the same log-probs of the same tokens (same weights, fp32)
    assert all(r["train_rollout_logprob_abs_diff/mean"] < 1e-4 for r in rows), rows
    assert any(not torch.equal(before[k], after[k]) for k in before), "no weight changed"
    assert set(served) >= set(after) and all(torch.equal(served[k], after[k]) for k in after), "sync missed"
    assert time.perf_counter() - start < 120
