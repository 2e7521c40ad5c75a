"""The trainer's native backward kernels (RMSNorm, rotary, SwiGLU in tandem/ops/csrc/pointwise.c) against the
float64 gradients of the plain ops and the torch formulas they replace inside `backward_kernels`; their
fallbacks; determinism over thread counts; the FSDP engine either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models.lean_ops import backward_kernels, rms_norm, rotary, swiglu
from tandem.ops import native

needs_native = pytest.mark.skipif(native.load("pointwise") is None, reason="no C compiler: the torch ops run")


def _plain(x, w, a, b, q, cos, sin):
    """The forward as unfused torch ops (autograd differentiates them itself)."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    half = q.shape[-1] // 2
    rot = torch.cat((-q[..., half:], q[..., :half]), -1)
    return w * h, F.silu(a) * b, q * cos[:, None] + rot * sin[:, None]


def _lean(x, w, a, b, q, cos, sin):
    return rms_norm(x, w, 1e-6), swiglu(a, b), rotary(q, cos[:, None], sin[:, None])


def _case(dtype, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, 96, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    a, b = (4 * torch.randn(rows, 160, generator=g)).to(dtype), torch.randn(rows, 160, generator=g).to(dtype)
    a[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's saturation and zero
    q = torch.randn(rows, 5, 32, generator=g).to(dtype)
    angle = torch.arange(rows)[:, None] * 0.37 ** torch.arange(16)
    emb = torch.cat([angle, 2 * angle], -1)  # halves differ: the backward's sin index is checked
    inputs = [t.requires_grad_(True) for t in (x, w, a, b, q)]
    grads_out = [torch.randn(t.shape, generator=g).to(dtype) for t in (x, a, q)]
    return inputs, emb.cos().to(dtype), emb.sin().to(dtype), grads_out


def _grads(fn, inputs, cos, sin, grads_out, lib=None):
    with backward_kernels(lib):
        outs = fn(*inputs, cos, sin)
    return torch.autograd.grad(outs, inputs, grads_out)


@needs_native
@pytest.mark.parametrize("rows", [1, 37, 700])  # one thread, and rows (RMSNorm's blocks) split over threads
def test_float32_gradients_are_the_exact_gradients_to_rounding(rows):
    inputs, cos, sin, dys = _case(torch.float32, rows)
    got = _grads(_lean, inputs, cos, sin, dys, native.load("pointwise"))
    torch_path = _grads(_lean, inputs, cos, sin, dys)
    exact = _grads(_plain, [t.detach().double().requires_grad_(True) for t in inputs], cos.double(), sin.double(),
                   [d.double() for d in dys])
    for name, g, t, e in zip(("x", "w", "a", "b", "q"), got, torch_path, exact, strict=True):
        assert g.dtype == torch.float32 and g.shape == e.shape, name
        scale = float(e.abs().max())
        # the torch formulas' own distance from float64 sets the bar; the kernels stay within a few times it
        bar = max(4 * float((t.double() - e).abs().max()), 2e-6 * scale)
        assert float((g.double() - e).abs().max()) <= bar, name
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5 * scale, msg=name)


@needs_native
@pytest.mark.parametrize("rows", [1, 37, 700])
def test_bfloat16_gradients_round_where_torch_rounds(rows):
    inputs, cos, sin, dys = _case(torch.bfloat16, rows)
    got = _grads(_lean, inputs, cos, sin, dys, native.load("pointwise"))
    want = _grads(_lean, inputs, cos, sin, dys)
    for name, g, w in zip(("x", "w", "a", "b", "q"), got, want, strict=True):
        assert g.dtype == torch.bfloat16, name
        same = (g == w).float().mean().item()
        assert same > 0.99, (name, same)  # a rounding-boundary flip here and there (exp, reordered sums)
        torch.testing.assert_close(g.float(), w.float(), rtol=1.6e-2, atol=1e-2 * float(w.float().abs().max()),
                                   msg=name)


@needs_native
def test_weight_gradient_has_the_same_bits_at_any_thread_count():
    inputs, cos, sin, dys = _case(torch.float32, 700, seed=4)
    lib = native.load("pointwise")
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            results.append(_grads(_lean, inputs, cos, sin, dys, lib))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for g, h in zip(results[0], other, strict=True):
            assert torch.equal(g, h)


@needs_native
def test_frozen_inputs_get_no_gradient_and_odd_operands_fall_back():
    lib = native.load("pointwise")
    x, w = torch.randn(6, 16, requires_grad=True), torch.ones(16)  # a frozen norm weight
    with backward_kernels(lib):
        y = rms_norm(x, w, 1e-6)
    y.sum().backward()
    assert x.grad is not None and w.grad is None
    a = torch.randn(8, 6, 16)
    assert native.swiglu_backward(lib, a, a.bfloat16(), a) is None  # dtypes differ
    assert native.swiglu_backward(lib, a.transpose(0, 1), a.transpose(0, 1), a.transpose(0, 1)) is None
    assert native.rms_norm_backward(lib, a, torch.ones(16), torch.ones(8, 6, 1, dtype=torch.float64), a) is None
    assert native.rms_norm_backward(lib, a, torch.ones(15), torch.ones(8, 6, 1), a) is None
    assert native.rotary_backward(lib, torch.randn(8, 6, 15), torch.randn(8, 15), torch.randn(8, 15)) is None
    # a non-contiguous incoming gradient is made contiguous, not refused
    dy = torch.randn(16, 6).t()
    out = native.swiglu_backward(lib, torch.randn(6, 16), torch.randn(6, 16), dy)
    assert out is not None and out[0].shape == (6, 16)


def _engine(kernels: str, **kw):
    from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig
    from tandem.models import ModelConfig

    opt = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)
    return FSDPEngine(FSDPConfig(model=ModelConfig(name="tiny-llama"), optimizer=opt, micro_batch_tokens=40,
                                 pointwise_kernels=kernels, **kw))


@needs_native
@pytest.mark.parametrize("checkpointing", [False, True])
def test_engine_trains_the_same_with_either_backward(checkpointing, monkeypatch):
    from tandem.engines.training.fsdp import ParallelConfig
    from tests.engines.training.helpers import GROUPED, engine_grads, make_batch, max_abs_diff, token_mean_pg

    batch = make_batch(GROUPED, shared_prompts=True)
    par = ParallelConfig(activation_checkpointing=checkpointing)
    plain, fast = _engine("torch", parallel=par), _engine("native", parallel=par)
    assert plain._grad_kernels is None and fast._grad_kernels is not None
    calls = {"n": 0}
    kernel = native.swiglu_backward

    def counting(*args):
        calls["n"] += 1
        return kernel(*args)

    monkeypatch.setattr(native, "swiglu_backward", counting)
    grads = {}
    for name, engine in (("torch", plain), ("native", fast)):
        engine._accumulate_gradients(batch, token_mean_pg)
        grads[name] = engine_grads(engine)
    layers = len(fast.policy.module.lm.model.layers)
    micro_batches = len(list(fast._micro_batches(batch, fast._plan(batch, True), True)))
    assert micro_batches > 1
    assert calls["n"] == layers * micro_batches  # every layer's backward ran the kernel (recomputed ones too)
    assert grads["torch"] and max_abs_diff(grads["native"], grads["torch"]) < 1e-5
    ma, mb = plain.train_step(batch, token_mean_pg), fast.train_step(batch, token_mean_pg)
    assert mb["train/grad_norm"] == pytest.approx(ma["train/grad_norm"], rel=1e-5)


def test_deterministic_mode_and_bad_values_keep_the_torch_backward():
    from tandem.engines.training.fsdp import FSDPConfig

    assert _engine("auto", deterministic=True)._grad_kernels is None
    with pytest.raises(ValueError, match="pointwise_kernels='fused' must be 'auto', 'native' or 'torch'"):
        FSDPConfig(pointwise_kernels="fused")
