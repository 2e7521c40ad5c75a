"""The lean RMSNorm / rotary / SwiGLU: the same forward bits as the plain ops, the same gradients, and
fewer bytes kept for backward (what they exist for)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models.lean_ops import _rms_norm_plain, _rotate_half, rms_norm, rotary, swiglu
from tandem.models.tiny import tiny_config
from tandem.models.transformer import CausalLM, DecoderLayer, TransformerArgs
from tandem.ops import batch_invariant_mode


def _plain_rotary(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _plain_swiglu(a, b):
    return F.silu(a) * b


CASES = {
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: _rms_norm_plain(x, w, 1e-6)),
    "rotary": (rotary, _plain_rotary),
    "swiglu": (swiglu, _plain_swiglu),
}


def _inputs(name: str, dtype: torch.dtype, *, grad: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 16, generator=g).to(dtype)
    if name == "rms_norm":
        other = (1.0 + 0.1 * torch.randn(16, generator=g)).to(dtype)
        args = [x, other]
    elif name == "rotary":
        ang = torch.randn(37, 1, 16, generator=g)
        args = [x, ang.cos().to(dtype), ang.sin().to(dtype)]
    else:
        args = [x, torch.randn(37, 3, 16, generator=g).to(dtype)]
    trainable = 2 if name in ("rms_norm", "swiglu") else 1
    return [a.requires_grad_(grad and i < trainable) for i, a in enumerate(args)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_bits_equal_the_plain_ops_with_and_without_grad(name, dtype):
    lean, plain = CASES[name]
    with torch.no_grad():
        ref = plain(*_inputs(name, dtype, grad=False))
    assert torch.equal(lean(*_inputs(name, dtype, grad=True)), ref)
    assert torch.equal(lean(*_inputs(name, dtype, grad=False)), ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_equal_autograd_of_the_plain_ops(name):
    lean, plain = CASES[name]
    a, b = _inputs(name, torch.float64, grad=True), _inputs(name, torch.float64, grad=True)
    dy = torch.randn(37, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (lean(*a) * dy).sum().backward()
    (plain(*b) * dy).sum().backward()
    for x, y in zip(a, b, strict=True):
        if x.requires_grad:
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)  # RMSNorm computes in float32
    if name != "rms_norm":  # exact in float64: finite differences agree
        assert torch.autograd.gradcheck(lean, _inputs(name, torch.float64, grad=True))


def _saved_bytes(layer: torch.nn.Module, x, cos, sin, ctx, lean: bool, monkeypatch) -> int:
    import tandem.models.lean_ops as lo

    if not lean:  # every op recorded by autograd as the plain composition
        monkeypatch.setattr(lo, "_recording", lambda *t: False)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, ctx).sum().backward()
    monkeypatch.undo()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_a_decoder_layer_keeps_a_fifth_fewer_bytes_for_backward(monkeypatch):
    from tandem.models.attention import VarlenAttention

    args = TransformerArgs.from_hf_config(tiny_config("llama", 256))
    torch.manual_seed(0)
    layer = DecoderLayer(args, 0)
    n = 64
    x = torch.randn(n, args.hidden_size, requires_grad=True)
    cos, sin = CausalLM(args).model.rotary_emb(torch.arange(n), torch.float32)
    ctx = VarlenAttention.from_lengths([n])
    plain = _saved_bytes(layer, x, cos, sin, ctx, False, monkeypatch)
    lean = _saved_bytes(layer, x, cos, sin, ctx, True, monkeypatch)
    assert lean < 0.8 * plain, (lean, plain)


def test_the_batch_invariant_silu_still_applies_inside_the_lean_swiglu():
    a, b = _inputs("swiglu", torch.float32, grad=True)
    with batch_invariant_mode():
        out = swiglu(a, b)
    from tandem.ops.batch_invariant import invariant_silu

    assert torch.equal(out, invariant_silu(a.detach()) * b.detach())
