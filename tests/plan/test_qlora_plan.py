"""The planner's QLoRA workload (`--lora R --quantize-base FORMAT`): the count of quantized weights against what
the FSDP engine quantizes, the bytes per weight against the kernels' tensors, the memory items, the refusals, the
written recipe and the SmolLM2 QLoRA recipe against its measured peak."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from tandem.config import load_config
from tandem.plan.archs import resolve_arch
from tandem.plan.hardware import GIB, device
from tandem.plan.memory import (
    BASE_BYTES,
    TrainerLayout,
    Workload,
    lora_params,
    quantized_base_params,
    trainer_memory,
)
from tandem.plan.planner import plan
from tandem.plan.recipe import recipe_dict
from tandem.runtime.config import RunConfig

RECIPES = Path(__file__).parents[2] / "recipes" / "smollm2-135m"


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe", "smollm2-135m-instruct"])
def test_quantized_base_params_count_what_the_fsdp_engine_quantizes(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.engines.training.fsdp.qlora import QuantizedLinear, quantize_base
    from tandem.kernels import QuantConfig
    from tandem.models.registry import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(name))
    with torch.device("meta"):  # the shapes only; the linear layers get real (constant) weights to quantize
        lm = AutoModelForCausalLM.from_config(config)
    for n, m in [(n, m) for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear)]:
        real = torch.nn.utils.skip_init(torch.nn.Linear, m.in_features, m.out_features, bias=m.bias is not None)
        torch.nn.init.ones_(real.weight)
        parent, _, leaf = n.rpartition(".")
        setattr(lm.get_submodule(parent) if parent else lm, leaf, real)
    quantize_base(lm, QuantConfig(format="fp8_block"), output_module="lm_head")
    quantized = sum(m.in_features * m.out_features for m in lm.modules() if isinstance(m, QuantizedLinear))
    assert quantized == quantized_base_params(resolve_arch(name)) > 0


@pytest.mark.parametrize("fmt", sorted(BASE_BYTES))
def test_base_bytes_per_weight_are_the_kernels_tensors(fmt):
    from tandem.kernels import QuantConfig
    from tandem.kernels.state_dict import quantize_tensor

    w = torch.randn(1536, 576)
    nbytes = sum(t.numel() * t.element_size() for _, t in quantize_tensor("weight", w, QuantConfig(format=fmt)))
    assert nbytes / w.numel() == pytest.approx(BASE_BYTES[fmt], rel=0.01)


def test_a_quantized_base_is_held_by_every_rank_and_not_gathered():
    arch, dev = resolve_arch("Qwen/Qwen3-8B"), device("H100")
    lora = Workload(prompt_len=512, response_len=512, prompts=8, samples=8, lora_rank=16)
    qlora = Workload(prompt_len=512, response_len=512, prompts=8, samples=8, lora_rank=16, quantize_base="fp8_block")
    q = quantized_base_params(arch)
    for gpus in (1, 8):
        a, b = (trainer_memory(arch, dev, wl, TrainerLayout(gpus=gpus)) for wl in (lora, qlora))
        assert b["quantized_base"] == pytest.approx(q * BASE_BYTES["fp8_block"])  # not divided by the ranks
        assert a["weights"] - b["weights"] == pytest.approx(q * 2 / gpus)  # bf16 weights no longer sharded
        assert a["optimizer"] == b["optimizer"] and a["gradients"] == b["gradients"]
    one, eight = (trainer_memory(arch, dev, qlora, TrainerLayout(gpus=g)) for g in (1, 8))
    assert eight["gathered"] < trainer_memory(arch, dev, lora, TrainerLayout(gpus=8))["gathered"]
    assert "gathered" not in one
    offloaded = trainer_memory(arch, dev, qlora, TrainerLayout(gpus=8, offload=True))
    assert offloaded["weights"] == 0 and offloaded["quantized_base"] == eight["quantized_base"]  # buffers stay


def test_quantize_base_refuses_full_fine_tuning_and_unknown_formats():
    with pytest.raises(ValueError, match="quantize_base='fp8_block' needs a LoRA rank"):
        Workload(prompt_len=8, response_len=8, prompts=1, samples=1, quantize_base="fp8_block")
    with pytest.raises(ValueError, match="quantize_base='nf4' is not one of fp8_block"):
        Workload(prompt_len=8, response_len=8, prompts=1, samples=1, lora_rank=8, quantize_base="nf4")


def test_the_cli_refuses_quantize_base_without_lora(capsys):
    from tandem.cli import main

    assert main(["plan", "Qwen/Qwen3-8B", "--quantize-base", "int4_sym"]) == 2
    assert "quantize_base='int4_sym' needs a LoRA rank" in capsys.readouterr().err


def test_qlora_fits_where_lora_does_not_and_the_knob_says_so(tmp_path):
    # Llama-3.1-70B on one H200 (141 GiB) with FP8 rollouts and 100 GiB of host memory: a bf16 base (141 GB) fits
    # neither on the GPU nor offloaded to the host (nor does loading it: 261 GiB in fp32); an FP8 one (~64 GiB)
    # fits on the GPU, and quantized as it is read it needs ~73 GiB of host memory to build
    arch = resolve_arch("meta-llama/Llama-3.1-70B-Instruct")
    dev = replace(device("H200"), host_memory_gib=100.0)
    wl = Workload(prompt_len=512, response_len=1024, prompts=4, samples=4, lora_rank=16, precision="fp8")
    p = plan(arch, dev, wl, 1)
    assert not p.fits and any(k.startswith("--quantize-base fp8_block") for k in p.knobs), p.knobs
    q = plan(arch, dev, replace(wl, quantize_base="fp8_block"), 1)
    assert q.fits, q.reason
    assert q.trainer_items["quantized_base"] / GIB == pytest.approx(63.8, abs=0.5)
    assert any("QLoRA" in why for why in q.why)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(q, "meta-llama/Llama-3.1-70B-Instruct")))
    cfg = load_config(RunConfig, path)
    assert cfg.trainer.config.lora.quantize_base.format == "fp8_block"


def test_smollm2_qlora_recipe_against_bench_lora(capsys):
    # docs/benchmarks.md, "LoRA and QLoRA", 2026-12-06 (session 5): QLoRA r16 on an FP8 base, 3-step peak RSS
    # 2,158 MiB (median of 3), LoRA 2,419. The plan reads the recipe's quantize_base and counts the FP8 base; planned
    # for the recipe's longest rows, it bounds the run from above (tests/plan/test_cpu_validation.py: at most 45% over).
    from tandem.cli import main

    memory = {}
    for recipe in ("addition-grpo-qlora.yaml", "addition-grpo-lora.yaml"):
        assert main(["plan", "--check", "--recipe", str(RECIPES / recipe), "--json"]) == 0
        memory[recipe] = json.loads(capsys.readouterr().out)
    qlora = memory["addition-grpo-qlora.yaml"]
    assert qlora["trainer"]["quantize_base"] == "fp8_block"
    planned = qlora["memory_gib_per_gpu"]["trainer"] * 1024
    assert 0.95 <= planned / 2158.0 <= 1.45, planned
    saved = (memory["addition-grpo-lora.yaml"]["memory_gib_per_gpu"]["trainer"] - qlora["memory_gib_per_gpu"]["trainer"])
    # the FP8 base saves 3 of the 4 bytes of every quantized weight: 106M of SmolLM2's 134.5M
    assert saved * GIB == pytest.approx(quantized_base_params(resolve_arch("smollm2-135m-instruct")) * 3, rel=0.05)


def test_a_planned_qlora_recipe_trains_two_steps(tmp_path):
    from tandem.cli import main

    wl = Workload(prompt_len=128, response_len=16, prompts=2, samples=4, lora_rank=8, quantize_base="int4_sym")
    p = plan(resolve_arch("tiny-qwen3"), device("cpu"), wl, 1)
    assert p.fits, p.reason
    recipe = recipe_dict(p, "tiny-qwen3", steps=2)
    assert recipe["sync"] == {"lora_mode": "adapter"}
    recipe["tracking"] = {"progress": False}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "train/loss" in r]) == 2
    synced = [r["sync/bytes"] for r in rows if r.get("sync/bytes")]
    arch = resolve_arch("tiny-qwen3")
    assert synced and max(synced) == lora_params(arch, 8) * 4 < arch.total_params()  # fp32 adapters only


@pytest.mark.parametrize("change", [{"sync": {"lora_mode": "merged"}}, {"sync": {"lora_mode": "adapter",
                                                                                 "share_frozen_base": False}}])
def test_a_lora_recipe_that_does_not_share_its_base_is_planned_with_the_engines_copy(tmp_path, capsys, change):
    # the run shares the frozen base only when colocated with adapter-only sync and share_frozen_base (loop.py)
    from tandem.cli import main

    recipe = yaml.safe_load((RECIPES / "addition-grpo-lora.yaml").read_text())
    recipe.update(change)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    planned = {}
    for name, p in (("shared", RECIPES / "addition-grpo-lora.yaml"), ("own", path)):
        assert main(["plan", "--check", "--recipe", str(p), "--json"]) == 0
        planned[name] = json.loads(capsys.readouterr().out)["memory_gib_per_gpu"]
    assert planned["shared"]["inference_items"]["weights"] == 0.0
    own = planned["own"]["inference_items"]["weights"]
    assert own > 0.1  # the embedding and vocabulary projection it keeps plain (its packed copies are counted apart)
    assert planned["own"]["trainer"] > planned["shared"]["trainer"] + own
