"""The engine-side rules, in one process with real engines: in-process sync from an FSDPEngine to a
TorchEngine, verify, versions, LoRA adapters, quantize-on-send and the EngineReceiver thread."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.config import from_dict
from tandem.core.protocols import EngineInfo
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, LoRAConfig, OptimizerConfig
from tandem.kernels import QuantConfig, fake_quantize_weight
from tandem.kernels.state_dict import is_target
from tandem.models import ModelConfig
from tandem.sync import (
    EngineReceiver,
    InProcessSync,
    QuantizedSender,
    SyncConfig,
    SyncError,
    VerifyError,
    WeightApplier,
    build_receiver,
    build_sender,
    checksum,
)
from tandem.sync.disk import DiskReceiver, DiskSender
from tests.engines.training.helpers import make_batch, token_mean_pg
from tests.sync.engine_worker import MODEL, build_engine, engine_digest, greedy
from tests.sync.sinks import perturbed_weights, weight_buckets

BUCKET = 64 * 1024
FP8 = QuantConfig(format="fp8_block", block_size=(32, 32))  # several blocks per tiny-model matrix


def _trainer(**kw) -> FSDPEngine:
    return FSDPEngine(FSDPConfig(model=ModelConfig(name=MODEL), optimizer=OptimizerConfig(lr=1e-2), **kw))


def _trained(**kw) -> FSDPEngine:
    trainer = _trainer(**kw)
    trainer.train_step(make_batch(seed=0), token_mean_pg)
    return trainer


def _digest(named) -> dict[str, int]:
    return {n: checksum(t) for n, t in named}


def _storage(engine) -> dict[str, int]:
    """Where each engine weight's values live: its plain tensor, or a packed-only weight's packed copy."""
    from tandem.ops.linear import PackedOnlyWeight, _buffer

    return {n: _buffer(engine._packed[id(p)])[0] if type(p) is PackedOnlyWeight else p.data_ptr()
            for n, p in engine._weights.items()}


def test_inprocess_fsdp_to_torch_engine_is_bit_exact_in_place_and_verified():
    trainer, engine = _trained(), build_engine()
    storage = _storage(engine)
    before = greedy(engine)
    sync = InProcessSync(engine, verify=True)
    metrics = sync.send(trainer.named_parameters_for_sync(BUCKET), 1)
    sent = _digest(nt for b in trainer.named_parameters_for_sync(BUCKET) for nt in b)
    got = engine_digest(engine)
    assert engine.weight_version == 1 and {n: got[n] for n in sent} == sent
    assert metrics["sync/verified_tensors"] == len(sent) and metrics["sync/bytes"] > 0
    # copied into the engine's existing storage: no new full-model allocation
    assert _storage(engine) == storage
    trainer.train_step(make_batch(seed=1), token_mean_pg)
    sync.send(trainer.named_parameters_for_sync(BUCKET), 2)
    assert engine.weight_version == 2 and engine_digest(engine) != got
    assert len(greedy(engine)) == 6 and before  # it still generates


def test_verify_catches_an_engine_that_does_not_hold_what_was_sent():
    # tiny-llama ties lm_head to the embedding; a trainer with an untied head sends both, different:
    # the engine copies both into one storage, so the embedding it holds is not the one sent
    engine = build_engine()
    weights = perturbed_weights(1, MODEL)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1.0
    with pytest.raises(VerifyError, match=r"\(the update was applied\): engine: model.embed_tokens.weight: engine weight differs"):
        InProcessSync(engine, verify=True).send(weight_buckets(weights), 1)
    # the same engine fed consistent weights verifies cleanly
    InProcessSync(engine, verify=True).send(weight_buckets(perturbed_weights(2, MODEL)), 2)


def test_versions_never_go_backwards_and_rejections_leave_the_engine_untouched():
    engine = build_engine()
    sync = InProcessSync(engine)
    sync.send(weight_buckets(perturbed_weights(1, MODEL)), 3)
    held = engine_digest(engine)
    with pytest.raises(SyncError, match="version 2 is older than the engine's version 3.*weights untouched"):
        sync.send(weight_buckets(perturbed_weights(2, MODEL)), 2)
    bad = dict(perturbed_weights(2, MODEL))
    bad["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(SyncError, match=r"rejected the update to version 4.*model.norm.weight: shape \(7,\)"):
        sync.send(weight_buckets(bad), 4)
    assert engine.weight_version == 3 and engine_digest(engine) == held
    sync.send(weight_buckets(perturbed_weights(1, MODEL)), 3)  # re-sending the held version is allowed
    assert engine.weight_version == 3


# -- LoRA ---------------------------------------------------------------------------------------------


class AdapterSink:
    """An engine that loads LoRA adapters (as vLLM/SGLang do): keeps the adapter tensors it gets."""

    info = EngineInfo(name="adapter-sink", dtype="float32", max_context=64, lora_adapters=True)

    def __init__(self) -> None:
        self.weight_version, self.adapter = 0, {}

    def update_weights(self, named, version) -> None:
        raise AssertionError("adapter-only updates must not reach update_weights")

    def load_lora_adapter(self, named, version) -> None:
        self.adapter = {n: t.clone() for n, t in named}
        self.weight_version = version


def test_lora_adapter_only_sync_goes_to_adapter_engines_and_is_refused_clearly_elsewhere():
    trainer = _trained(lora=LoRAConfig(rank=4, target_modules=("q_proj", "v_proj"), sync="adapter"))
    adapter = [nt for b in trainer.named_parameters_for_sync(BUCKET) for nt in b]
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n, _ in adapter)
    engine = build_engine()
    held = engine_digest(engine)
    with pytest.raises(SyncError, match=r"LoRA adapter tensors only \(8 tensor\(s\), e.g. 'base_model.model."
                                        r".*torch cannot load adapters \(its info.lora_adapters is false\).*sync.lora_mode: merged.*kept "
                                        r"version 0"):
        InProcessSync(engine).send(trainer.named_parameters_for_sync(BUCKET), 1)
    assert engine.weight_version == 0 and engine_digest(engine) == held
    sink = AdapterSink()
    InProcessSync(sink).send(trainer.named_parameters_for_sync(BUCKET), 1)
    assert sink.weight_version == 1 and _digest(sink.adapter.items()) == _digest(adapter)
    mixed = [[*adapter, ("model.norm.weight", torch.ones(64))]]
    with pytest.raises(SyncError, match="mixes LoRA adapter tensors .* with full weights"):
        InProcessSync(sink).send(mixed, 2)


def test_lora_merged_sync_reaches_the_engine_bit_exact():
    trainer = _trained(lora=LoRAConfig(rank=4, target_modules=("q_proj", "v_proj")))
    engine = build_engine()
    InProcessSync(engine, verify=True).send(trainer.named_parameters_for_sync(BUCKET), 1)
    sent = _digest(nt for b in trainer.named_parameters_for_sync(BUCKET) for nt in b)
    assert not any(".lora_" in n for n in sent)
    assert {n: engine_digest(engine)[n] for n in sent} == sent


# -- quantize-on-send -------------------------------------------------------------------------------------


def test_quantize_on_send_gives_the_engine_the_trainers_fake_quant_weights_bit_for_bit():
    trainer, engine = _trained(), build_engine()
    weights = {n: t.clone() for b in trainer.named_parameters_for_sync(BUCKET) for n, t in b}
    sync = QuantizedSender(InProcessSync(engine, dequantize=FP8, verify=True), FP8)
    metrics = sync.send(trainer.named_parameters_for_sync(BUCKET), 1)
    held = engine.named_weights()
    targets = [n for n, w in weights.items() if is_target(n, w, FP8)]
    assert len(targets) == 14  # 7 projections x 2 layers
    for name, w in weights.items():
        want = fake_quantize_weight(w, FP8) if name in targets else w
        assert torch.equal(held[name].view(torch.int32), want.view(torch.int32)), name  # same bits
        assert name not in targets or not torch.equal(held[name], w)  # it really was quantized
    assert metrics["sync/bytes"] < 0.5 * metrics["sync/bytes_unquantized"]  # fp8 + scales vs fp32


def test_quantized_update_to_a_receiver_without_dequantize_is_refused():
    engine = build_engine()
    sync = QuantizedSender(InProcessSync(engine), FP8)
    with pytest.raises(SyncError, match="is quantized .* no dequantize config.*sync.quantize"):
        sync.send(weight_buckets(perturbed_weights(1, MODEL)), 1)
    assert engine.weight_version == 0


def test_quantized_disk_delta_loads_a_weight_with_its_scales(tmp_path):
    """Doubling a weight keeps its fp8 codes and doubles its scales: delta writes only the scales, and
    the receiver must still load codes and scales together to dequantize."""
    engine = build_engine()
    w1 = perturbed_weights(1, MODEL)
    sender = QuantizedSender(DiskSender(tmp_path, delta=True), FP8)
    receiver, applier = DiskReceiver(tmp_path), WeightApplier(engine, dequantize=FP8)
    sender.send(weight_buckets(w1), 1)
    assert receiver.poll(applier, verify=True) == 1
    name = "model.layers.1.mlp.down_proj.weight"
    w2 = {**w1, name: w1[name] * 2}
    metrics = sender.send(weight_buckets(w2), 2)
    scales = (w1[name].shape[0] // 32) * (w1[name].shape[1] // 32) * 4
    assert metrics["sync/bytes"] == scales  # only <name>_scale_inv changed
    assert receiver.poll(applier, verify=True) == 2
    held = engine.named_weights()[name]
    assert torch.equal(held, fake_quantize_weight(w2[name], FP8))
    assert torch.equal(held, 2 * fake_quantize_weight(w1[name], FP8))


# -- config, factory, engine-side thread -------------------------------------------------------------------


def test_sync_config_quantize_section_and_factory(tmp_path):
    cfg = from_dict(SyncConfig, {"transport": "disk", "directory": str(tmp_path), "delta": True,
                                 "quantize": {"format": "fp8_block", "block_size": [32, 32]}})
    assert cfg.quantize == FP8
    sender = build_sender(cfg)
    assert isinstance(sender, QuantizedSender) and isinstance(sender.sender, DiskSender) and sender.sender.delta
    assert isinstance(build_receiver(cfg), DiskReceiver)
    with pytest.raises(ValueError, match="needs the inference engine"):
        build_sender(SyncConfig())
    with pytest.raises(ValueError, match="port=0: an engine process must be told the sender's port"):
        build_receiver(SyncConfig(transport="broadcast"))
    with pytest.raises(ValueError, match="num_receivers=0 must be >= 1"):
        SyncConfig(num_receivers=0)


def test_engine_receiver_thread_applies_disk_versions_while_the_engine_serves(tmp_path):
    engine = build_engine()
    sender = DiskSender(tmp_path)
    applied = []
    with EngineReceiver(engine, DiskReceiver(tmp_path), poll_interval_s=0.02, on_update=applied.append) as rx:
        for version in (1, 2):
            w = perturbed_weights(version, MODEL)
            sender.send(weight_buckets(w), version)
            deadline = time.monotonic() + 20
            while engine.weight_version != version and time.monotonic() < deadline:
                greedy(engine, n=2)  # the engine keeps generating on the main thread meanwhile
            assert engine.weight_version == version
            assert {n: engine_digest(engine)[n] for n in w} == _digest(w.items())
        # a version the engine rejects is logged; the thread keeps serving and the engine keeps version 2
        bad = {**perturbed_weights(3, MODEL), "model.norm.weight": torch.zeros(7)}
        sender.send(weight_buckets(bad), 3)
        deadline = time.monotonic() + 20
        while not rx.errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "rejected the update to version 3" in rx.last_error and engine.weight_version == 2
        sender.send(weight_buckets(perturbed_weights(4, MODEL)), 4)
        deadline = time.monotonic() + 20
        while engine.weight_version != 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.running and engine.weight_version == 4
    assert applied == [1, 2, 4] and not rx.running


# -- name / layout mapping ------------------------------------------------------------------------------


class FusedQKVEngine:
    """An engine that stores q/k/v as one fused ``qkv_proj`` per layer (as vLLM does); its sync maps HF
    names with ``map_weights`` (the applier's ``transform``)."""

    info = EngineInfo(name="fused-qkv", dtype="float32", max_context=64, exposes_weights=True)

    def __init__(self, base: dict[str, torch.Tensor]) -> None:
        self.weights = {n: t.clone() for n, t in self.map_weights(list(base.items()))}
        self.weight_version = 0

    @staticmethod
    def map_weights(named):
        named = dict(named)
        out = []
        for name, t in named.items():
            if ".q_proj." in name:
                k, v = (named.get(name.replace("q_proj", p)) for p in ("k_proj", "v_proj"))
                if k is None or v is None:
                    raise ValueError(f"{name} without its k_proj/v_proj")
                out.append((name.replace("q_proj", "qkv_proj"), torch.cat([t, k, v])))
            elif ".k_proj." in name or ".v_proj." in name:
                if name.replace("k_proj", "q_proj").replace("v_proj", "q_proj") not in named:
                    raise ValueError(f"{name} without its q_proj")
            else:
                out.append((name, t))
        return out

    def named_weights(self):
        return dict(self.weights)

    def update_weights(self, named, version) -> None:
        for n, t in named:
            if n not in self.weights or self.weights[n].shape != t.shape:
                raise ValueError(f"unknown weight {n!r} or shape {tuple(t.shape)}")
        for n, t in named:
            self.weights[n].copy_(t)
        self.weight_version = version


def test_engine_name_mapping_transform_fuses_qkv_and_is_verified():
    base, new = perturbed_weights(1, MODEL), perturbed_weights(2, MODEL)
    engine = FusedQKVEngine(base)
    assert "model.layers.0.self_attn.qkv_proj.weight" in engine.weights
    InProcessSync(engine, verify=True, transform=engine.map_weights).send(weight_buckets(new), 1)
    fused = engine.weights["model.layers.1.self_attn.qkv_proj.weight"]
    p = "model.layers.1.self_attn."
    assert torch.equal(fused, torch.cat([new[p + "q_proj.weight"], new[p + "k_proj.weight"], new[p + "v_proj.weight"]]))
    held = dict(engine.weights)
    with pytest.raises(SyncError, match="mapping the update to version 2 failed: ValueError: .*k_proj.weight without its q_proj"):
        InProcessSync(engine, transform=engine.map_weights).send([[(p + "k_proj.weight", new[p + "k_proj.weight"])]], 2)
    assert engine.weight_version == 1 and all(torch.equal(held[n], t) for n, t in engine.weights.items())
