"""QLoRA (issue 20): a frozen base held quantized, dequantized on the fly, LoRA adapters on top; the
embedded engine serves the same bits, so the exact contract holds."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.cli import main as cli_main
from tandem.config import ConfigError, load_config
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, LoRAConfig, OptimizerConfig
from tandem.engines.training.fsdp.lora import hf_tensors
from tandem.engines.training.fsdp.qlora import QuantizedLinear
from tandem.kernels import QuantConfig, fake_quantize_weight
from tandem.models import ModelConfig, load_model
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

from .helpers import make_batch, token_mean_pg

RECIPE = Path(__file__).parents[3] / "recipes" / "tiny" / "grpo-sync.yaml"
FP8 = QuantConfig(format="fp8_block", block_size=(32, 32))


@pytest.mark.parametrize("cfg", [FP8, QuantConfig(format="int4_sym", group_size=32),
                                 QuantConfig(format="mxfp8")], ids=["fp8_block", "int4_sym", "mxfp8"])
def test_quantized_linear_computes_with_the_fake_quantized_weight_and_keeps_no_full_copy(cfg):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=False)
    q = QuantizedLinear(lin, cfg)
    w = fake_quantize_weight(lin.weight.detach(), cfg)
    assert torch.equal(q.dequantized(), w)
    assert not list(q.parameters())  # nothing to train, no full-precision tensor held
    assert q.quantized_bytes <= lin.weight.numel() * lin.weight.element_size() / 3.5
    x = torch.randn(5, 64, requires_grad=True)
    y = q(x)
    assert torch.equal(y, F.linear(x, w))
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, w).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)


def _trainer(**lora) -> FSDPEngine:
    torch.manual_seed(0)
    cfg = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), quantize_base=FP8, **lora)
    return FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), lora=cfg, micro_batch_tokens=64,
                                 optimizer=OptimizerConfig(lr=5e-2)))


def test_the_qlora_trainer_trains_adapters_on_a_quantized_base_and_exports_merged_weights(tmp_path):
    trainer = _trainer()
    lm = trainer.policy.module.lm
    quantized = [n for n, m in lm.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) >= 7 * 2  # attention and MLP projections of both layers, LoRA'd or not
    assert {n for n, p in lm.named_parameters() if p.requires_grad} == {
        n for n, _ in lm.named_parameters() if ".lora_" in n}
    assert not any(n.endswith(("q_proj.base_layer.weight", "gate_proj.weight")) for n, _ in lm.named_parameters())
    before = dict(hf_tensors(lm, gather=lambda t: t.detach().clone()))
    metrics = trainer.train_step(make_batch(), token_mean_pg)
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"]))
    merged = dict(hf_tensors(lm, gather=lambda t: t.detach().clone()))
    base = load_model("tiny-llama").state_dict()
    assert set(merged) == set(before) and set(merged) <= set(base)  # HF names, one per weight
    gate = "model.layers.0.mlp.gate_proj.weight"  # quantized, no adapter: the dequantized base, unchanged
    assert torch.equal(merged[gate], fake_quantize_weight(base[gate], FP8)) and torch.equal(merged[gate], before[gate])
    q = "model.layers.0.self_attn.q_proj.weight"  # quantized + trained adapter: moved
    assert not torch.equal(merged[q], before[q])
    adapters = dict(hf_tensors(lm, gather=lambda t: t.detach().clone(), adapter_only=True))
    assert adapters and all(".lora_" in n for n in adapters)
    trainer.save(str(tmp_path / "ckpt"))
    fresh = _trainer()
    fresh.load(str(tmp_path / "ckpt"))
    again = dict(hf_tensors(fresh.policy.module.lm, gather=lambda t: t.detach().clone()))
    assert all(torch.equal(again[k], merged[k]) for k in merged)
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    exported = load_model(str(tmp_path / "hf")).state_dict()
    assert all(torch.equal(exported[k], merged[k]) for k in merged)
    trainer.close()
    fresh.close()


def _run_cfg(*extra: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", "inference.torch.deterministic=true",
        "trainer.fsdp.deterministic=true", "sync.lora_mode=adapter", "trainer.fsdp.optimizer.lr=0.01",
        "trainer.fsdp.lora={rank: 8, alpha: 16, target_modules: [q_proj, v_proj, down_proj], "
        "quantize_base: {format: fp8_block, block_size: [32, 32]}}", *extra])


def test_a_qlora_run_keeps_the_exact_contract_and_the_engine_serves_the_quantized_base(tmp_path):
    run = Run(_run_cfg(), tmp_path)
    assert run.engine.config.quantization == QuantConfig(format="fp8_block", block_size=(32, 32))  # filled in
    assert run.contract.relation == "exact"
    run.train()
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["train_rollout_logprob_abs_diff/max"] == 0.0 for r in rows)
    assert all(r["sync/bytes"] < 30_000 for r in rows)  # the adapters alone


def test_qlora_needs_an_engine_that_serves_the_quantized_base(tmp_path):
    with pytest.raises(ConfigError, match="inference.torch.quantization"):
        Run(_run_cfg("inference.torch.quantization={format: int4_sym, group_size: 32}"), tmp_path / "a")
    with pytest.raises(ConfigError, match="quantize_activations"):
        _run_cfg("trainer.fsdp.lora.quantize_base.quantize_activations=true")


def test_quantizing_the_base_frees_each_float_weight_without_waiting_for_the_garbage_collector():
    from tandem.engines.training.fsdp.lora import apply_lora
    from tandem.engines.training.fsdp.qlora import quantize_base

    torch.manual_seed(0)
    lm = load_model("tiny-llama")
    apply_lora(lm, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    weights = [weakref.ref(m.weight) for n, m in lm.named_modules()
               if isinstance(m, nn.Linear) and ".lora_" not in n and "lm_head" not in n]
    gc.collect()
    gc.disable()  # only reference counting frees them: a reference cycle would keep them alive here
    try:
        targets = quantize_base(lm, FP8, output_module="lm_head")
        assert targets and len(weights) >= len(targets)
        alive = [r() for r in weights if r() is not None]
        assert not alive, f"{len(alive)} replaced float weights still alive"
    finally:
        gc.enable()
