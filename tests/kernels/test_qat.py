"""QAT: straight-through gradients, and trainer fake-quant == engine dequantized weights on a real model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import (
    QATLinear,
    QuantConfig,
    apply_qat,
    dequantize_state_dict,
    fake_quantize,
    fake_quantize_weight,
    quantize_state_dict,
    remove_qat,
)
from tandem.kernels.qat import fake_quantize_activation_ste
from tandem.models import ModelConfig, load_model
from tests.kernels.conftest import needs_triton

# block/group sizes fit the tiny models' 64/128-wide matrices, with ragged blocks for the 32-row ones
FORMATS = {
    "fp8_block": dict(format="fp8_block", block_size=(64, 32)),
    "fp8_block_ue8m0": dict(format="fp8_block", block_size=(64, 32), scale="ue8m0"),
    "mxfp8": dict(format="mxfp8"),
    "int4_sym": dict(format="int4_sym", group_size=32),
    "int4_asym": dict(format="int4_asym", group_size=32),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_ste_gradient_is_the_identity(device, fmt):
    cfg = QuantConfig(**FORMATS[fmt])
    w = torch.randn(64, 96, device=device)
    w[5, 7], w[9, 1] = float("inf"), -float("inf")  # outside every range: saturated, gradient still 1
    w.requires_grad_(True)
    out = fake_quantize(w, cfg)
    assert torch.equal(out.detach(), fake_quantize_weight(w.detach(), cfg))
    assert not torch.equal(out.detach()[:4], w.detach()[:4])  # it really quantized
    grad = torch.randn_like(out)
    out.backward(grad)
    assert torch.equal(w.grad, grad)


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "int4_asym"])
def test_qat_linear_gradients(device, fmt):
    cfg = QuantConfig(**FORMATS[fmt], quantize_activations=fmt != "int4_asym", target_modules=["proj"])
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(96, 64, device=device))
    apply_qat(model, cfg)
    x = torch.randn(3, 5, 96, device=device, requires_grad=True)
    model(x).square().sum().backward()
    # reference: the same forward with the fake-quantized weight/input as leaves
    w_fq = fake_quantize_weight(model.proj.weight.detach(), cfg).requires_grad_(True)
    x_fq = x.detach().clone()
    if cfg.quantize_activations:
        x_fq = fake_quantize_activation_ste(x_fq, cfg).detach()
    x_fq.requires_grad_(True)
    F.linear(x_fq, w_fq, model.proj.bias.detach()).square().sum().backward()
    assert torch.equal(model.proj.weight.grad, w_fq.grad)
    assert torch.equal(x.grad, x_fq.grad)


def _logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_trainer_fake_quant_equals_engine_dequantized_weights(fmt, dtype):
    """The trainer's QAT forward and an engine loading quantize->dequantize weights agree bit for bit."""
    cfg = QuantConfig(**FORMATS[fmt])
    trainer = load_model(ModelConfig(name="tiny-llama", dtype=dtype))
    plain = {k: v.clone() for k, v in trainer.state_dict().items()}
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    baseline = _logprobs(trainer, ids)
    swapped = apply_qat(trainer, cfg)
    assert len(swapped) == 14 and all(isinstance(trainer.get_submodule(n), QATLinear) for n in swapped)
    assert list(trainer.state_dict()) == list(plain)  # names unchanged: sync needs no mapping

    engine = load_model(ModelConfig(name="tiny-llama", dtype=dtype))
    sent = quantize_state_dict(trainer.state_dict(), cfg)  # what the sync layer would send
    engine.load_state_dict(dequantize_state_dict(sent, cfg, dtype=engine.dtype), strict=True)

    trainer_lp, engine_lp = _logprobs(trainer, ids), _logprobs(engine, ids)
    assert torch.equal(trainer_lp, engine_lp)
    assert not torch.equal(trainer_lp, baseline)  # quantization changed the model...
    # ...but did not wreck it. Mean per-token KL(baseline || quantized) measured on this (very peaked)
    # tiny model: ~0.05 for the fp8 formats, ~0.4-0.5 for int4.
    kl = (baseline.exp() * (baseline - trainer_lp)).sum(-1).mean()
    assert kl < (0.1 if cfg.is_fp8 else 1.0)


@needs_triton
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_trainer_on_reference_engine_on_triton_agree(device, fmt):
    """The trainer on the CPU reference, the sync + engine on the Triton kernel (on the GPU when there
    is one, else in the interpreter): the engine still gets the trainer's fake-quantized weights."""
    trainer_cfg = QuantConfig(**FORMATS[fmt], backend="torch")
    engine_cfg = QuantConfig(**FORMATS[fmt], backend="triton")
    trainer, engine = load_model("tiny-llama"), load_model("tiny-llama")
    apply_qat(trainer, trainer_cfg)
    sent = quantize_state_dict({k: v.to(device) for k, v in trainer.state_dict().items()}, engine_cfg)
    loaded = dequantize_state_dict(sent, engine_cfg, dtype=torch.float32)
    engine.load_state_dict({k: v.cpu() for k, v in loaded.items()})
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logprobs(trainer, ids), _logprobs(engine, ids))


def test_apply_qat_keeps_parameters_trains_and_reverts(device):
    model = load_model("tiny-llama")
    before = dict(model.named_parameters())
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    baseline = _logprobs(model, ids)
    cfg = QuantConfig(format="int4_sym", group_size=32, target_modules=["*.mlp.*_proj"])
    swapped = apply_qat(model, cfg)
    assert swapped == [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model.model.layers[0].mlp.down_proj.weight
    model.train()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(weight.detach(), snapshot["model.layers.0.mlp.down_proj.weight"])  # master moved
    model.eval()
    assert remove_qat(model) == swapped
    assert all(type(model.get_submodule(n)) is nn.Linear for n in swapped)
    model.load_state_dict(snapshot)
    assert torch.equal(_logprobs(model, ids), baseline)


def test_apply_qat_errors(device):
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no nn.Linear matches target_modules=\\['q_proj'"):
        apply_qat(model, QuantConfig(target_modules=["q_proj"]))

    class Wrapped(nn.Linear):
        pass

    model = nn.Sequential()
    model.add_module("q_proj", Wrapped(8, 8))
    with pytest.raises(ValueError, match="q_proj is a Wrapped, not a plain nn.Linear"):
        apply_qat(model, QuantConfig())
