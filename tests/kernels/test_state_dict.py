"""Quantize-on-send / dequantize-on-load of HF-named weights (tiny Qwen3-MoE: dense, fused experts, router)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import QuantConfig, dequantize_state_dict, iter_quantized, quantize_state_dict
from tandem.kernels.qat import fake_quantize_weight
from tandem.models import load_model
from tests.kernels.helpers import bits

L0 = "model.layers.0"


@pytest.fixture(scope="module")
def moe_weights() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_model("tiny-qwen3-moe").state_dict().items()}


def test_fp8_block_names_dtypes_and_shapes(moe_weights):
    cfg = QuantConfig(format="fp8_block", block_size=(32, 32))
    sent = quantize_state_dict(moe_weights, cfg)
    q = sent[f"{L0}.self_attn.k_proj.weight"]  # [32, 64]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (32, 64)
    assert sent[f"{L0}.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)
    experts = sent[f"{L0}.mlp.experts.gate_up_proj"]  # fused [E, 2I, H] = [8, 64, 64]
    assert experts.dtype == torch.float8_e4m3fn and sent[f"{L0}.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 2, 2)
    for untouched in (f"{L0}.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert sent[untouched] is moe_weights[untouched]  # router, head, embedding, norms pass through
    quantized = [k for k in moe_weights if sent[k].dtype == torch.float8_e4m3fn]
    assert len(quantized) == 2 * 6  # per layer: q, k, v, o, experts.gate_up_proj, experts.down_proj
    assert set(sent) == set(moe_weights) | {f"{k}_scale_inv" for k in quantized}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(format="fp8_block", block_size=(32, 32)),
        dict(format="fp8_block", block_size=(128, 128), scale="ue8m0"),
        dict(format="mxfp8"),
        dict(format="int4_sym", group_size=32),
        dict(format="int4_asym", group_size=64),
    ],
    ids=lambda kw: "-".join(str(v) for v in kw.values()),
)
def test_round_trip_equals_fake_quantization(moe_weights, kwargs):
    cfg = QuantConfig(**kwargs)
    sent = quantize_state_dict(moe_weights, cfg)
    streamed = list(iter_quantized(moe_weights.items(), cfg))  # what a bucketed sender sees
    assert [k for k, _ in streamed] == list(sent)
    assert all(torch.equal(bits(v), bits(sent[k])) for k, v in streamed)
    loaded = dequantize_state_dict(sent, cfg, dtype=torch.float32)
    assert list(loaded) == list(moe_weights)  # names and order restored
    for name, w in moe_weights.items():
        module = name.removesuffix(".weight")
        if w.dim() >= 2 and cfg.targets(module):
            assert torch.equal(loaded[name], fake_quantize_weight(w, cfg)), name
            assert not torch.equal(loaded[name], w), name
        else:
            assert loaded[name] is w, name


def test_int4_tensors_use_compressed_tensors_names(moe_weights):
    cfg = QuantConfig(format="int4_asym", group_size=32)
    sent = quantize_state_dict(moe_weights, cfg)
    name = f"{L0}.mlp.experts.down_proj"  # [8, 64, 32]
    assert sent[f"{name}_packed"].shape == (8, 64, 16) and sent[f"{name}_packed"].dtype == torch.uint8
    assert sent[f"{name}_scale"].shape == (8, 64, 1) and sent[f"{name}_zero_point"].dtype == torch.uint8
    assert sent[f"{name}_shape"].tolist() == [8, 64, 32]
    assert name not in sent


def test_ue8m0_scales_are_powers_of_two(moe_weights):
    sent = quantize_state_dict(moe_weights, QuantConfig(format="fp8_block", scale="ue8m0", block_size=(32, 32)))
    scales = torch.cat([v.flatten() for k, v in sent.items() if k.endswith("_scale_inv")])
    mantissa = scales.view(torch.int32) & 0x7FFFFF
    assert (mantissa == 0).all() and (scales > 0).all()


def test_missing_or_orphan_companions_raise(moe_weights):
    cfg = QuantConfig(format="fp8_block", block_size=(32, 32))
    sent = quantize_state_dict(moe_weights, cfg)
    name = f"{L0}.self_attn.q_proj.weight"
    without_scale = {k: v for k, v in sent.items() if k != f"{name}_scale_inv"}
    with pytest.raises(ValueError, match=f"{name} is quantized but {name}_scale_inv is missing"):
        dequantize_state_dict(without_scale, cfg)
    int4_cfg = QuantConfig(format="int4_sym", group_size=32)
    int4_sent = quantize_state_dict(moe_weights, int4_cfg)
    with pytest.raises(ValueError, match="_packed belongs to .* not quantized as fp8_block"):
        dequantize_state_dict(int4_sent, cfg)  # the engine was told the wrong format
    with pytest.raises(ValueError, match="is quantized but .*_zero_point is missing"):
        dequantize_state_dict(int4_sent, QuantConfig(format="int4_asym", group_size=32))
