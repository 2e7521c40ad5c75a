"""The embedded engine's packed-only weights (``inference.torch.keep_plain_weights: false``, the default): the
plain copy of each packed linear weight of the decoder layers is dropped, and everything the engine does
gives the same bits as an engine that keeps both copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.ops import native
from tandem.ops.linear import CAN_PACK, ONEDNN_BF16, PackedOnlyWeight
from tests.engines.torch_helpers import AMX_BF16, make_engine, prompts, requests

pytestmark = pytest.mark.skipif(not CAN_PACK or native.load("pack") is None,
                                reason="no oneDNN packing or no C compiler: nothing is packed in place")

SAMPLED = dict(temperature=0.9, max_new_tokens=12, seed=4)
needs_bf16 = pytest.mark.skipif(not ONEDNN_BF16 or AMX_BF16,
                                reason="oneDNN has no bfloat16 linears on this CPU (AVX2 only), or lays them out for "
                                       "AMX: bf16 weights keep their plain copy (test_a_cpu_without_in_place_...)")


def _outputs(engine, ps):
    results = engine.generate(requests(ps, **SAMPLED))
    return [(c.token_ids, c.log_probs) for r in results for c in r.completions]


def _dropped(engine) -> list[str]:
    return [n for n, p in engine.model.named_parameters() if type(p) is PackedOnlyWeight]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_only_engine_generates_and_syncs_exactly_as_one_keeping_both_copies(dtype, deterministic):
    ps = prompts([6, 19, 11], seed=8)
    with make_engine(dtype=dtype, deterministic=deterministic) as lean, \
            make_engine(dtype=dtype, deterministic=deterministic, keep_plain_weights=True) as both:
        dropped = _dropped(lean)
        # tiny-llama: q/o/gate/up/down of both layers (rows a multiple of 64); k and v (32 rows) keep theirs
        assert sorted({n.split(".")[-2] for n in dropped}) == ["down_proj", "gate_proj", "o_proj", "q_proj", "up_proj"]
        assert len(dropped) == 10 and not _dropped(both)
        saved = sum(p.numel() * p.element_size() for n, p in lean.model.named_parameters() if n in dropped)
        assert both.health()["plain_weight_bytes"] - lean.health()["plain_weight_bytes"] == saved
        assert lean.health()["packed_weight_bytes"] == both.health()["packed_weight_bytes"]
        weights = lean.named_weights()
        assert weights.keys() == both.named_weights().keys()
        assert all(torch.equal(weights[n], t) for n, t in both.named_weights().items())  # unpacked exactly
        assert _outputs(lean, ps) == _outputs(both, ps)
        g = torch.Generator().manual_seed(3)
        new = [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)) for n, t in weights.items()]
        lean.update_weights(new, version=1)
        both.update_weights(new, version=1)
        assert _dropped(lean) == dropped  # still packed-only: the sync packed straight into them
        after = lean.named_weights()
        assert all(torch.equal(after[n], t) for n, t in new if n in dropped)
        assert all(torch.equal(after[n], t) for n, t in both.named_weights().items())
        assert _outputs(lean, ps) == _outputs(both, ps)
        for engine in (lean, both):  # a colocated trainer's turn: sleep, a sync while asleep, wake
            engine.sleep()
            engine.update_weights(weights.items(), version=2)
            engine.wake_up()
        assert _outputs(lean, ps) == _outputs(both, ps)
        assert all(torch.equal(lean.named_weights()[n], t) for n, t in weights.items())


@needs_bf16
def test_a_float32_sync_lands_in_a_packed_only_bfloat16_engine():
    with make_engine(dtype="bfloat16") as engine:
        name = "model.layers.1.mlp.up_proj.weight"
        assert name in {n for n in _dropped(engine)}
        value = torch.randn(128, 64)
        engine.update_weights([(name, value)], version=1)
        assert torch.equal(engine.named_weights()[name], value.to(torch.bfloat16))


@pytest.mark.skipif(ONEDNN_BF16 and not AMX_BF16,
                    reason="this CPU packs bfloat16 weights in place: the bf16 cases above drop their plain copies")
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_cpu_without_in_place_bf16_packing_serves_bfloat16_from_plain_weights(deterministic):
    """Without oneDNN bfloat16 (an AVX2-only CPU) a bf16 engine packs and drops nothing: it runs F.linear on its
    plain weights. With AMX, oneDNN packs them (its own reorder) but none can be packed in place, so none drops its
    plain copy. Either way it generates exactly as one told to keep them, and takes a sync and a sleep."""
    ps = prompts([6, 19, 11], seed=8)
    with make_engine(dtype="bfloat16", deterministic=deterministic) as lean, \
            make_engine(dtype="bfloat16", deterministic=deterministic, keep_plain_weights=True) as both:
        assert not _dropped(lean) and bool(lean._packed) == AMX_BF16
        assert lean.health()["plain_weight_bytes"] == both.health()["plain_weight_bytes"] > 0
        assert _outputs(lean, ps) == _outputs(both, ps)
        g = torch.Generator().manual_seed(3)
        new = [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype))
               for n, t in lean.named_weights().items()]
        for engine in (lean, both):
            engine.sleep()
            engine.update_weights(new, version=1)
            engine.wake_up()
        assert _outputs(lean, ps) == _outputs(both, ps)
        after = lean.named_weights()
        assert all(torch.equal(after[n], t) for n, t in both.named_weights().items())
        assert torch.equal(after["model.layers.1.mlp.up_proj.weight"], dict(new)["model.layers.1.mlp.up_proj.weight"])


def test_a_packed_only_weight_refuses_every_use_but_its_packed_product():
    with make_engine() as engine:
        weight = engine.model.model.layers[0].mlp.up_proj.weight
        assert type(weight) is PackedOnlyWeight and weight.shape == (128, 64) and weight.dtype == torch.float32
        x = torch.randn(3, 64)
        with pytest.raises(RuntimeError, match=r"linear\(\) on a packed-only linear weight.*keep_plain_weights"):
            F.linear(x, weight)
        with pytest.raises(RuntimeError, match="packed-only"):
            engine.model.model.layers[0].mlp.up_proj(x)  # outside the engine's step
        with pytest.raises(RuntimeError, match="packed-only"):
            weight.sum()
        with pytest.raises(RuntimeError, match="packed-only"):
            engine.model.state_dict()
        assert "PackedOnlyWeight(shape=(128, 64)" in repr(weight)


def test_a_merged_lora_adapter_gets_the_plain_base_back_and_the_same_outputs():
    """A merged LoRA fold starts from the base weight: a packed-only weight an adapter targets gets its plain
    copy back (unpacked from its packed copy, which still holds exactly the base) and keeps it."""
    from tests.engines.test_torch_engine_lora import _trained_adapter

    ps = prompts([7, 13], seed=2)
    adapter = _trained_adapter(seed=5)  # q_proj, v_proj, down_proj
    with make_engine(lora_alpha=8.0) as lean, make_engine(lora_alpha=8.0, keep_plain_weights=True) as both:
        before = _dropped(lean)
        for engine in (lean, both):
            engine.load_lora_adapter(adapter, version=1)
        targeted = {n.removeprefix("base_model.model.").split(".lora_")[0] + ".weight" for n, _ in adapter}
        assert targeted & set(before) and not targeted & set(_dropped(lean))
        assert set(_dropped(lean)) == set(before) - targeted
        assert lean.health()["lora_merged"] is not None
        assert _outputs(lean, ps) == _outputs(both, ps)


def test_a_model_passed_in_keeps_its_plain_weights():
    from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
    from tandem.models import ModelConfig, resolve_model
    from tandem.models.transformer import CausalLM

    model = CausalLM.from_pretrained(resolve_model("tiny-llama"))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-llama"), max_num_seqs=2, max_model_len=64),
                     model=model) as engine:
        assert not _dropped(engine) and engine.health()["packed_weight_bytes"] > 0
        engine.generate(requests(prompts([5]), max_new_tokens=4))
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())  # still the caller's to read


def test_named_weights_unpacks_only_what_is_read(monkeypatch):
    """A read-only mapping: reading one packed-only weight unpacks that one (sync.verify reads a bucket's
    names at a time), and every read gives the current values."""
    from tandem.sync.verify import verify_applied

    with make_engine() as engine:
        name = "model.layers.0.mlp.up_proj.weight"
        packed_type = type(engine._packed[id(engine._weights[name])])
        unpacked = []
        real = packed_type.to_dense
        monkeypatch.setattr(packed_type, "to_dense", lambda self, *a, **k: unpacked.append(1) or real(self, *a, **k))
        weights = engine.named_weights()
        assert len(weights) == len(list(weights)) > 10 and not unpacked
        with pytest.raises(TypeError):
            weights[name] = torch.zeros(1)  # read-only
        value = torch.randn(128, 64)
        engine.update_weights([(name, value)], version=1)
        report = verify_applied(engine, [(name, value)], [(name, value)])
        assert report["mismatched"] == [] and len(unpacked) == 1
        assert torch.equal(weights[name], value) and len(unpacked) == 2
