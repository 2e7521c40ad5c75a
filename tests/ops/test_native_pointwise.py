"""The native RMSNorm / rotary / SwiGLU kernels (tandem/ops/csrc/pointwise.c) against the torch ops they
replace inside `pointwise_kernels`, their fallbacks, and the engine either way."""

from __future__ import annotations

import pytest
import torch

from tandem.models.lean_ops import pointwise_kernels, rms_norm, rotary, swiglu
from tandem.ops import native

needs_native = pytest.mark.skipif(native.load("pointwise") is None, reason="no C compiler: the torch ops run")


def _operands(dtype, rows=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, 96, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    a, b = (4 * torch.randn(rows, 160, generator=g)).to(dtype), torch.randn(rows, 160, generator=g).to(dtype)
    a[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's saturation and zero
    qkv = torch.randn(rows, 7, 32, generator=g).to(dtype)
    q = qkv[:, :5]  # rows at a stride (a slice of a fused projection), heads contiguous
    angle = torch.arange(rows)[:, None] * 0.37 ** torch.arange(16)
    emb = torch.cat([angle, angle], -1)
    return x, w, a, b, q, emb.cos().to(dtype), emb.sin().to(dtype)


def _both(dtype, **kw):
    x, w, a, b, q, cos, sin = _operands(dtype, **kw)

    def run():
        return rms_norm(x, w, 1e-6), swiglu(a, b), rotary(q, cos[:, None], sin[:, None])

    want = run()
    with pointwise_kernels(native.load("pointwise")):
        got = run()
    return want, got


@needs_native
@pytest.mark.parametrize("rows", [1, 37, 700])  # one thread, and rows split over threads
def test_float32_matches_the_torch_ops_to_rounding(rows):
    want, got = _both(torch.float32, rows=rows)
    for name, w, g in zip(("rms_norm", "swiglu", "rotary"), want, got, strict=True):
        assert g.shape == w.shape and g.dtype == torch.float32 and g.is_contiguous(), name
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6, msg=name)


@needs_native
@pytest.mark.parametrize("rows", [1, 37, 700])
def test_bfloat16_rounds_where_torch_rounds(rows):
    """Each torch bf16 op rounds its float32 value; the kernels round at the same points, so the results
    are torch's bits except where RMSNorm's reordered float32 sum lands across a bf16 rounding boundary."""
    want, got = _both(torch.bfloat16, rows=rows)
    for name, w, g in zip(("rms_norm", "swiglu", "rotary"), want, got, strict=True):
        assert g.dtype == torch.bfloat16, name
        same = (g == w).float().mean().item()
        assert same > 0.999 if name == "rms_norm" else same == 1.0, (name, same)
        torch.testing.assert_close(g.float(), w.float(), rtol=8e-3, atol=1e-6, msg=name)


@needs_native
def test_what_the_kernels_do_not_take_runs_the_torch_ops():
    lib = native.load("pointwise")
    x = torch.randn(8, 6, 16)
    assert native.rms_norm(lib, x.double(), torch.ones(16, dtype=torch.float64), 1e-6) is None
    assert native.rms_norm(lib, x.transpose(0, 1), torch.ones(16), 1e-6) is None  # not contiguous
    assert native.swiglu(lib, x, x.bfloat16()) is None
    cos = torch.randn(8, 16)
    assert native.rotary(lib, x.transpose(1, 2), cos, cos) is None  # heads not contiguous
    assert native.rotary(lib, torch.randn(8, 6, 15), torch.randn(8, 15), torch.randn(8, 15)) is None  # odd dim
    with pointwise_kernels(lib):  # and the public functions fall back to the same values
        y = rms_norm(x.transpose(0, 1), torch.ones(16), 1e-6)
    assert torch.equal(y, rms_norm(x.transpose(0, 1), torch.ones(16), 1e-6))


@needs_native
def test_gradients_never_take_the_kernels():
    x, w, a, b, q, cos, sin = _operands(torch.float32)
    x.requires_grad_(True)
    with pointwise_kernels(native.load("pointwise")):
        out = rms_norm(x, w, 1e-6)
    assert out.grad_fn is not None
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), rtol=0, atol=0)  # the lean autograd path's bits
    out.sum().backward()
    assert x.grad is not None


@needs_native
def test_engine_generates_the_same_with_either_pointwise_path():
    from tests.engines.torch_helpers import generate_either_way, make_engine

    results, health = generate_either_way("pointwise")
    assert health == {"torch": "torch", "native": "native"}
    for a, b in zip(results["torch"], results["native"], strict=True):
        ca, cb = a.completions[0], b.completions[0]
        assert ca.token_ids == cb.token_ids
        torch.testing.assert_close(torch.tensor(cb.log_probs), torch.tensor(ca.log_probs), atol=1e-4, rtol=0)
    det = make_engine(deterministic=True, pointwise="auto")  # the exact contract keeps the torch ops
    assert det.health()["pointwise"] == "torch"
    det.close()
    with pytest.raises(ValueError, match="pointwise='fused' must be 'auto', 'native' or 'torch'"):
        from tandem.engines.inference.torch.config import TorchEngineConfig

        TorchEngineConfig(pointwise="fused")
