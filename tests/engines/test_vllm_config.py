"""The vLLM adapter's config and import behaviour: these run without vLLM installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.engines.inference.vllm import VLLMEngineConfig
from tandem.models import ModelConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(backend="ray"), "backend='ray' must be 'inprocess' or 'async'"),
        (dict(max_model_len=1), "max_model_len=1 must be >= 2"),
        (dict(filtered_logprobs="drop"), "filtered_logprobs='drop' must be 'reject' or 'renormalized'"),
        (dict(lora_alpha=0.0), "lora_alpha=0.0 must be > 0"),
        (dict(lora_max_rank=0), "lora_max_rank=0 must be >= 1"),
        (dict(sleep_level=3), "sleep_level=3 must be 1 or 2"),
        (dict(engine_kwargs={"logprobs_mode": "raw_logprobs"}), "engine_kwargs['logprobs_mode'] is set by the adapter"),
        (dict(engine_kwargs={"dtype": "half"}), r"use VLLMEngineConfig.model.dtype instead"),
        (dict(engine_kwargs={"max_model_len": 9}), r"use VLLMEngineConfig.max_model_len instead"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        VLLMEngineConfig(model=ModelConfig(name="tiny-llama"), **kwargs)


def test_engine_kwargs_pass_through_untouched():
    cfg = VLLMEngineConfig(engine_kwargs={"max_num_seqs": 7, "enable_prefix_caching": False, "future_flag": 1})
    assert cfg.engine_kwargs == {"max_num_seqs": 7, "enable_prefix_caching": False, "future_flag": 1}
    assert cfg.model is None and cfg.backend == "inprocess"


def test_importing_the_adapter_does_not_import_vllm():
    code = ("import sys, tandem.engines.inference.vllm as m; m.VLLMEngineConfig(); "
            "import tandem.engines.inference.vllm.engine; assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_building_an_engine_without_vllm_names_the_install():
    from tandem.engines.inference.vllm.engine import VLLMEngine, vllm_available

    if vllm_available() is None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match=r"pip install 'tandem-rl\[vllm\]'"):
        VLLMEngine(VLLMEngineConfig(model=ModelConfig(name="tiny-llama")))
