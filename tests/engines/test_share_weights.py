"""A colocated LoRA run keeps one copy of the frozen base (issue 20): the embedded engine holds the trainer's
frozen tensors as its weights (`TorchEngine.share_weights`, the trainer's ``frozen_weights``) and a QLoRA
base's quantized tensors for its sleep, serves exactly what an engine with its own copy serves, and never
writes the trainer's memory (copy-on-write)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.config import load_config
from tandem.core.protocols import FrozenWeights, SharesWeights
from tandem.engines.inference.torch.config import TorchEngineConfig
from tandem.engines.inference.torch.engine import TorchEngine
from tandem.engines.inference.torch.weights import AsleepQuantizedWeight
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig
from tandem.engines.training.fsdp.lora import hf_tensors
from tandem.kernels import QuantConfig
from tandem.models import ModelConfig
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics
from tandem.sync.inprocess import share_frozen_base

from .test_torch_engine_lora import LORA, RECIPE, _out, _req
from .torch_helpers import make_engine, prompts
from .training.helpers import make_batch, token_mean_pg

FP8 = QuantConfig(format="fp8_block", block_size=(32, 32))


def _trainer(quantize_base: QuantConfig | None = None) -> FSDPEngine:
    torch.manual_seed(0)
    lora = dataclasses.replace(LORA, quantize_base=quantize_base)
    return FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), lora=lora, micro_batch_tokens=64,
                                 optimizer=OptimizerConfig(lr=5e-2), deterministic=True))


def _adapters(trainer: FSDPEngine) -> list[tuple[str, torch.Tensor]]:
    return list(hf_tensors(trainer.policy.module.lm, gather=lambda t: t.detach().clone(), adapter_only=True))


def _outputs(engine, ps) -> list:
    return [_out(r) for r in engine.generate([_req(p, seed=i) for i, p in enumerate(ps)])]


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_engine_sharing_the_trainers_frozen_base_serves_exactly_what_its_own_copy_serves(deterministic):
    trainer = _trainer()
    plain, quantized = trainer.frozen_weights()
    assert plain and not quantized and not any(".lora_" in n or "base_layer" in n for n, _ in plain)
    own, shared = (make_engine(lora_alpha=8.0, deterministic=deterministic) for _ in range(2))
    assert isinstance(trainer, FrozenWeights) and isinstance(shared, SharesWeights)
    assert share_frozen_base(object(), shared) == {} and share_frozen_base(trainer, object()) == {}
    held = own.health()["plain_weight_bytes"] + own.health()["packed_weight_bytes"]
    out = shared.share_weights(plain)
    assert out["shared_tensors"] == len(plain) and out["skipped"] == 0
    params = dict(shared.model.named_parameters(remove_duplicate=False))
    for name, t in plain:  # the engine's weight is the trainer's memory, not a copy
        assert params[name].data_ptr() == t.data_ptr(), name
    nbytes = sum(t.numel() * t.element_size() for _, t in plain)
    health = shared.health()
    assert health["shared_weight_bytes"] == nbytes
    assert health["plain_weight_bytes"] + health["packed_weight_bytes"] < held

    ps = prompts([5, 9, 14])
    for engine in (own, shared):
        engine.load_lora_adapter(_adapters(trainer), version=1)
    assert _outputs(shared, ps) == _outputs(own, ps)
    frozen_before = {n: t.clone() for n, t in plain}
    for step in (2, 3):  # a colocated run: sleep, the trainer steps, adapter-only sync, wake
        for engine in (own, shared):
            engine.sleep()
        if not deterministic:  # asleep, the packed copies of shared weights are freed: the trainer holds the values
            assert shared.health()["packed_weight_bytes"] < own.health()["packed_weight_bytes"]
        trainer.train_step(make_batch(), token_mean_pg)
        for engine in (own, shared):
            engine.load_lora_adapter(_adapters(trainer), version=step)
            engine.wake_up()
        assert _outputs(shared, ps) == _outputs(own, ps)
    assert all(torch.equal(t, frozen_before[n]) for n, t in plain)  # nothing wrote the base
    trainer.close()


def test_a_full_update_gives_a_shared_weight_its_own_memory_and_leaves_the_trainers_untouched():
    trainer = _trainer()
    plain, _ = trainer.frozen_weights()
    engine = make_engine(lora_alpha=8.0)
    engine.share_weights(plain)
    frozen = dict(plain)
    before = {n: t.clone() for n, t in plain}
    name = "model.layers.0.mlp.down_proj.weight"
    g = torch.Generator().manual_seed(1)
    new = before[name] + 0.1 * torch.randn(before[name].shape, generator=g)
    engine.update_weights([(name, new), ("model.norm.weight", before["model.norm.weight"] * 2)], version=1)
    assert all(torch.equal(t, before[n]) for n, t in frozen.items())  # copy-on-write: the trainer's are untouched
    weights = engine.named_weights()
    assert torch.equal(weights[name], new) and torch.equal(weights["model.norm.weight"], before["model.norm.weight"] * 2)
    params = dict(engine.model.named_parameters())
    assert params[name].data_ptr() != frozen[name].data_ptr()
    assert params["model.layers.1.mlp.down_proj.weight"].data_ptr() == frozen["model.layers.1.mlp.down_proj.weight"].data_ptr()
    assert engine.health()["shared_weight_bytes"] == sum(
        t.numel() * 4 for n, t in plain if n not in (name, "model.norm.weight"))
    trainer.close()


def test_tensors_that_differ_from_the_engines_weights_are_not_shared():
    engine = make_engine()
    weights = {n: t.clone() for n, t in engine.named_weights().items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = [
        (name, weights[name] + 1e-3),  # other values
        ("model.layers.0.mlp.up_proj.weight", weights["model.layers.0.mlp.up_proj.weight"].double()),  # dtype
        ("model.layers.0.mlp.gate_proj.weight", weights["model.layers.0.mlp.gate_proj.weight"].t().contiguous()),
        ("model.layers.0.mlp.down_proj.weight", weights["model.layers.0.mlp.down_proj.weight"].t()),  # layout
        ("model.not_a_weight", torch.zeros(3)),
    ]
    out = engine.share_weights(bad)
    assert out["shared_tensors"] == 0 and out["skipped"] == len(bad)
    assert engine.health()["shared_weight_bytes"] == 0
    after = engine.named_weights()
    assert all(torch.equal(after[n], t) for n, t in weights.items())
    quantized_out = engine.share_weights([], [(name, {name: torch.zeros(2)})])  # an engine without quantization
    assert quantized_out["quantized_tensors"] == 0 and quantized_out["skipped"] == 1


def test_a_quantized_engine_sleeps_on_the_qlora_trainers_quantized_base():
    trainer = _trainer(quantize_base=FP8)
    plain, quantized = trainer.frozen_weights()
    assert quantized and all(n.endswith(".weight") and n in t for n, t in quantized)
    own, shared = (make_engine(lora_alpha=8.0, quantization=FP8) for _ in range(2))
    out = shared.share_weights(plain, quantized)
    assert out["quantized_tensors"] == len(quantized) and out["skipped"] == 0
    ps = prompts([5, 9, 14])
    for engine in (own, shared):
        engine.load_lora_adapter(_adapters(trainer), version=1)
    want = _outputs(own, ps)
    assert _outputs(shared, ps) == want
    for engine in (own, shared):
        engine.sleep()
    params = dict(shared.model.named_parameters(remove_duplicate=False))
    targets = {n for n, _ in quantized}
    assert all(type(params[n]) is AsleepQuantizedWeight for n in targets)  # packed-only ones too
    for name, tensors in quantized:  # it holds the trainer's tensors, not a quantized copy of its own
        held = shared._asleep[id(params[name])][2]
        assert all(held[k].data_ptr() == t.data_ptr() for k, t in tensors.items()), name
    assert shared.health()["packed_weight_bytes"] < own.health()["packed_weight_bytes"]
    for engine in (own, shared):
        engine.wake_up()
    assert _outputs(shared, ps) == want
    other = QuantConfig(format="fp8_block", block_size=(16, 16))  # another grid's tensors do not give its values
    engine = make_engine(lora_alpha=8.0, quantization=other)
    assert engine.share_weights([], quantized)["skipped"] == len(quantized)
    trainer.close()


def _run(tmp_path, *extra: str):
    cfg = load_config(RunConfig, RECIPE, [
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", "sync.lora_mode=adapter",
        "trainer.fsdp.optimizer.lr=0.01", "trainer.fsdp.lora={rank: 8, alpha: 16, target_modules: [q_proj, v_proj]}",
        *extra])
    run = Run(cfg, tmp_path)
    shared = run.engine.health()["shared_weight_bytes"]
    run.train()
    return shared, read_metrics(tmp_path)


def test_a_colocated_lora_run_shares_its_base_and_learns_exactly_as_without(tmp_path):
    shared, rows = _run(tmp_path / "shared")
    own, own_rows = _run(tmp_path / "own", "sync.share_frozen_base=false")
    assert shared > 0 and own == 0
    keys = ["reward/mean", "train/loss", "train/grad_norm", "train_rollout_logprob_abs_diff/max", "sync/bytes"]
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in own_rows]


def _built_on(base, **kw) -> TorchEngine:
    """An engine built on a trainer's frozen base (``base=``), as a colocated LoRA run builds it."""
    return TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-llama"), max_num_seqs=8, max_model_len=256,
                                         **kw), base=base)


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_engine_built_on_the_trainers_base_holds_its_memory_from_the_start_and_serves_what_its_own_copy_serves(
        deterministic):
    trainer = _trainer()
    plain, quantized = base = trainer.frozen_weights()
    own, built = make_engine(lora_alpha=8.0, deterministic=deterministic), _built_on(
        base, lora_alpha=8.0, deterministic=deterministic)
    params = dict(built.model.named_parameters(remove_duplicate=False))
    for name, t in plain:  # never a copy of its own, not even while it was built
        assert params[name].data_ptr() == t.data_ptr(), name
    assert built.health()["shared_weight_bytes"] == sum(t.numel() * t.element_size() for _, t in plain)
    assert built.share_weights(plain) == {"shared_tensors": len(plain), "shared_mib": pytest.approx(
        sum(t.numel() * t.element_size() for _, t in plain) / 2**20), "quantized_tensors": 0, "quantized_mib": 0,
        "skipped": 0}  # what the run's share_frozen_base then reports: all of it held already
    ps = prompts([5, 9, 14])
    frozen_before = {n: t.clone() for n, t in plain}
    for step in (1, 2):  # a colocated run: adapter-only sync, generate, sleep, the trainer steps, wake
        for engine in (own, built):
            engine.load_lora_adapter(_adapters(trainer), version=step)
        assert _outputs(built, ps) == _outputs(own, ps)
        for engine in (own, built):
            engine.sleep()
        trainer.train_step(make_batch(), token_mean_pg)
        for engine in (own, built):
            engine.wake_up()
    assert all(torch.equal(t, frozen_before[n]) for n, t in plain)  # nothing wrote the base
    trainer.close()


def test_base_tensors_of_another_shape_or_dtype_are_read_from_the_model_files_instead():
    own = make_engine()
    weights = {n: t.clone() for n, t in own.named_weights().items()}
    name, other = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"
    built = _built_on(([(name, weights[name].double()), (other, weights[other].t().contiguous()),
                        ("model.norm.weight", weights["model.norm.weight"])], []))
    assert built.health()["shared_weight_bytes"] == weights["model.norm.weight"].numel() * 4
    after = built.named_weights()
    assert all(torch.equal(after[n], t) for n, t in weights.items())


def test_a_quantized_engine_built_on_the_qlora_trainers_base_holds_its_quantized_tensors_awake():
    trainer = _trainer(quantize_base=FP8)
    plain, quantized = base = trainer.frozen_weights()
    own, built = make_engine(lora_alpha=8.0, quantization=FP8), _built_on(base, lora_alpha=8.0, quantization=FP8)
    params = dict(built.model.named_parameters(remove_duplicate=False))
    for name, tensors in quantized:  # held on the trainer's tensors from the start: no float copy, none quantized
        assert type(params[name]) is AsleepQuantizedWeight, name
        held = built._asleep[id(params[name])][2]
        assert all(held[k].data_ptr() == t.data_ptr() for k, t in tensors.items()), name
    health, own_health = built.health(), own.health()
    assert health["plain_weight_bytes"] < own_health["plain_weight_bytes"]
    assert health["packed_weight_bytes"] == own_health["packed_weight_bytes"]
    out = built.share_weights(plain, quantized)  # the run's share_frozen_base: nothing restored, nothing skipped
    assert out["quantized_tensors"] == len(quantized) and out["skipped"] == 0
    assert all(type(params[n]) is AsleepQuantizedWeight for n, _ in quantized)
    ps = prompts([5, 9, 14])
    for step in (1, 2):
        for engine in (own, built):
            engine.load_lora_adapter(_adapters(trainer), version=step)
        assert _outputs(built, ps) == _outputs(own, ps)
        for engine in (own, built):
            engine.sleep()
        for engine in (own, built):
            engine.wake_up()
    assert torch.equal(built.named_weights()[quantized[0][0]], own.named_weights()[quantized[0][0]])
    trainer.close()


def test_quantized_base_tensors_the_engine_cannot_hold_are_refused_at_build():
    trainer = _trainer(quantize_base=FP8)
    plain, quantized = trainer.frozen_weights()
    other = QuantConfig(format="fp8_block", block_size=(16, 16))
    with pytest.raises(ValueError, match=r"dequantize to shape|not fp8_block's"):  # another grid's tensors
        _built_on((plain, quantized), lora_alpha=8.0, quantization=other)
    names = [n for n, _ in quantized]
    assert any("v_proj" in n for n in names) and any("v_proj" not in n for n in names)
    only_v = QuantConfig(format="fp8_block", block_size=(32, 32), target_modules=["v_proj"])
    with pytest.raises(ValueError, match=r"base: quantized tensors for \S+ which this engine does not quantize"):
        _built_on((plain, quantized), lora_alpha=8.0, quantization=only_v)
    unquantized = _built_on((plain, quantized))  # an engine without quantization: the files' weights
    weights, files = unquantized.named_weights(), make_engine().named_weights()
    assert all(torch.equal(weights[n], t) for n, t in files.items())
    trainer.close()
