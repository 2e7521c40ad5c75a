"""The embedded engine with ``quantization``: dequantize on load, whatever form the weights arrive in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import (
    QuantConfig,
    apply_qat,
    dequantize_state_dict,
    fake_quantize_weight,
    qat_targets,
    quantize_state_dict,
)
from tandem.models.registry import resolve_model
from tandem.models.transformer import CausalLM
from tandem.sync import SyncError, WeightApplier, checksum
from tests.engines.quantized_helpers import MODEL, engine

FP8 = QuantConfig(format="fp8_block", block_size=(32, 32))
INT4 = QuantConfig(format="int4_sym", group_size=32)
ASYM = QuantConfig(format="int4_asym", group_size=32)
MX = QuantConfig(format="mxfp8")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _files() -> dict[str, torch.Tensor]:
    return CausalLM.from_pretrained(resolve_model(MODEL.name)).state_dict()


def _is_target(name: str) -> bool:
    return name.endswith("_proj.weight")  # the tiny model's targeted linears (lm_head is excluded)


def _new_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: w + 0.05 * torch.randn(w.shape, generator=g) for n, w in _files().items()}


def _state(inference) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in inference.named_weights().items()}


def test_engine_quantizes_the_model_files_on_load():
    files = _files()
    inference = engine(FP8, deterministic=False)
    held = inference.named_weights()
    assert sum(map(_is_target, held)) == 14
    for name, w in files.items():
        assert torch.equal(held[name], fake_quantize_weight(w, FP8) if _is_target(name) else w), name
    assert not torch.equal(held["model.layers.0.self_attn.q_proj.weight"], files["model.layers.0.self_attn.q_proj.weight"])
    assert inference.health()["quantization"] == "fp8_block"
    assert engine(None, deterministic=False).health()["quantization"] is None


@pytest.mark.parametrize("cfg", [FP8, ASYM, MX], ids=["fp8_block", "int4_asym", "mxfp8"])
def test_every_form_of_an_update_lands_on_the_same_grid(cfg):
    """Master weights, quantized tensors + scales, and the sync layer's dequantized tensors."""
    new = _new_weights(seed=1)
    want = {n: fake_quantize_weight(w, cfg) if _is_target(n) else w for n, w in new.items()}
    forms = {
        "masters": lambda e, v: e.update_weights(new.items(), v),
        "quantized": lambda e, v: e.update_weights(quantize_state_dict(new, cfg).items(), v),
        "applier": lambda e, v: WeightApplier(e, dequantize=cfg)(list(quantize_state_dict(new, cfg).items()), v),
    }
    for form, update in forms.items():
        inference = engine(cfg, deterministic=False)
        update(inference, 3)
        held = inference.named_weights()
        assert inference.weight_version == 3
        assert all(torch.equal(held[n], want[n]) for n in want), form


def test_a_weight_the_sync_layer_dequantized_is_not_quantized_twice():
    """int4_asym is not idempotent: a second pass moves some elements. The engine keeps the sync
    layer's dequantized tensor (marked by dequantize_state_dict) and quantizes an unmarked copy."""
    name = "model.layers.1.mlp.down_proj.weight"
    new = _new_weights(seed=2)
    once = dequantize_state_dict(quantize_state_dict(new, ASYM), ASYM, dtype=torch.float32)
    assert torch.equal(once[name], fake_quantize_weight(new[name], ASYM))
    twice = fake_quantize_weight(once[name], ASYM)
    assert not torch.equal(twice, once[name])  # a second pass would leave the trainer's grid
    inference = engine(ASYM, deterministic=False)
    inference.update_weights(once.items(), 1)
    assert torch.equal(inference.named_weights()[name], once[name])
    inference.update_weights([(name, once[name].clone())], 2)  # a copy carries no mark: a master weight
    assert torch.equal(inference.named_weights()[name], twice)


def _rejected(inference, named, match: str) -> None:
    before, version = {n: checksum(t) for n, t in inference.named_weights().items()}, inference.weight_version
    with pytest.raises(ValueError, match=match):
        inference.update_weights(named, 7)
    assert {n: checksum(t) for n, t in inference.named_weights().items()} == before
    assert inference.weight_version == version


def test_rejected_updates_name_the_problem_and_leave_the_engine_untouched():
    new = _new_weights(seed=3)
    sent = quantize_state_dict(new, FP8)
    _rejected(engine(None, deterministic=False), sent.items(),
              "rejected, weights untouched: '.*_proj.weight' is a quantized tensor but "
              "TorchEngineConfig.quantization is not set")
    fp8_engine = engine(FP8, deterministic=False)
    incomplete = {n: t for n, t in sent.items() if n != "model.layers.0.mlp.up_proj.weight_scale_inv"}
    _rejected(fp8_engine, incomplete.items(), "up_proj.weight is quantized but .*up_proj.weight_scale_inv is missing")
    as_int4 = dequantize_state_dict(quantize_state_dict(new, INT4), INT4, dtype=torch.float32)
    _rejected(fp8_engine, as_int4.items(),
              "arrives dequantized as int4_sym group 32 but the engine serves fp8_block \\[32, 32\\] fp32: "
              "use one QuantConfig")
    mlp_only = engine(QuantConfig(format="fp8_block", block_size=(32, 32), target_modules=["*.mlp.*"]),
                      deterministic=False)
    _rejected(mlp_only, dequantize_state_dict(sent, FP8, dtype=torch.float32).items(),
              "q_proj.weight arrives dequantized \\(fp8_block \\[32, 32\\] fp32\\) but the engine's quantization "
              "does not target it")
    with pytest.raises(SyncError, match="rejected the update to version 7: .*int4_sym group 32"):
        WeightApplier(fp8_engine, dequantize=INT4)(list(quantize_state_dict(new, INT4).items()), 7)


def test_target_checks():
    lm = CausalLM.from_pretrained(resolve_model(MODEL.name))
    assert len(qat_targets(lm, QuantConfig())) == 14  # the defaults span families: gate_up_proj is absent here
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] matches no linear layer .*layers are: down_proj, gate_proj, "
                                         "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        qat_targets(lm, QuantConfig(target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ValueError, match=r"\['q_proj'\] matches no linear layer \(exclude_modules=\['\*.self_attn.\*'\]"):
        qat_targets(lm, QuantConfig(target_modules=["q_proj", "up_proj"], exclude_modules=["*.self_attn.*"]))
    with pytest.raises(ValueError, match="targets 'lm_head', the output projection"):
        engine(QuantConfig(target_modules=["lm_head"], exclude_modules=[]), deterministic=False)


def test_qat_under_autocast_quantizes_the_weight_in_the_autocast_dtype():
    """What an FSDP bf16 forward (weights gathered in bf16) and a bf16 engine quantize."""
    layer = nn.Sequential()
    layer.add_module("proj", nn.Linear(64, 32, bias=False))
    cfg = QuantConfig(format="int4_sym", group_size=32, target_modules=["proj"])
    apply_qat(layer, cfg)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    w_bf16 = layer.proj.weight.detach().to(torch.bfloat16)
    assert torch.equal(out, F.linear(x.to(torch.bfloat16), fake_quantize_weight(w_bf16, cfg)))
    # quantizing the fp32 master and casting afterwards would give other bits
    assert not torch.equal(fake_quantize_weight(w_bf16, cfg),
                           fake_quantize_weight(layer.proj.weight.detach(), cfg).to(torch.bfloat16))
    out.float().sum().backward()  # the straight-through gradient reaches the fp32 master
    assert layer.proj.weight.grad.dtype == torch.float32 and layer.proj.weight.grad.abs().sum() > 0
