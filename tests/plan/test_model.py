"""Architecture table, hardware table, memory model arithmetic, refusals, recipes."""

from __future__ import annotations

import json

import pytest
import yaml

from tandem.config import load_config
from tandem.plan.archs import ARCHS, arch_from_hf_config, resolve_arch
from tandem.plan.hardware import device
from tandem.plan.memory import TrainerLayout, Workload, trainer_memory
from tandem.plan.planner import plan
from tandem.plan.recipe import RecipeError, recipe_dict
from tandem.runtime.config import RunConfig


@pytest.mark.parametrize("name,billions", [("Qwen/Qwen3-8B", 8.19), ("Qwen/Qwen3-235B-A22B", 235.1),
                                           ("deepseek-ai/DeepSeek-V3", 671.0), ("meta-llama/Llama-3.1-70B-Instruct", 70.6),
                                           ("zai-org/GLM-4.5-Air", 106.9), ("openai/gpt-oss-120b", 116.8),
                                           ("mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7), ("Qwen/Qwen3-30B-A3B", 30.5)])
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert resolve_arch(name).total_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_active_parameters_of_moe():
    assert resolve_arch("Qwen/Qwen3-235B-A22B").active_params() / 1e9 == pytest.approx(22, rel=0.03)
    assert resolve_arch("qwen3-30b-a3b").active_params() / 1e9 == pytest.approx(3.3, rel=0.03)


def test_config_json_and_registry_models(tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = resolve_arch(str(tmp_path))
    assert (a.layers, a.kv_heads, a.head_dim, a.native) == (2, 2, 16, True)
    assert resolve_arch(str(tmp_path / "config.json")).total_params() == a.total_params()
    smol = resolve_arch("smollm2-135m-instruct")
    assert smol.total_params() == 134_515_008 and smol.tied  # the real checkpoint's count (FACTS.md: 134.5M)
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        arch_from_hf_config({"num_hidden_layers": 2}, "x")
    with pytest.raises(ValueError, match="unknown model 'nope/none'"):
        resolve_arch("nope/none")


def test_every_table_entry_has_a_consistent_shape():
    for a in ARCHS.values():
        assert a.heads % a.kv_heads == 0, a.name
        assert a.total_params() >= a.active_params() > 0


def test_unknown_gpu_and_memory_override():
    assert device("h800").name == "H100" and device("H100", 40).memory_gib == 40
    with pytest.raises(ValueError, match="unknown GPU type 'V100'"):
        device("V100")


def test_fsdp_state_is_16_bytes_per_parameter_sharded():
    arch, dev = resolve_arch("Qwen/Qwen3-8B"), device("H100")
    wl = Workload(prompt_len=512, response_len=512, prompts=8, samples=8)
    one = trainer_memory(arch, dev, wl, TrainerLayout(gpus=1))
    eight = trainer_memory(arch, dev, wl, TrainerLayout(gpus=8))
    p = arch.total_params()
    assert one["weights"] + one["gradients"] + one["optimizer"] == 16 * p
    assert eight["optimizer"] == pytest.approx(one["optimizer"] / 8)
    lora = trainer_memory(arch, dev, Workload(prompt_len=512, response_len=512, prompts=8, samples=8, lora_rank=16),
                          TrainerLayout(gpus=1))
    assert lora["optimizer"] < 0.01 * one["optimizer"]


def test_refusal_names_the_limit_and_the_knobs():
    p = plan(resolve_arch("Qwen/Qwen2.5-72B-Instruct"), device("L40S"), Workload(prompt_len=1024, response_len=4096,
             prompts=32, samples=8), 2)
    assert not p.fits and "GiB" in p.reason
    assert p.min_gpus is not None and p.min_gpus > 2
    assert any(k.startswith("--gpus") for k in p.knobs)
    with pytest.raises(RecipeError, match="does not fit"):
        recipe_dict(p, "Qwen/Qwen2.5-72B-Instruct")


def test_moe_goes_to_megatron_with_expert_parallelism():
    p = plan(resolve_arch("Qwen/Qwen3-235B-A22B"), device("H100"),
             Workload(prompt_len=1024, response_len=8192, prompts=16, samples=8), 64)
    assert p.fits and p.trainer.engine == "megatron" and p.trainer.ep > 1 and p.inference.ep > 1


def test_async_mode_splits_the_gpus_so_neither_side_waits():
    # few long decodes: rollout is bound by per-step latency, not by GPUs, so overlapping it with training pays
    wl = Workload(prompt_len=1024, response_len=4096, prompts=16, samples=8, mode="one_step_off")
    p = plan(resolve_arch("Qwen/Qwen3-8B"), device("H100"), wl, 16)
    assert p.fits and p.placement == "disaggregated", p.times
    fast, slow = sorted([p.times["rollout"], p.times["train"]])
    assert fast / slow > 0.3  # the split balances the sides
    colocated_total = p.times["total"]
    sync = plan(resolve_arch("Qwen/Qwen3-8B"), device("H100"), Workload(prompt_len=1024, response_len=4096,
                prompts=16, samples=8), 16)
    assert sync.placement == "colocated" and sync.times["total"] > colocated_total  # no overlap in sync mode


@pytest.mark.parametrize("model,gpu,gpus,lora", [
    ("Qwen/Qwen3-0.6B", "H100", 1, 0), ("Qwen/Qwen3-8B", "H100", 8, 0), ("Qwen/Qwen3-8B", "H100", 8, 32),
    ("Qwen/Qwen3-32B", "H100", 8, 0), ("Qwen/Qwen3-30B-A3B", "H100", 16, 0), ("Qwen/Qwen3-235B-A22B", "H100", 64, 0),
    ("meta-llama/Llama-3.1-70B-Instruct", "H100", 32, 0), ("meta-llama/Llama-3.1-70B-Instruct", "H100", 8, 64),
    ("deepseek-ai/DeepSeek-V3", "H100", 256, 0), ("zai-org/GLM-4.5-Air", "H100", 16, 0),
    ("tiny-qwen3", "cpu", 1, 0), ("tiny-qwen3", "cpu", 2, 0)])
def test_written_recipes_validate(tmp_path, model, gpu, gpus, lora):
    wl = Workload(prompt_len=256, response_len=1024, prompts=8, samples=4, lora_rank=lora)
    p = plan(resolve_arch(model), device(gpu), wl, gpus, search_min=False)
    assert p.fits, p.reason
    if p.trainer.engine == "megatron" and not p.arch.native:  # DeepSeek-V3, GLM-4.5-Air: Tandem's Megatron lacks them
        with pytest.raises(RecipeError, match=f"builds only the architectures of its native model.*not {p.arch.family}"):
            recipe_dict(p, model)
        return
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(p, model)))
    cfg = load_config(RunConfig, path)
    assert cfg.trainer.engine == p.trainer.engine and cfg.rollout.sampling.max_new_tokens == 1024


def test_sglang_recipe_follows_the_engine_registry(tmp_path):
    from tandem.engines.registry import registry
    from tandem.plan.memory import InferenceLayout, TrainerLayout
    from tandem.plan.planner import check

    arch, dev = resolve_arch("Qwen/Qwen3-30B-A3B"), device("H100")
    wl = Workload(prompt_len=1024, response_len=8192, prompts=8, samples=4)
    p = check(arch, dev, wl, 8, TrainerLayout(engine="megatron", gpus=8, tp=4, ep=8, offload=True,
                                                activation_checkpointing=True, micro_batch_tokens=20480),
              InferenceLayout(engine="sglang", tp=8, ep=8, mem_fraction=0.7), "colocated")
    assert p.fits, p.reason
    if "sglang" not in registry("inference").names():
        with pytest.raises(RecipeError, match="sglang is not in this Tandem's engine registry"):
            recipe_dict(p, "Qwen/Qwen3-30B-A3B")
        return
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(p, "Qwen/Qwen3-30B-A3B")))
    cfg = load_config(RunConfig, path)
    assert cfg.inference.engine == "sglang" and cfg.inference.config.server_args["ep_size"] == 8


def test_reference_model_and_precision_in_recipes(tmp_path):
    arch, dev = resolve_arch("Qwen/Qwen3-8B"), device("H100")
    wl = Workload(prompt_len=512, response_len=1024, prompts=8, samples=4, ref=True, precision="fp8")
    p = plan(arch, dev, wl, 8, search_min=False)
    assert p.trainer_items["reference"] > 0
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(p, "Qwen/Qwen3-8B")))
    cfg = load_config(RunConfig, path)
    assert cfg.algorithm.kl.coef > 0 and cfg.inference.config.engine_kwargs["quantization"] == "fp8"
    int4 = plan(arch, dev, Workload(prompt_len=512, response_len=1024, prompts=8, samples=4, precision="int4"), 8,
                search_min=False)
    with pytest.raises(RecipeError, match="int4 checkpoint"):
        recipe_dict(int4, "Qwen/Qwen3-8B")


def test_hsdp_past_one_node(tmp_path):
    p = plan(resolve_arch("Qwen/Qwen3-8B"), device("H100"), Workload(prompt_len=512, response_len=2048, prompts=32,
             samples=8), 32)
    assert p.fits and p.trainer.engine == "fsdp" and p.trainer.replicate == 4 and p.trainer.shard == 8
    one_node = plan(resolve_arch("Qwen/Qwen3-8B"), device("H100"), Workload(prompt_len=512, response_len=2048,
                    prompts=32, samples=8), 8)
    assert one_node.trainer.replicate == 1
    assert p.trainer_items["optimizer"] == pytest.approx(one_node.trainer_items["optimizer"])  # sharded over 8
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(p, "Qwen/Qwen3-8B")))
    cfg = load_config(RunConfig, path)
    assert cfg.trainer.config.parallel.replicate == 4 and cfg.ray.trainer_ranks == 32
    cpu = plan(resolve_arch("tiny-qwen3"), device("cpu", 23.0), Workload(prompt_len=128, response_len=16, prompts=2,
               samples=4), 2, search_min=False)
    assert cpu.trainer.replicate == 1 and cpu.trainer.shard == 2  # processes on one machine: plain FSDP


def test_cli_json_keys_and_errors(capsys):
    from tandem.cli import main

    assert main(["plan", "Qwen/Qwen3-8B", "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("fits", "reason", "trainer", "inference", "placement", "train_gpus", "rollout_gpus",
                "memory_gib_per_gpu", "step_time_s"):
        assert key in out
    assert set(out["trainer"]) >= {"engine", "tp", "pp", "cp", "ep", "dp", "offload", "activation_checkpointing"}
    assert set(out["inference"]) >= {"engine", "tp", "ep", "replicas", "gpus"}
    assert set(out["memory_gib_per_gpu"]) >= {"trainer", "inference"}
    assert set(out["step_time_s"]) >= {"rollout", "train", "sync"}
    assert main(["plan", "Qwen/Qwen3-8B", "--gpu-type", "V100"]) == 2
    assert "unknown GPU type 'V100'" in capsys.readouterr().err
    assert main(["plan", "Qwen/Qwen3-8B", "--response-len", "90000"]) == 2


def test_cli_check_refuses_and_writes_nothing(tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "r.yaml"
    rc = main(["plan", "Qwen/Qwen3-32B", "--gpus", "8", "--check", "--trainer", "fsdp", "--inference-tp", "1",
               "--gpu-type", "A100-40GB", "--write", str(out)])
    assert rc == 1 and not out.exists()
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_cli_check_reads_a_recipe(capsys):
    from pathlib import Path

    from tandem.cli import main

    recipe = Path(__file__).parents[2] / "recipes" / "smollm2-135m" / "addition-grpo.yaml"
    assert main(["plan", "--check", "--recipe", str(recipe), "--gpu-type", "cpu", "--gpu-memory-gib", "23"]) == 0
    assert "FITS" in capsys.readouterr().out


@pytest.mark.parametrize("setting", ["recompute_pointwise", "packing"])
def test_cli_check_reads_the_trainer_path_that_keeps_more(tmp_path, capsys, setting):
    """A recipe that turns off the recomputation of saved outputs (or packing: the HF model) is planned with the
    conservative activation width."""
    from pathlib import Path

    from tandem.cli import main

    recipe = Path(__file__).parents[2] / "recipes" / "smollm2-135m" / "addition-grpo.yaml"
    changed = yaml.safe_load(recipe.read_text())
    changed["trainer"]["fsdp"][setting] = False
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(changed))
    acts = []
    for path in (recipe, tmp_path / "r.yaml"):
        assert main(["plan", "--check", "--recipe", str(path), "--json"]) == 0
        acts.append(json.loads(capsys.readouterr().out)["memory_gib_per_gpu"]["trainer_items"]["activations"])
    arch = resolve_arch("smollm2-135m-instruct")
    assert acts[1] / acts[0] == pytest.approx(arch.activation_width() / arch.native_activation_width(), rel=0.01)


def test_cli_check_plans_a_cpu_recipe_for_the_cpu(capsys):
    """Without ``--gpu-type``, a recipe whose run uses no GPU (the embedded engine on the CPU, the trainer
    following the machine) is judged on the CPU, a vLLM recipe on the default GPU, and a flag still wins."""
    from pathlib import Path

    from tandem.cli import main

    recipes = Path(__file__).parents[2] / "recipes"
    for recipe, hardware in (("smollm2-135m/addition-grpo.yaml", "1 x cpu"), ("tiny/grpo-sync.yaml", "1 x cpu"),
                             ("qwen3/qwen3-8b-grpo.yaml", "x H100"),
                             ("smollm2-135m/addition-grpo.yaml --gpu-type A100", "1 x A100")):
        name, *flags = recipe.split()
        main(["plan", "--check", "--recipe", str(recipes / name), *flags])
        line = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith("hardware"))
        assert hardware in line, (recipe, line)


def test_offload_pays_host_copies_per_micro_batch_and_a_host_optimizer_step():
    from dataclasses import replace

    from tandem.plan.timing import offload_time, train_time

    arch, dev = resolve_arch("meta-llama/Llama-3.1-70B-Instruct"), device("H200")
    wl = Workload(prompt_len=512, response_len=1024, prompts=4, samples=4, lora_rank=16)
    lay = TrainerLayout(gpus=1, offload=True, activation_checkpointing=True, micro_batch_tokens=16384)
    copies, host_step = offload_time(arch, dev, wl, lay)
    base = arch.total_params() * 2  # the frozen bf16 base: up for the old-log-prob forward, forward and backward
    # of each of the 2 micro-batches (16 sequences x 1536 tokens in micro-batches of 16384)
    assert copies == pytest.approx(2 * 3 * base / (dev.host_link_gbps * 1e9 * 0.8), rel=0.01)
    assert 0 < host_step < 1  # AdamW over the adapters only
    assert offload_time(arch, dev, wl, replace(lay, offload=False)) == (0.0, 0.0)
    small = replace(lay, micro_batch_tokens=1536)  # 16 micro-batches: 8 times the copies
    assert offload_time(arch, dev, wl, small)[0] == pytest.approx(8 * copies)
    assert train_time(arch, dev, wl, small, 1) > train_time(arch, dev, wl, replace(small, offload=False), 1)
    # the planner takes the fastest offloaded layout that fits, not the first: ckpt with one large micro-batch
    p = plan(arch, replace(dev, host_memory_gib=1800.0), replace(wl, precision="fp8"), 1)
    assert p.fits and p.trainer.offload and p.trainer.micro_batch_tokens == 16384, p.trainer
    full = Workload(prompt_len=512, response_len=1024, prompts=4, samples=4)
    assert offload_time(arch, dev, full, lay)[1] == pytest.approx(arch.total_params() * 28 / 20e9, rel=0.01)


def test_activation_width_follows_the_trainer_path():
    """FSDP on the native model with the saved outputs recomputed keeps the lean width; Megatron, an MoE, a model
    without a native implementation and a recipe that turns the recomputation (or packing) off keep the
    conservative one."""
    from tandem.plan.memory import activation_width

    dense, moe = resolve_arch("Qwen/Qwen3-8B"), resolve_arch("qwen3-30b-a3b")
    lean, full = dense.native_activation_width(), dense.activation_width()
    assert lean < 0.6 * full
    assert activation_width(dense, TrainerLayout()) == lean
    assert activation_width(dense, TrainerLayout(recompute_pointwise=False)) == full
    assert activation_width(dense, TrainerLayout(engine="megatron")) == full
    assert activation_width(moe, TrainerLayout()) == moe.activation_width()
    foreign = [a for a in ARCHS.values() if not a.native and not a.moe and not a.mla][0]
    assert activation_width(foreign, TrainerLayout()) == foreign.activation_width()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_width_bounds_what_the_native_model_keeps(family, dtype):
    """What a forward of Tandem's native model keeps for backward (recomputation on), per token and layer, is at
    most the planner's native width and within 15% of it (tiny models; the vocabulary chunk and final norm counted
    too)."""
    import torch

    from tandem.models.tiny import tiny_config
    from tandem.models.transformer import CausalLM, TransformerArgs
    from tandem.plan.archs import Arch
    from tests.models.test_recompute import LENGTHS, _kept_bytes

    args = TransformerArgs.from_hf_config(tiny_config(family, 256))
    torch.manual_seed(0)
    model = CausalLM(args).to(getattr(torch, dtype))
    n = sum(LENGTHS)
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(k) for k in LENGTHS])
    kept = _kept_bytes(model, ids, positions, True) / model.lm_head.weight.element_size() / n / args.num_layers
    arch = Arch(name="tiny", family=family, layers=args.num_layers, hidden=args.hidden_size, heads=args.num_heads,
                kv_heads=args.num_kv_heads, head_dim=args.head_dim, intermediate=args.intermediate_size, vocab=256,
                native=True)
    assert 0.85 * arch.native_activation_width() <= kept <= arch.native_activation_width(), kept


def test_building_the_model_counts_what_each_rank_loads_before_sharding():
    """The host memory a node's ranks take while they build the model (`load_host_bytes`): the native model's
    shards alone (fsdp/deferred.py reads a rank's rows), the same for the HF families whose checkpoints the load
    reads by rows (DeepSeek-V3's layout, withdrawn on 2026-12-07 when they loaded whole, starts again), and the
    whole model per rank for the other HF models (gpt-oss: its experts are stored quantized)."""
    from dataclasses import replace

    from tandem.plan.hardware import GIB
    from tandem.plan.memory import HF_ROWS_READ, InferenceLayout, load_host_bytes
    from tandem.plan.planner import check

    llama, h100 = resolve_arch("meta-llama/Llama-3.1-70B-Instruct"), device("H100")
    wl = Workload(prompt_len=1024, response_len=1024, prompts=8, samples=8)
    p = llama.total_params()
    dp8 = load_host_bytes(llama, h100, wl, TrainerLayout(gpus=8))
    assert dp8 == 4 * p / 8  # its rows of every matrix, nothing whole
    assert load_host_bytes(llama, h100, wl, TrainerLayout(gpus=1)) == 4 * p  # one process: loaded whole
    assert load_host_bytes(llama, device("cpu"), wl, TrainerLayout(gpus=8)) == 0  # a CPU's budget counts it
    dsv3 = resolve_arch("deepseek-ai/DeepSeek-V3")
    assert not dsv3.native and dsv3.family in HF_ROWS_READ
    assert load_host_bytes(dsv3, h100, wl, TrainerLayout(gpus=128)) == 4 * dsv3.total_params() / 128
    layout = TrainerLayout(gpus=128, offload=True, activation_checkpointing=True, micro_batch_tokens=9216)
    got = check(dsv3, device("H200"), replace(wl, response_len=8192, prompts=32), 128, layout,
                InferenceLayout(engine="vllm", tp=16, ep=16, replicas=8), "colocated")
    assert got.fits, got.reason
    oss = resolve_arch("openai/gpt-oss-120b")
    assert oss.family not in HF_ROWS_READ
    assert load_host_bytes(oss, h100, wl, TrainerLayout(gpus=8)) == 4 * oss.total_params()
    got = check(oss, h100, wl, 8, TrainerLayout(gpus=8, offload=True, activation_checkpointing=True),
                InferenceLayout(engine="vllm", tp=8, replicas=1), "colocated")
    assert not got.fits and "building the model needs" in got.reason
    assert "each of its 8 ranks loads the whole HF model in fp32 first" in got.reason
    assert 8 * 4 * oss.total_params() / GIB > h100.host_memory_gib
