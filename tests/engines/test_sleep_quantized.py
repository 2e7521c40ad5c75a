"""A sleeping quantized engine (a QLoRA base, a QAT policy) holds the plain copies of its targeted weights as
their quantized tensors, and gives back exactly the same bits at `wake_up`, `score` and `named_weights`
(tandem/engines/inference/torch/weights.py): issue 20's "the engine holds the same bits", in the memory the
trainer's step runs in."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.inference.torch.weights import AsleepQuantizedWeight
from tandem.kernels import QuantConfig

from .test_torch_engine_lora import _out, _req, _trained_adapter
from .torch_helpers import make_engine, prompts

FORMATS = {
    "fp8_block": QuantConfig(format="fp8_block", block_size=(32, 32)),
    "mxfp8": QuantConfig(format="mxfp8"),
    "int4_sym": QuantConfig(format="int4_sym", group_size=32),
    "int4_asym": QuantConfig(format="int4_asym", group_size=32),
}


@pytest.fixture(scope="module")
def adapter():
    return _trained_adapter()


def _asleep(engine) -> list[str]:
    return [n for n, w in engine.model.named_parameters() if type(w) is AsleepQuantizedWeight]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_sleeping_qlora_engine_holds_its_base_quantized_and_wakes_to_the_same_bits(adapter, fmt):
    engine = make_engine(lora_alpha=8.0, quantization=FORMATS[fmt])
    engine.load_lora_adapter(adapter, version=1)
    assert engine.health()["lora_merged"] == "policy"  # the merged engine keeps a plain copy of each base weight
    ps = prompts([5, 9, 14])
    reqs = [_req(p, seed=i) for i, p in enumerate(ps)]
    before = [_out(r) for r in engine.generate(reqs)]
    weights = {n: t.clone() for n, t in engine.named_weights().items()}
    scored = engine.score([(p + [3, 4, 5], len(p)) for p in ps])
    plain_bytes = engine.health()["plain_weight_bytes"]
    params = dict(engine.model.named_parameters())
    # the quantization's targets that hold a plain copy (the adapter's base weights, and those a sync cannot
    # pack in place); the other targets are packed-only, their packed copy kept asleep as before
    plain_targets = {n for n in engine._quant.weight_names if not params[n].is_meta}
    assert {f"{m}.weight" for m in engine.adapters.adapters["policy"].modules} <= plain_targets

    engine.sleep()
    asleep = _asleep(engine)
    if fmt != "int4_asym":  # formats whose second quantization keeps the bits: every such weight
        assert set(asleep) == plain_targets
        freed = sum(params[n].numel() * 4 for n in plain_targets)
        assert engine.health()["plain_weight_bytes"] == plain_bytes - freed
        with pytest.raises(RuntimeError, match="holds quantized"):
            params[asleep[0]].sum()
    engine.wake_up()  # the packed copies are built from the quantized values: the weights stay held quantized
    if fmt != "int4_asym":
        assert set(_asleep(engine)) == plain_targets
        assert engine.health()["plain_weight_bytes"] == plain_bytes - freed
    assert [_out(r) for r in engine.generate(reqs)] == before  # folded and packed again from the same bits
    for name, tensor in engine.named_weights().items():
        assert torch.equal(tensor, weights[name]), name

    engine.sleep()  # asleep: scoring gives the plain copies back (the adapter unmerged asleep: rounding apart)
    for got, want in zip(engine.score([(p + [3, 4, 5], len(p)) for p in ps]), scored, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-5, rtol=0)
    assert not _asleep(engine)
    engine.wake_up()
    engine.sleep()  # and so does reading the weights, exactly
    for name, tensor in engine.named_weights().items():
        assert torch.equal(tensor, weights[name]), name
    engine.wake_up()
    assert [_out(r) for r in engine.generate(reqs)] == before


def test_an_engine_without_quantization_keeps_its_float_weights_asleep(adapter):
    engine = make_engine(lora_alpha=8.0)
    engine.load_lora_adapter(adapter, version=1)
    plain_bytes = engine.health()["plain_weight_bytes"]
    engine.sleep()
    assert not _asleep(engine) and engine.health()["plain_weight_bytes"] == plain_bytes
    engine.wake_up()


def test_an_update_while_asleep_writes_into_the_plain_weights(adapter):
    """A full update to a sleeping quantized engine: the weights come back before they are written, and the
    engine serves what was sent (quantized on its grid), as an awake one would."""
    cfg = FORMATS["fp8_block"]
    awake, sleeper = make_engine(quantization=cfg), make_engine(quantization=cfg)
    new = [(n, t * 0.9) for n, t in awake.named_weights().items()]
    awake.update_weights(new, version=1)
    sleeper.sleep()
    assert _asleep(sleeper)
    sleeper.update_weights(new, version=1)
    sleeper.wake_up()
    for (name, a), b in zip(awake.named_weights().items(), sleeper.named_weights().values(), strict=True):
        assert torch.equal(a, b), name
    reqs = [_req(p, seed=i) for i, p in enumerate(prompts([6, 11]))]
    assert [_out(r) for r in awake.generate(reqs)] == [_out(r) for r in sleeper.generate(reqs)]


def test_a_woken_quantized_engine_serves_syncs_and_scores_from_its_packed_copies(adapter):
    """Awake, a weight held quantized has only its packed copy: generation, scoring, an adapter sync (folded
    from its dequantized values) and a full update give exactly what an engine that never slept gives."""
    cfg = FORMATS["fp8_block"]
    woken, awake = make_engine(lora_alpha=8.0, quantization=cfg), make_engine(lora_alpha=8.0, quantization=cfg)
    for engine in (woken, awake):
        engine.load_lora_adapter(adapter, version=1)
    woken.sleep()
    woken.wake_up()
    held = _asleep(woken)
    assert held and woken.health()["plain_weight_bytes"] < awake.health()["plain_weight_bytes"]
    reqs = [_req(p, seed=i) for i, p in enumerate(prompts([5, 9, 14]))]
    seqs = [(p + [3, 4, 5], len(p)) for p in prompts([4, 7])]

    def same() -> None:
        assert [_out(r) for r in woken.generate(reqs)] == [_out(r) for r in awake.generate(reqs)]
        assert woken.score(seqs) == awake.score(seqs)

    same()
    assert _asleep(woken) == held  # scoring read the packed copies: nothing came back
    other = [(n, t * -0.5) for n, t in adapter]
    for engine in (woken, awake):
        engine.load_lora_adapter(other, version=2)  # folded into the packed copies from the held values
    same()
    assert _asleep(woken) == held
    new = [(n, t * 0.9) for n, t in awake.named_weights().items()]
    for engine in (woken, awake):
        engine.update_weights(new, version=3)
    same()
    for (name, a), b in zip(awake.named_weights().items(), woken.named_weights().values(), strict=True):
        assert torch.equal(a, b), name
