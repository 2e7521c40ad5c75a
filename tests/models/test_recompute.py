"""`recompute_saved`: the RMSNorm and SwiGLU outputs that linear layers save are kept as how to compute them
again, so a forward keeps fewer bytes for backward, and the gradients are the same bits."""

from __future__ import annotations

import warnings

import pytest
import torch

from tandem.models.attention import VarlenAttention
from tandem.models.lean_ops import rms_norm, swiglu
from tandem.models.recompute import recompute_saved
from tandem.models.tiny import tiny_config
from tandem.models.transformer import CausalLM, TransformerArgs
from tandem.ops import batch_invariant_mode

LENGTHS = [5, 17, 9]


def _model(dtype=torch.float32):
    args = TransformerArgs.from_hf_config(tiny_config("llama", 256))
    torch.manual_seed(0)
    model = CausalLM(args).to(dtype)
    n = sum(LENGTHS)
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(k) for k in LENGTHS])
    return model, ids, positions


def _forward(model, ids, positions, enabled: bool, *, deterministic: bool = False):
    with batch_invariant_mode(deterministic), recompute_saved(enabled):
        # chunks of 7 rows: the vocabulary projection saves views of the final norm's output
        lp, _ = model(ids, positions, VarlenAttention.from_lengths(LENGTHS), targets=ids, logprob_chunk=7)
    return lp


def _kept_bytes(model, ids, positions, enabled: bool, **kw) -> int:
    """Bytes of the tensors alive after a forward (what it keeps for backward), parameters not counted."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            lp = _forward(model, ids, positions, enabled, **kw)
            snapshot = next(iter(tracker.get_tracker_snapshot().values()))
    del lp
    skip = {"Total", "Parameter", "Buffer", "Gradient"}
    return sum(v for k, v in snapshot.items() if str(getattr(k, "value", k)) not in skip)


def _grads(model, ids, positions, enabled: bool, **kw) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lp = _forward(model, ids, positions, enabled, **kw)
    (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_the_same_bits(dtype):
    model, ids, positions = _model(dtype)
    plain, lean = _grads(model, ids, positions, False), _grads(model, ids, positions, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, lean, strict=True))


def test_a_forward_keeps_the_norm_swiglu_and_attention_outputs_less_per_token_and_layer():
    model, ids, positions = _model()
    args, n = model.args, ids.numel()
    plain, lean = _kept_bytes(model, ids, positions, False), _kept_bytes(model, ids, positions, True)
    # two RMSNorm outputs, silu(gate) * up, and the attention output's rows gathered from SDPA's padded output
    per_layer = 2 * args.hidden_size + args.intermediate_size + args.num_heads * args.head_dim
    assert plain - lean == 4 * n * (args.num_layers * per_layer + args.hidden_size)  # + the final norm's


def test_the_deterministic_mode_saves_the_same_and_keeps_its_gradient_bits():
    """Its batch-invariant SiLU is what the recomputation calls: the same bits outside the mode."""
    model, ids, positions = _model()
    args, n = model.args, ids.numel()
    plain = _kept_bytes(model, ids, positions, False, deterministic=True)
    lean = _kept_bytes(model, ids, positions, True, deterministic=True)
    # the norms and SwiGLU (the invariant attention context of a deterministic trainer is not used here)
    per_layer = 2 * args.hidden_size + args.intermediate_size + args.num_heads * args.head_dim
    assert plain - lean == 4 * n * (args.num_layers * per_layer + args.hidden_size)
    a = _grads(model, ids, positions, False, deterministic=True)
    b = _grads(model, ids, positions, True, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_another_function_mode_keeps_its_tensors():
    from torch.overrides import TorchFunctionMode

    class Scaling(TorchFunctionMode):  # changes what an op computes: a recomputation outside it would not agree
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.nn.functional.silu else out

    model, ids, positions = _model()
    with Scaling():
        kept = [_kept_bytes(model, ids, positions, on) for on in (False, True)]
        grads = [_grads(model, ids, positions, on) for on in (False, True)]
    assert kept[0] == kept[1]
    assert all(torch.equal(x, y) for x, y in zip(*grads, strict=True))


def test_an_output_changed_in_place_is_saved_as_it_is():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(8, generator=g, requires_grad=True)
    lin = torch.randn(8, 3, generator=g, requires_grad=True)
    a, b = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(6, 8, generator=g, requires_grad=True)

    def loss(enabled: bool):
        with recompute_saved(enabled):
            y = rms_norm(x, w, 1e-6)
            y.mul_(3.0)  # after its maker: a recomputation would give the values before this
            z = swiglu(a, b) + 0.0  # a new tensor: nothing to recompute
            out = (y @ lin).square().sum() + (z @ lin[:, :1].expand(8, 8)).sum()
        return torch.autograd.grad(out, [x, w, lin, a, b])

    assert all(torch.equal(p, q) for p, q in zip(loss(False), loss(True), strict=True))


def test_backward_after_the_block_and_a_retained_graph_twice():
    model, ids, positions = _model()
    lp = _forward(model, ids, positions, True)
    first = torch.autograd.grad(lp.sum(), list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(lp.sum(), list(model.parameters()))
    ref = torch.autograd.grad(_forward(model, ids, positions, False).sum(), list(model.parameters()))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ref, first, second, strict=True))


def test_disabled_is_a_no_op_and_nesting_restores_the_outer_block():
    from tandem.models import recompute

    with recompute_saved(False):
        assert getattr(recompute._state, "registry", None) is None
    with recompute_saved():
        outer = recompute._state.registry
        with recompute_saved():
            assert recompute._state.registry is not outer
        assert recompute._state.registry is outer
    assert recompute._state.registry is None


@pytest.mark.parametrize("setting", ["plain", "lora", "checkpointing"])
def test_the_fsdp_engine_steps_to_the_same_gradients_with_it_on_and_off(setting, monkeypatch):
    from tandem.engines.training.fsdp import (
        FSDPConfig,
        FSDPEngine,
        LoRAConfig,
        OptimizerConfig,
        ParallelConfig,
    )
    from tandem.models import ModelConfig, recompute
    from tests.engines.training.helpers import GROUPED, engine_grads, make_batch, token_mean_pg

    recomputed = []
    unpack = recompute._Saved.unpack
    monkeypatch.setattr(recompute._Saved, "unpack", lambda self: recomputed.append(1) or unpack(self))
    batch = make_batch(GROUPED, shared_prompts=True)
    grads = []
    for on in (False, True):
        engine = FSDPEngine(FSDPConfig(
            model=ModelConfig(name="tiny-llama"), optimizer=OptimizerConfig(lr=1e-3), micro_batch_tokens=40,
            recompute_pointwise=on, parallel=ParallelConfig(activation_checkpointing=setting == "checkpointing"),
            lora=LoRAConfig(rank=4, target_modules=("q_proj", "v_proj", "down_proj")) if setting == "lora" else None,
        ))
        assert engine._recompute is on
        engine._accumulate_gradients(batch, token_mean_pg)
        grads.append(engine_grads(engine))
        # the engine's forward stood recomputations in, only when on; checkpointed layers keep nothing inside
        # (their saved-tensor hooks are the innermost) and the final norm's response rows are a gathered copy
        assert bool(recomputed) is (on and setting != "checkpointing")
        recomputed.clear()
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_the_peak_through_backward_is_lower_too():
    """Recomputed values live only while their readers run backward: the step's peak falls with the forward's."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, ids, positions = _model()
    peaks = {}
    for on in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                _forward(model, ids, positions, on).sum().backward()
                peaks[on] = next(iter(tracker.get_tracker_snapshot("peak").values()))
        model.zero_grad(set_to_none=True)
    activations = {on: sum(v for k, v in p.items() if str(getattr(k, "value", k)) in ("Activation", "Temp"))
                   for on, p in peaks.items()}
    assert activations[True] < 0.85 * activations[False], activations
    total = {on: sum(v for k, v in p.items() if str(getattr(k, "value", k)) == "Total") for on, p in peaks.items()}
    assert total[True] < total[False], total  # gradients included: the peak moves, it does not grow


def test_only_outputs_that_are_their_whole_storage_are_taken():
    from tandem.models import recompute

    x = torch.randn(4, 6, requires_grad=True)
    lin = torch.randn(3, 2, requires_grad=True)
    with recompute_saved():
        big = x * 2.0
        part = big[:, :3]  # a slice of a larger storage: a view of other data could be saved at its address
        recompute.offer(part, lambda t: t[:, :3] * 2.0, x)
        assert not recompute._state.registry
        whole = x * 3.0
        recompute.offer(whole, lambda t: t * 3.0, x)
        assert len(recompute._state.registry) == 1
        (big[:, 3:] @ lin).sum().backward()
    assert torch.equal(lin.grad, big[:, 3:].detach().sum(0)[:, None].expand(3, 2))


@pytest.mark.parametrize("case", ["saved result", "maker input"])
def test_an_in_place_change_of_what_backward_needs_still_raises(case):
    """Autograd skips its in-place check on tensors its saved-tensor hooks handle: the block makes it itself, for a
    tensor kept as it is (exp's result) and for an input an offered output is computed again from."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True)
    lin = torch.randn(8, 3, generator=g, requires_grad=True)
    with recompute_saved():
        if case == "saved result":
            h = x.exp()
            loss = h.sum()
            h.mul_(2.0)
        else:
            x2 = x * 1.0
            loss = (rms_norm(x2, w, 1e-6) @ lin).square().sum()
            x2.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, [x])


def test_inference_mode_and_wrapper_subclasses_inside_the_block():
    """An inference-mode forward offers nothing (its tensors have no version), and a wrapper tensor subclass saved
    in the block is kept as it is (its storage is not its data)."""
    from torch.testing._internal.two_tensor import TwoTensor

    q = torch.randn(5, 2, 4)
    with recompute_saved(), torch.inference_mode():
        out = VarlenAttention.from_lengths([2, 3]).attend(0, q, q, q, 0.5)
    assert out.shape == (5, 2, 4) and torch.isfinite(out).all()
    a = torch.randn(3)
    t = TwoTensor(a.clone(), a.clone()).requires_grad_()
    with recompute_saved():
        y = (t * t).sum()
    y.backward()
    assert torch.equal(t.grad.a, 2 * a)
