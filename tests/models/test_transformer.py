"""The native model implementation matches HF, packs sequences, computes chunked log-probs and routes MoE."""

from __future__ import annotations

import pytest
import torch

from tandem.models import load_model, resolve_model
from tandem.models.attention import MoERouting, VarlenAttention
from tandem.models.logprobs import logprobs_from_hidden, logsumexp_, token_logprobs
from tandem.models.transformer import CausalLM, TransformerArgs, UnsupportedModelError

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]


def _packed(ids_rows):
    flat = torch.cat(ids_rows)
    pos = torch.cat([torch.arange(len(r)) for r in ids_rows])
    return flat, pos, VarlenAttention.from_lengths([len(r) for r in ids_rows])


@pytest.mark.parametrize("name", TINY)
def test_logits_match_hf_padded_and_packed(name, monkeypatch):
    import tandem.models.attention as attention

    hf = load_model(name)
    nat = CausalLM.from_pretrained(resolve_model(name))
    ids = torch.randint(0, hf.config.vocab_size, (3, 24))
    lengths = [7, 24, 13]
    with torch.no_grad():
        ref = hf(ids).logits
        flat, pos, ctx = _packed([ids[i, :n] for i, n in enumerate(lengths)])
        bucketed = nat.logits(nat(flat, pos, ctx))  # by default: 7 and 13 padded to 13, 24 alone
        monkeypatch.setattr(attention, "MAX_PADDED_CALLS", 1)  # one call padded to 24, as HF's batch
        flat, pos, ctx = _packed([ids[i, :n] for i, n in enumerate(lengths)])
        got = nat.logits(nat(flat, pos, ctx))
    assert len(ctx.calls) == 1
    tol = 0.0 if name != "tiny-qwen3-moe" else 1e-5  # HF's MoE sums in another order
    offset = 0
    for i, n in enumerate(lengths):
        diff = (got[offset : offset + n] - ref[i, :n]).abs().max().item()
        assert diff <= tol, (name, i, diff)
        offset += n
    torch.testing.assert_close(bucketed, got, rtol=0, atol=1e-4)  # another padding, another float order


def test_weights_round_trip_through_hf_folder(tmp_path):
    nat = CausalLM.from_pretrained(resolve_model("tiny-qwen3"))
    nat.save_pretrained(tmp_path)
    hf = load_model(str(tmp_path))
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        a = hf(ids).logits[0]
        b = nat.logits(nat(ids[0], torch.arange(16), VarlenAttention.from_lengths([16])))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # tied embeddings stay tied after loading
    llama = CausalLM.from_pretrained(resolve_model("tiny-llama"))
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    assert "lm_head.weight" not in llama.hf_state_dict()


def test_unsupported_architecture_is_named():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2")
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' has no native implementation"):
        TransformerArgs.from_hf_config(cfg)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_logprobs_values_and_grads(temperature, with_entropy):
    torch.manual_seed(1)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    g1, g2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    logits = hidden @ weight.t() / temperature
    logp_all = torch.log_softmax(logits, -1)
    ref_lp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ref_obj = (ref_lp * g1).sum() + ((ref_ent * g2).sum() if with_entropy else 0)
    ref_gh, ref_gw = torch.autograd.grad(ref_obj, (hidden, weight))

    lp, ent = token_logprobs(
        hidden, weight, targets, temperature=temperature, chunk_size=8, with_entropy=with_entropy
    )
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    obj = (lp.double() * g1).sum()
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        obj = obj + (ent.double() * g2).sum()
    else:
        assert ent is None
    gh, gw = torch.autograd.grad(obj, (hidden, weight))
    torch.testing.assert_close(gh, ref_gh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (37, 49152), (64, 151936), (5, 7), (33, 1000)])
def test_in_place_logsumexp_gives_torch_bits(rows, vocab):
    """The log-prob head computes logsumexp in its logits buffer (one [n, V] temporary fewer); the engine's
    sampler uses torch.logsumexp: both must give the same bits, or the exact contract breaks."""
    torch.manual_seed(rows)
    for scale in (0.01, 1.0, 30.0):
        z = torch.randn(rows, vocab) * scale
        assert torch.equal(logsumexp_(z.clone()), torch.logsumexp(z, dim=-1))
    z = torch.full((2, 4), float("-inf"))
    z[1] = torch.tensor([0.0, float("inf"), 1.0, 2.0])
    assert torch.equal(logsumexp_(z.clone()), torch.logsumexp(z, dim=-1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunk_stats_bits_match_the_plain_formula(temperature):
    """log p, entropy and logsumexp of a chunk: bit for bit what the out-of-place formula gives."""
    torch.manual_seed(3)
    hidden, weight = torch.randn(40, 64), torch.randn(3000, 64) * 0.3
    targets = torch.randint(0, 3000, (40,))
    z = torch.nn.functional.linear(hidden, weight) / temperature
    lse = torch.logsumexp(z, dim=-1)
    ref_lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    logp_all = z - lse[:, None]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    lp, ent = token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=16, with_entropy=True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    assert torch.equal(logprobs_from_hidden(hidden, weight, targets, temperature), ref_lp)


def test_forward_with_targets_trains_and_matches_full_logits():
    nat = CausalLM.from_pretrained(resolve_model("tiny-llama"))
    ids = torch.randint(0, 512, (30,))
    flat, pos, ctx = _packed([ids[:12], ids[12:]])
    targets = torch.roll(flat, -1)
    lp, _ = nat(flat, pos, ctx, targets=targets, logprob_chunk=7)
    with torch.no_grad():
        full = torch.log_softmax(nat.logits(nat(flat, pos, ctx)), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.detach(), full, rtol=1e-6, atol=1e-5)  # chunks change matmul row counts
    (-lp.mean()).backward()
    assert nat.model.embed_tokens.weight.grad is not None
    assert nat.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_moe_routing_record_and_replay():
    nat = CausalLM.from_pretrained(resolve_model("tiny-qwen3-moe"))
    layers = nat.args.moe_layers
    ids = torch.randint(0, 512, (20,))
    flat, pos, ctx = _packed([ids[:9], ids[9:]])
    rec = MoERouting(layers)
    with torch.no_grad():
        base = nat(flat, pos, ctx, rec)
    routes = rec.recorded()
    assert routes.shape == (20, len(layers), 2) and routes.dtype == torch.int32
    # Replaying the model's own routing reproduces the forward exactly.
    same = MoERouting(layers, replay=routes)
    with torch.no_grad():
        again = nat(flat, pos, ctx, same)
    assert torch.equal(base, again) and same.mismatch_fraction() == 0.0
    # Replaying a different routing changes the output, is counted, and gradients reach the router.
    other = (routes + 1) % nat.args.num_experts
    diff = MoERouting(layers, replay=other)
    out = nat(flat, pos, ctx, diff)
    assert not torch.allclose(out, base)
    assert diff.mismatch_fraction() == 1.0
    out.sum().backward()
    assert nat.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_routing_replay_shape_is_checked():
    with pytest.raises(ValueError, match="routing replay has 3 MoE layers, the model has 2"):
        MoERouting([0, 1], replay=torch.zeros(4, 3, 2, dtype=torch.int32))


@pytest.mark.slow
@pytest.mark.ci
def test_smollm2_native_matches_hf():
    hf = load_model("smollm2-135m-instruct")
    nat = CausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"))
    ids = torch.randint(0, 49152, (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        flat, pos, ctx = _packed([ids[0], ids[1, :25]])
        got = nat.logits(nat(flat, pos, ctx))
    torch.testing.assert_close(got[:40], ref[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[40:], ref[1, :25], rtol=0, atol=1e-4)


def _tied_peak_grad_bytes(model, flat, pos, ctx, targets, use_slot: bool) -> tuple[int, torch.Tensor]:
    """Peak bytes of gradient/temporary tensors during backward (torch's MemTracker), and the tied grad."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        if use_slot:
            lp, _ = model(flat, pos, ctx, targets=targets, logprob_chunk=8)
        else:  # the same math without the slot: hidden states, then the chunked projection
            lp, _ = token_logprobs(model(flat, pos, ctx), model.lm_head.weight, targets, chunk_size=8)
        (-lp.sum()).backward()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    grads = sum(int(v) for k, v in snap.items() if str(getattr(k, "value", k)) in ("Gradient", "Temp"))
    return grads, model.model.embed_tokens.weight.grad.clone()


def test_tied_embedding_gradient_is_built_in_one_buffer():
    """SmolLM2's embedding is its output projection: the backward must not hold the projection's dense
    gradient, the embedding's dense gradient and their sum at once (3 x 108 MiB there), and the gradient
    must be the same as autograd's."""
    import dataclasses

    base = CausalLM.from_pretrained(resolve_model("tiny-llama")).args
    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(base, vocab_size=8192, num_layers=1))
    assert model.args.tie_word_embeddings
    assert model.tied_grad_slot() is not None
    ids = torch.randint(0, 8192, (40,))
    flat, pos, ctx = _packed([ids[:25], ids[25:]])
    targets = torch.roll(flat, -1)
    plain_bytes, plain_grad = _tied_peak_grad_bytes(model, flat, pos, ctx, targets, use_slot=False)
    slot_bytes, slot_grad = _tied_peak_grad_bytes(model, flat, pos, ctx, targets, use_slot=True)
    torch.testing.assert_close(slot_grad, plain_grad, rtol=0, atol=1e-6)
    weight_bytes = 8192 * 64 * 4
    assert plain_bytes >= 2.5 * weight_bytes  # autograd: projection grad + embedding grad + their sum
    assert slot_bytes <= plain_bytes - weight_bytes, (slot_bytes / weight_bytes, plain_bytes / weight_bytes)
    with torch.no_grad():
        assert model.tied_grad_slot() is None  # no gradient, no slot
    model.model.embed_tokens.weight.requires_grad_(False)
    assert model.tied_grad_slot() is None


def test_loading_skips_initialising_meta_tensors_only():
    """`from_pretrained` builds the model on the meta device without running its initialisers there (a
    meta `normal_` imports torch._dynamo, ~1 s in every engine process); real tensors still initialise."""
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from tandem.models import resolve_model\n"
        "from tandem.models.transformer import CausalLM\n"
        "m = CausalLM.from_pretrained(resolve_model('tiny-qwen3'))\n"
        "assert not any(p.is_meta for p in m.parameters()) and not any(b.is_meta for b in m.buffers())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]

    from tandem.models.transformer import _SkipInitOnMeta

    with _SkipInitOnMeta():
        torch.manual_seed(0)
        real = torch.nn.Linear(16, 16)
        emb = torch.nn.Embedding(8, 4)
        with torch.device("meta"):
            skipped = torch.nn.Linear(16, 16)
    torch.manual_seed(0)
    assert torch.equal(real.weight, torch.nn.Linear(16, 16).weight) and emb.weight.std() > 0.5
    assert skipped.weight.is_meta
