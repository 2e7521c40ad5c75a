"""FSDPEngine features in one process: LoRA, critic, MoE routing replay, checkpoints and export."""

from __future__ import annotations

import pytest
import torch

from tandem.cli import main as cli_main
from tandem.engines.training.fsdp import (
    CriticConfig,
    FSDPConfig,
    FSDPEngine,
    LoRAConfig,
    OptimizerConfig,
    RefConfig,
)
from tandem.engines.training.fsdp import checkpoint as ckpt
from tandem.engines.training.fsdp.lora import hf_tensors
from tandem.models import ModelConfig, load_model, resolve_model
from tandem.models.attention import MoERouting, VarlenAttention
from tandem.models.transformer import CausalLM

from .helpers import (
    TINY,
    hf_response_logprobs,
    make_batch,
    max_abs_diff,
    sync_weights,
    token_mean_pg,
    value_mse,
)

OPT = OptimizerConfig(lr=1e-2, grad_clip=1.0)
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _engine(name: str = TINY, **kw) -> FSDPEngine:
    kw.setdefault("optimizer", OPT)
    kw.setdefault("micro_batch_tokens", 32)
    return FSDPEngine(FSDPConfig(model=ModelConfig(name=name), **kw))


# -- LoRA -------------------------------------------------------------------------------------------


def test_lora_trains_only_adapters_and_merges_like_peft():
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    batch = make_batch()
    engine = _engine(lora=LORA, ref=RefConfig())
    initial = {n: p.detach().clone() for n, p in engine.policy.module.named_parameters()}
    for _ in range(2):
        assert engine.train_step(batch, token_mean_pg)["train/skipped_step"] == 0.0
    changed = {n for n, p in engine.policy.module.named_parameters() if not torch.equal(p, initial[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert any(".lora_B." in n for n in changed)  # B starts at zero: the adapters now do something

    merged = sync_weights(engine)
    base = load_model(TINY)
    assert set(merged) == set(base.state_dict()) - {"lm_head.weight"}  # HF names, tied head left out
    adapter = dict(hf_tensors(engine.policy.module.lm, gather=lambda t: t.detach(), adapter_only=True))
    peft_model = get_peft_model(
        base, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules))
    )
    result = set_peft_model_state_dict(peft_model, adapter)
    assert not result.unexpected_keys
    reference = peft_model.merge_and_unload().state_dict()
    assert max_abs_diff(merged, {k: reference[k] for k in merged}) == 0.0

    # the reference model is the base (adapters off), the policy has moved away from it
    with torch.no_grad():
        base_lp = hf_response_logprobs(load_model(TINY), batch)
    assert (engine.forward_logprobs(batch, model="ref").log_probs - base_lp).abs().max() < 1e-5
    assert (engine.forward_logprobs(batch).log_probs - base_lp).abs().max() > 1e-3
    assert engine.train_step(batch, token_mean_pg)["train/skipped_step"] == 0.0  # still trainable


def test_lora_adapter_sync_and_unknown_target():
    engine = _engine(lora=LoRAConfig(rank=2, target_modules=("q_proj",), sync="adapter"))
    names = [n for bucket in engine.named_parameters_for_sync(1 << 20) for n, _ in bucket]
    assert names and all(n.startswith("base_model.model.model.layers.") for n in names)
    assert {n.rsplit(".", 2)[-2] for n in names} == {"lora_A", "lora_B"}
    with pytest.raises(ValueError, match=r"LoRA target module 'qproj' does not exist.*q_proj"):
        _engine(lora=LoRAConfig(target_modules=("qproj",)))


# -- critic -----------------------------------------------------------------------------------------


def test_critic_values_train_towards_returns_without_touching_the_policy():
    batch = make_batch()
    batch.returns = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(5)) * batch.loss_mask
    engine = _engine(critic=CriticConfig(optimizer=OptimizerConfig(lr=1e-2)))
    policy_before = sync_weights(engine)
    values = engine.forward_logprobs(batch, model="critic").values
    assert values.shape == batch.loss_mask.shape and torch.equal(values, torch.zeros_like(values))
    losses = [engine.train_step(batch, value_mse, model="critic")["critic/loss"] for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0]
    values = engine.forward_logprobs(batch, model="critic").values
    valid = torch.arange(values.shape[1])[None, :] < batch.response_lengths[:, None]
    assert (values[~valid] == 0).all() and (values[valid] != 0).all()
    assert max_abs_diff(sync_weights(engine), policy_before) == 0.0
    assert engine.step == 0


# -- MoE routing replay (R3) ------------------------------------------------------------------------


def _own_routing(name: str, batch) -> torch.Tensor:
    """``[B, L-1, layers, topk]``: the routing the model itself chooses for every fed token."""
    lm = CausalLM.from_pretrained(resolve_model(name))
    moe = lm.args.moe_layers
    out = torch.zeros(batch.batch_size, batch.input_ids.shape[1] - 1, len(moe), lm.args.num_experts_per_tok, dtype=torch.int32)
    for i in range(batch.batch_size):
        n = int(batch.seq_lengths[i]) - 1
        routing = MoERouting(moe)
        with torch.no_grad():
            lm(batch.input_ids[i, :n], torch.arange(n), VarlenAttention.from_lengths([n]), routing)
        out[i, :n] = routing.recorded()
    return out


def test_routing_replay_of_own_routing_changes_nothing_and_foreign_routing_is_measured():
    name = "tiny-qwen3-moe"
    batch = make_batch()
    plain = _engine(name).forward_logprobs(batch).log_probs
    batch.routed_experts = _own_routing(name, batch)
    engine = _engine(name, routing_replay=True)
    assert (engine.forward_logprobs(batch).log_probs - plain).abs().max() < 1e-6
    assert engine.train_step(batch, token_mean_pg)["moe/route_mismatch_frac"] == 0.0
    foreign = batch.replace(routed_experts=(batch.routed_experts + 3) % 8)
    other = _engine(name, routing_replay=True)
    assert (other.forward_logprobs(foreign).log_probs - plain).abs().max() > 1e-3
    assert other.train_step(foreign, token_mean_pg)["moe/route_mismatch_frac"] > 0.5
    with pytest.raises(ValueError, match="has no routed_experts"):
        other.forward_logprobs(make_batch())


# -- checkpoints and export -------------------------------------------------------------------------


def test_checkpoint_resume_is_bit_exact(tmp_path):
    batches = [make_batch(seed=s) for s in range(4)]
    lr_lambda = lambda step: 1.0 / (1 + step)  # noqa: E731
    straight = FSDPEngine(FSDPConfig(model=ModelConfig(name=TINY), optimizer=OPT), lr_lambda=lr_lambda)
    for b in batches[:2]:
        straight.train_step(b, token_mean_pg)
    straight.save(str(tmp_path / "ckpt"))
    saved = sync_weights(straight)
    tail = [straight.train_step(b, token_mean_pg) for b in batches[2:]]

    resumed = FSDPEngine(FSDPConfig(model=ModelConfig(name=TINY), optimizer=OPT), lr_lambda=lr_lambda)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 2 and max_abs_diff(sync_weights(resumed), saved) == 0.0
    again = [resumed.train_step(b, token_mean_pg) for b in batches[2:]]
    assert [m["train/lr"] for m in again] == [m["train/lr"] for m in tail]
    assert [m["train/loss"] for m in again] == [m["train/loss"] for m in tail]
    assert max_abs_diff(sync_weights(resumed), sync_weights(straight)) == 0.0


def test_interrupted_save_never_looks_complete(tmp_path, monkeypatch):
    engine = _engine()
    target = tmp_path / "ckpt"
    engine.save(str(target))  # an older, complete checkpoint
    engine.train_step(make_batch(), token_mean_pg)

    def crash():
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_rng_state", crash)  # fails after the DCP shards are written
    with pytest.raises(OSError, match="disk full"):
        engine.save(str(target))
    assert (tmp_path / ".ckpt.partial").is_dir()  # what the crash left behind
    with pytest.raises(FileNotFoundError, match="not a complete Tandem checkpoint"):
        engine.load(str(tmp_path / ".ckpt.partial"))
    fresh = _engine()
    fresh.load(str(target))  # the older checkpoint is intact
    assert fresh.step == 0


def test_export_cli_writes_an_hf_folder(tmp_path, capsys):
    batch = make_batch()
    engine = _engine(packing=False)  # the HF-model path checkpoints under the same names
    engine.train_step(batch, token_mean_pg)
    engine.save(str(tmp_path / "ckpt"))
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    hf = load_model(str(tmp_path / "hf"))
    assert max_abs_diff({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}, sync_weights(engine)) == 0.0
    with torch.no_grad():
        assert (hf_response_logprobs(hf, batch) - engine.forward_logprobs(batch).log_probs).abs().max() < 1e-5
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert cli_main(["export", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert "nope does not exist" in capsys.readouterr().err
    (tmp_path / "partial").mkdir()  # a folder that is no checkpoint: what each target kind needs
    assert cli_main(["export", str(tmp_path / "partial"), str(tmp_path / "y")]) == 2
    assert "is neither a run directory" in capsys.readouterr().err


def test_lora_checkpoint_saves_adapters_and_exports_merged(tmp_path):
    batch = make_batch()
    engine = _engine(lora=LORA)
    engine.train_step(batch, token_mean_pg)
    engine.save(str(tmp_path / "ckpt"))
    assert sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.distcp")) < 200_000  # adapters only
    fresh = _engine(lora=LORA)
    fresh.load(str(tmp_path / "ckpt"))
    merged = sync_weights(engine)
    assert max_abs_diff(sync_weights(fresh), merged) == 0.0
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    exported = load_model(str(tmp_path / "hf")).state_dict()
    assert max_abs_diff({k: exported[k] for k in merged}, merged) == 0.0
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "ad"), "--adapter-only"]) == 0
    assert (tmp_path / "ad" / "adapter_config.json").is_file()
