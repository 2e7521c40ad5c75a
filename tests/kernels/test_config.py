"""QuantConfig validation and module matching; the package imports without triton."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.config import ConfigError, from_dict
from tandem.kernels import QuantConfig


def test_from_yaml_style_dict():
    cfg = from_dict(QuantConfig, {"format": "int4_asym", "group_size": 64, "target_modules": ["*.mlp.*"]})
    assert cfg.format == "int4_asym" and cfg.group_size == 64 and cfg.block_size == (128, 128)
    cfg = from_dict(QuantConfig, {"block_size": [64, 32], "scale": "ue8m0"})
    assert cfg.block_size == (64, 32)
    with pytest.raises(ConfigError, match="format: 'fp4' is not a valid choice"):
        from_dict(QuantConfig, {"format": "fp4"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=(96, 128)), "block_size=\\[96, 128\\]: each side must be a power of two in \\[1, 512\\]"),
        (dict(block_size=(512, 512)), "more than 65536 elements"),
        (dict(group_size=48), "group_size=48 must be a power of two in \\[8, 1024\\]"),
        (dict(format="int4_sym", scale="ue8m0"), "scale='ue8m0' applies to fp8 formats only"),
        (dict(format="int4_asym", quantize_activations=True), "quantize_activations=True needs an fp8 format"),
        (dict(target_modules=[]), "target_modules must name at least one"),
        (dict(format="nf4"), "format='nf4' is not one of"),
    ],
)
def test_validation_names_value_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantConfig(**kwargs)


def test_module_matching():
    cfg = QuantConfig()
    assert cfg.targets("model.layers.3.self_attn.q_proj")
    assert cfg.targets("model.layers.0.mlp.experts.gate_up_proj")
    assert not cfg.targets("lm_head") and not cfg.targets("model.layers.0.mlp.gate")
    assert not cfg.targets("model.layers.0.self_attn.q_norm")
    assert not cfg.targets("model.layers.0.self_attn.xq_proj")  # suffix match is per dotted component
    glob = QuantConfig(target_modules=["model.layers.1.*"], exclude_modules=["*.v_proj"])
    assert glob.targets("model.layers.1.mlp.up_proj") and not glob.targets("model.layers.0.mlp.up_proj")
    assert not glob.targets("model.layers.1.self_attn.v_proj")  # exclusion wins


def test_import_does_not_load_triton():
    code = (
        "import sys, torch, tandem.kernels as k\n"
        "k.fake_quantize_fp8_block(torch.randn(4, 8), (2, 4))\n"
        "print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
