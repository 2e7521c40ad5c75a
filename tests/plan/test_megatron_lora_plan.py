"""The planner's Megatron LoRA: the adapters each rank holds (also checked against the engine's ranks in
tests/engines/megatron/test_megatron_dist.py), a frozen base without gradients or optimizer state, activations
without sequence parallelism, the search order, the refusals of what the engine cannot do, and the written
recipe read back by `tandem plan --check --recipe`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from tandem.config import load_config
from tandem.plan.archs import resolve_arch
from tandem.plan.hardware import device
from tandem.plan.memory import (
    InferenceLayout,
    TrainerLayout,
    Workload,
    activation_width,
    lora_params,
    megatron_lora_params,
    trainer_memory,
)
from tandem.plan.planner import check, plan
from tandem.plan.recipe import recipe_dict
from tandem.runtime.config import RunConfig

WL = Workload(prompt_len=1024, response_len=4096, prompts=16, samples=8, lora_rank=16)


@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-135m-instruct", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-70B"])
def test_one_rank_holds_every_adapter_and_tp_splits_only_the_sharded_factor(name):
    arch = resolve_arch(name)
    assert megatron_lora_params(arch, 16, tp=1) == lora_params(arch, 16)
    h = arch.hidden
    replicated = 16 * 7 * h * arch.layers  # A of q/k/v/gate/up and B of o/down: whole on every TP rank
    for tp in (2, 4, 8):
        assert megatron_lora_params(arch, 16, tp=tp) == pytest.approx(
            replicated + (lora_params(arch, 16) - replicated) / tp, abs=arch.layers)
    assert megatron_lora_params(arch, 16, tp=1, pp=2) == pytest.approx(lora_params(arch, 16) / 2, rel=0.05)


def test_the_frozen_base_has_no_gradients_no_optimizer_state_and_is_the_reference():
    arch, dev = resolve_arch("meta-llama/Llama-3.1-70B"), device("H100")
    lay = TrainerLayout(engine="megatron", gpus=8, tp=8)
    full = trainer_memory(arch, dev, replace(WL, lora_rank=0, ref=True), lay)
    lora = trainer_memory(arch, dev, replace(WL, ref=True), lay)
    adapters = megatron_lora_params(arch, 16, 8)
    assert lora["weights"] == pytest.approx(full["weights"] + 2 * adapters)
    assert lora["gradients"] == 4 * adapters < 0.02 * full["gradients"]
    assert lora["optimizer"] == 12 * adapters  # one data-parallel rank: the whole of the adapters' state
    assert "reference" in full and "reference" not in lora  # LoRA's reference is the base with adapters off
    two_replicas = trainer_memory(arch, dev, WL, replace(lay, gpus=16))
    assert two_replicas["optimizer"] == pytest.approx(lora["optimizer"] / 2)  # distributed optimizer over DP


@pytest.mark.parametrize("ckpt", [False, True])
def test_without_sequence_parallelism_the_norms_tensors_stay_whole_on_every_tp_rank(ckpt):
    arch, dev = resolve_arch("meta-llama/Llama-3.1-70B"), device("H100")
    lay = TrainerLayout(engine="megatron", gpus=8, tp=8, activation_checkpointing=ckpt, micro_batch_tokens=8192)
    sp = trainer_memory(arch, dev, replace(WL, lora_rank=0), lay)["activations"]
    no_sp = trainer_memory(arch, dev, replace(WL, lora_rank=0), replace(lay, sequence_parallel=False))["activations"]
    lora = trainer_memory(arch, dev, WL, lay)["activations"]  # LoRA: no sequence parallelism, whatever is asked
    assert lora == no_sp > sp
    w, h, layers, tokens = activation_width(arch, lay), arch.hidden, arch.layers, 8192
    if ckpt:  # the stored layer inputs are replicated too
        assert no_sp - sp == pytest.approx(layers * tokens * h * 2 * (1 - 1 / 8) + tokens * 2 * 4 * h * (1 - 1 / 8))
    else:
        assert no_sp / sp == pytest.approx((4 * h + (w - 4 * h) / 8) / (w / 8))


def test_lora_tries_megatron_after_fsdp_for_a_dense_native_model_only():
    # 405B on 8 H200: the FSDP base and activations do not fit without offload; Megatron TP 8 does
    wl = replace(WL, response_len=4096)
    p = plan(resolve_arch("meta-llama/Llama-3.1-405B-Instruct"), device("H200"), wl, 8, search_min=False)
    assert p.fits and p.trainer.engine == "megatron" and not p.trainer.offload, p.reason
    assert not p.trainer.sequence_parallel and p.to_json()["trainer"]["sequence_parallel"] is False
    assert p.trainer_items["gradients"] == 4 * megatron_lora_params(p.arch, 16, p.trainer.tp, p.trainer.pp)
    assert any("LoRA on Megatron" in w for w in p.why)
    # the same workload as full fine-tuning plans Megatron with sequence parallelism
    full = plan(p.arch, p.device, replace(wl, lora_rank=0), 8, search_min=False)
    assert not full.fits or full.to_json()["trainer"]["sequence_parallel"] == (full.trainer.engine == "megatron")
    # QLoRA, a MoE and an architecture Tandem's Megatron engine does not build stay on FSDP
    for model, gpu, gpus, wl2 in (("meta-llama/Llama-3.1-405B-Instruct", "H200", 8, replace(wl, quantize_base="fp8_block")),
                                  ("Qwen/Qwen3-235B-A22B", "H100", 32, wl),
                                  ("google/gemma-3-27b-it", "H100", 2, replace(wl, response_len=32768))):
        q = plan(resolve_arch(model), device(gpu), wl2, gpus, search_min=False)
        assert q.trainer is None or q.trainer.engine == "fsdp", (model, q.reason)


def _megatron_check(model, wl, **lay):
    arch, dev = resolve_arch(model), device("H100")
    trainer = TrainerLayout(engine="megatron", gpus=lay.pop("gpus", 2), micro_batch_tokens=8192, **lay)
    inference = InferenceLayout(engine="vllm", tp=2, replicas=1)
    return check(arch, dev, wl, trainer.gpus, trainer, inference, "colocated")


def test_check_names_what_the_megatron_engine_refuses_with_lora():
    assert _megatron_check("Qwen/Qwen3-8B", WL, tp=2, sequence_parallel=False).fits
    cases = {"sequence parallelism with LoRA": ("Qwen/Qwen3-8B", WL, {"tp": 2}),
             "a quantized base": ("Qwen/Qwen3-8B", replace(WL, quantize_base="fp8_block"), {"tp": 2,
                                                                                            "sequence_parallel": False}),
             "adapters on a MoE's experts": ("Qwen/Qwen3-30B-A3B", WL, {"tp": 2, "sequence_parallel": False})}
    for what, (model, wl, lay) in cases.items():
        p = _megatron_check(model, wl, **lay)
        assert not p.fits and "Tandem's Megatron engine refuses LoRA with" in p.reason and what in p.reason, p.reason
    full = _megatron_check("Qwen/Qwen3-8B", replace(WL, lora_rank=0), tp=2)  # full fine-tuning keeps SP
    assert "refuses" not in full.reason


def test_the_written_recipe_runs_lora_on_megatron_and_reads_back(tmp_path, capsys):
    from tandem.cli import main

    p = _megatron_check("Qwen/Qwen3-8B", WL, tp=2, sequence_parallel=False)
    assert p.fits, p.reason
    recipe = recipe_dict(p, "Qwen/Qwen3-8B")
    meg = recipe["trainer"]["megatron"]
    assert meg["lora"]["rank"] == 16 and meg["layer_spec"] == "local" and meg["parallel"]["sequence_parallel"] is False
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cfg = load_config(RunConfig, path)
    assert cfg.trainer.config.lora.rank == 16 and not cfg.trainer.config.parallel.sequence_parallel
    assert main(["plan", "--check", "--recipe", str(path), "--gpu-type", "H100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainer"]["lora_rank"] == 16 and out["trainer"]["sequence_parallel"] is False
    items = out["memory_gib_per_gpu"]["trainer_items"]
    assert items["gradients"] == pytest.approx(p.trainer_items["gradients"] / 2**30, abs=0.01)
    # without --recipe, `--check --trainer megatron --lora 16` judges what the engine runs: no sequence parallelism
    assert main(["plan", "--check", "Qwen/Qwen3-8B", "--gpus", "2", "--trainer", "megatron", "--tp", "2", "--lora",
                 "16", "--inference-tp", "2", "--json", "--prompt-len", "1024", "--response-len", "4096",
                 "--prompts", "16", "--samples", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["trainer"]["sequence_parallel"] is False


def test_megatron_on_a_cpu_is_fp32_whose_parameters_are_their_own_masters():
    arch = resolve_arch("smollm2-135m-instruct")  # tied: one table on the one stage
    p = arch.total_params()
    full = trainer_memory(arch, device("cpu"), replace(WL, lora_rank=0), TrainerLayout(engine="megatron", gpus=1))
    assert (full["weights"], full["gradients"], full["optimizer"]) == (4 * p, 4 * p, 8 * p)
    gpu = trainer_memory(arch, device("H100"), replace(WL, lora_rank=0), TrainerLayout(engine="megatron", gpus=1))
    assert (gpu["weights"], gpu["gradients"], gpu["optimizer"]) == (2 * p, 4 * p, 12 * p)  # bf16 + fp32 master
