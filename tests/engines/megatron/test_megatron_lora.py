"""LoRA on the Megatron engine (megatron/lora.py) against the FSDP engine's LoRA (peft's layout) on the tiny
models, fp32, one process: the same adapters give the same log-probs, gradients step them alike, and the
exports (adapter-only under peft's names, and merged) are the same tensors. The TP 2 / PP 2 layouts against
one process run in test_megatron_dist.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'tandem-rl[megatron]')"
)

from tandem.config import ConfigError, from_dict  # noqa: E402
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine  # noqa: E402
from tandem.engines.training.megatron import (  # noqa: E402
    LoRAConfig,
    MegatronConfig,
    MegatronEngine,
    MegatronRefConfig,
    OptimizerConfig,
)
from tandem.engines.training.megatron.lora import load_adapters  # noqa: E402
from tandem.kernels import QuantConfig  # noqa: E402
from tandem.models import ModelConfig, resolve_model  # noqa: E402

from ..training.helpers import make_batch, max_abs_diff, sync_weights, token_mean_pg  # noqa: E402

OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)  # eps: see test_fsdp_engine
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _megatron(model: str, lora: LoRAConfig, **kw) -> MegatronEngine:
    return MegatronEngine(MegatronConfig(model=ModelConfig(name=model), optimizer=OPT, micro_batch_tokens=20,
                                         vocab_divisible_by=96, lora=lora, **kw))


def _adapters(engine) -> dict[str, torch.Tensor]:
    return {n: t for n, t in sync_weights(engine).items() if ".lora_" in n}


@pytest.mark.parametrize("model,targets", [("tiny-llama", ALL), ("tiny-qwen2", ALL),
                                           ("tiny-qwen3", ("k_proj", "o_proj", "up_proj"))])
def test_same_adapters_give_fsdp_lora_logprobs_steps_and_exports(model, targets):
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=targets, sync="adapter")
    fsdp = FSDPEngine(FSDPConfig(model=ModelConfig(name=model), optimizer=OPT, micro_batch_tokens=20, lora=lora))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B is zero at the start: give both matrices values, or the forward tests nothing
        for name, p in fsdp.policy.module.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    start = _adapters(fsdp)
    assert len(start) == 2 * len(targets) * 2  # tiny models: 2 layers
    engine = _megatron(model, lora)
    try:
        assert set(_adapters(engine)) == set(start)  # peft's names, every one
        assert load_adapters(engine.policy, start, tp_rank=0, tp_size=1) == len(start)
        assert max_abs_diff(_adapters(engine), start) == 0.0

        batch = make_batch(seed=0)
        want, got = fsdp.forward_logprobs(batch).log_probs, engine.forward_logprobs(batch).log_probs
        # log-probs down to ~-12 under adapters of scale 0.2; the adapters' products rounded in another order
        assert (got - want).abs().max() < 1e-6 * want.abs().max()
        for seed in (0, 1):
            step = make_batch(seed=seed)
            m_fsdp, m_meg = fsdp.train_step(step, token_mean_pg), engine.train_step(step, token_mean_pg)
            for key in ("train/loss", "train/grad_norm"):
                assert abs(m_meg[key] - m_fsdp[key]) < 1e-5 * max(1.0, abs(m_fsdp[key])), (key, m_meg, m_fsdp)
        assert max_abs_diff(_adapters(engine), _adapters(fsdp)) < 1e-5
        assert max_abs_diff(_adapters(engine), start) > 1e-4  # the steps moved them

        fsdp.config.lora.sync = engine.config.lora.sync = "merged"  # HF weights with the adapters merged
        merged_fsdp, merged_meg = sync_weights(fsdp), sync_weights(engine)
        assert not any(".lora_" in n for n in merged_meg)
        assert max_abs_diff(merged_meg, merged_fsdp) < 1e-5
    finally:
        engine.close()
        fsdp.close()


def _planner_counts_this_state(model: str, engine, rank: int) -> None:
    """`tandem plan`'s Megatron LoRA items on a CPU (fp32) hold what this engine holds after its steps: gradients and
    AdamW moments for the adapters alone, no reference model (the base with its adapters off)."""
    from tandem.plan.archs import resolve_arch
    from tandem.plan.hardware import device
    from tandem.plan.memory import TrainerLayout, Workload, trainer_memory

    items = trainer_memory(resolve_arch(model), device("cpu"), Workload(prompt_len=8, response_len=8, prompts=1,
                                                                        samples=1, lora_rank=rank, ref=True),
                           TrainerLayout(engine="megatron", gpus=1))
    trainable = [p for _, _, p in engine.params if p.requires_grad]
    assert items["gradients"] == sum(p.numel() * p.element_size() for p in trainable) > 0  # fp32 adapters
    moments = sum(v.numel() * v.element_size() for inner in engine.optim._inner for s in inner.state.values()
                  for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    assert items["optimizer"] == moments
    assert "reference" not in items


def test_only_adapters_train_reference_is_the_base_and_checkpoint_holds_adapters(tmp_path):
    model = "tiny-qwen3"
    plain = MegatronEngine(MegatronConfig(model=ModelConfig(name=model), micro_batch_tokens=20, vocab_divisible_by=96))
    batch = make_batch(seed=0)
    base_logp, base_weights = plain.forward_logprobs(batch).log_probs, sync_weights(plain)
    plain.close()

    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=ALL, sync="adapter")
    engine = _megatron(model, lora, ref=MegatronRefConfig())
    try:
        assert engine.info.lora_adapters
        assert torch.equal(engine.forward_logprobs(batch).log_probs, base_logp)  # B = 0: the base, bit for bit
        trainable = [n for n, _, p in engine.params if p.requires_grad]
        assert trainable and all(".lora." in n for n in trainable)
        for seed in (0, 1):
            engine.train_step(make_batch(seed=seed), token_mean_pg)
        assert not torch.equal(engine.forward_logprobs(batch).log_probs, base_logp)
        assert torch.equal(engine.forward_logprobs(batch, model="ref").log_probs, base_logp)  # adapters off
        engine.config.lora.sync = "merged"
        merged = sync_weights(engine)
        engine.config.lora.sync = "adapter"
        assert set(merged) == set(base_weights)
        frozen = [n for n in merged if "proj" not in n]  # norms and embeddings: untouched
        assert all(torch.equal(merged[n], base_weights[n]) for n in frozen)

        _planner_counts_this_state(model, engine, lora.rank)
        engine.save(str(tmp_path / "ckpt"))
        saved = _adapters(engine)
        after = engine.train_step(make_batch(seed=2), token_mean_pg)
    finally:
        engine.close()
    resumed = _megatron(model, lora, ref=MegatronRefConfig())
    try:
        resumed.load(str(tmp_path / "ckpt"))
        assert max_abs_diff(_adapters(resumed), saved) == 0.0
        again = resumed.train_step(make_batch(seed=2), token_mean_pg)
        assert again["train/loss"] == after["train/loss"]
    finally:
        resumed.close()
    import torch.distributed.checkpoint as dcp

    saved_keys = [k for k in dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
                  if k.startswith("model/")]
    assert saved_keys and all(".lora." in k for k in saved_keys)  # the adapters alone, not the frozen base


def test_recipe_mapping_loads_and_what_it_cannot_do_is_refused():
    cfg = from_dict(MegatronConfig, {"model": {"name": "tiny-qwen3"},
                                     "lora": {"rank": 8, "target_modules": ["q_proj", "down_proj"], "sync": "adapter"}})
    assert cfg.lora == LoRAConfig(rank=8, target_modules=("q_proj", "down_proj"), sync="adapter")
    with pytest.raises(ConfigError, match="rank=0 must be >= 1"):
        from_dict(MegatronConfig, {"model": {"name": "tiny-qwen3"}, "lora": {"rank": 0}})
    cases = {
        "tiny-qwen3-moe": (LoRAConfig(rank=2), "a MoE model"),
        "tiny-qwen3": (LoRAConfig(rank=2, quantize_base=QuantConfig()), r"quantized base.*trainer.engine: fsdp"),
    }
    for model, (lora, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            _megatron(model, lora)
    with pytest.raises(ValueError, match=r"dropout"):
        _megatron("tiny-qwen3", LoRAConfig(rank=2, dropout=0.1))
    with pytest.raises(ValueError, match=r"\['qkv'\] do not exist on the Megatron engine; it adapts q_proj"):
        _megatron("tiny-qwen3", LoRAConfig(rank=2, target_modules=("qkv",)))


def test_tandem_export_of_a_megatron_lora_checkpoint_loads_in_peft(tmp_path):
    """`tandem export` reads a Megatron checkpoint: the peft adapter folder holds the engine's adapters, the
    merged folder its merged weights (bit for bit), and peft on the HF model gives the engine's log-probs."""
    from safetensors.torch import load_file

    from tandem.cli import main as cli_main

    from ..training.helpers import hf_response_logprobs

    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=ALL, sync="adapter")
    engine = MegatronEngine(MegatronConfig(model=ModelConfig(name="tiny-llama"), micro_batch_tokens=20,
                                           vocab_divisible_by=96, lora=lora, optimizer=OptimizerConfig(lr=5e-2)))
    try:
        for seed in (0, 1):
            engine.train_step(make_batch(seed=seed), token_mean_pg)
        engine.save(str(tmp_path / "ckpt"))
        adapters = _adapters(engine)
        engine.config.lora.sync = "merged"
        merged = sync_weights(engine)
        batch = make_batch(seed=3)
        want = engine.forward_logprobs(batch).log_probs
    finally:
        engine.close()
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "ad"), "--adapter-only"]) == 0
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert max_abs_diff(load_file(str(tmp_path / "ad" / "adapter_model.safetensors")), adapters) == 0.0
    assert max_abs_diff(load_file(str(tmp_path / "hf" / "model.safetensors")), merged) == 0.0
    assert (tmp_path / "hf" / "config.json").is_file()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    assert (hf_response_logprobs(hf.eval(), batch) - want).abs().max() < 1e-4  # the merged folder
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny-llama")), torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ad")).eval()
    with torch.no_grad():
        got = hf_response_logprobs(peft_model, batch)
    assert (got - want).abs().max() < 1e-4
