"""config.json read without transformers gives the native model exactly what AutoConfig gives it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from tandem.models import resolve_model
from tandem.models.hf_config import DEFAULTS, ConfigJSON, read_hf_config
from tandem.models.transformer import TransformerArgs, _rope_inv_freq

TINY = {"llama": "tiny-llama", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3", "qwen3_moe": "tiny-qwen3-moe"}


def _args_both_ways(folder):
    """TransformerArgs from read_hf_config and from AutoConfig, hf_config left out, and their rope tables."""
    from transformers import AutoConfig

    light = read_hf_config(folder)
    assert isinstance(light, ConfigJSON)
    a = TransformerArgs.from_hf_config(light)
    b = TransformerArgs.from_hf_config(AutoConfig.from_pretrained(str(folder)))
    return a, b


def _assert_same(a: TransformerArgs, b: TransformerArgs) -> None:
    assert dataclasses.replace(a, hf_config=None) == dataclasses.replace(b, hf_config=None)
    (fa, sa), (fb, sb) = _rope_inv_freq(a), _rope_inv_freq(b)
    torch.testing.assert_close(fa, fb, rtol=0, atol=0)
    assert sa == sb


@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_models_read_as_autoconfig_reads_them(family):
    a, b = _args_both_ways(resolve_model(TINY[family]))
    _assert_same(a, b)


@pytest.mark.parametrize("family", sorted(DEFAULTS))
@pytest.mark.parametrize("drop", ["all_optional", "rope_theta_only"])
def test_fields_left_out_take_transformers_defaults(tmp_path, family, drop):
    """A config.json with only what a model needs: every other field from transformers' config class."""
    raw = {"model_type": family, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 96, "vocab_size": 300}
    if drop == "rope_theta_only":  # the common real shape: everything set but the rotary base
        raw.update(num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True,
                   head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    a, b = _args_both_ways(tmp_path)
    _assert_same(a, b)


def test_file_values_win_and_rope_is_normalised(tmp_path):
    raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 96, "vocab_size": 300, "head_dim": None, "rope_theta": 5e5,
           "rope_scaling": None, "attention_bias": True, "num_key_value_heads": None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    a, b = _args_both_ways(tmp_path)
    _assert_same(a, b)
    assert a.head_dim == 16 and a.num_kv_heads == 4 and a.qkv_bias and a.o_bias  # nulls resolved as HF does
    cfg = read_hf_config(tmp_path)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    assert cfg.to_dict() == raw  # what save_pretrained writes back: the file's own content
    raw["to_dict"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_hf_config(tmp_path).to_dict() == raw  # a key cannot shadow the method


@pytest.mark.parametrize("extra", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256}},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"partial_rotary_factor": 0.5},
    {"model_type": "gpt2"},
])
def test_anything_else_goes_through_autoconfig(tmp_path, extra):
    from transformers import PretrainedConfig

    raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 96, "vocab_size": 300, **extra}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert isinstance(read_hf_config(tmp_path), PretrainedConfig)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        read_hf_config(tmp_path)


def test_native_model_loads_without_importing_transformers():
    """The point of it all: a process that only builds the native model never imports transformers."""
    folder = resolve_model("tiny-llama")  # built (with transformers) here, in the test process
    code = (
        "import sys, torch\n"
        "from tandem.models import resolve_model\n"
        "from tandem.models.transformer import CausalLM\n"
        "m = CausalLM.from_pretrained(resolve_model('tiny-llama'))\n"
        "assert m.args.vocab_size > 0\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    assert folder.is_dir()
