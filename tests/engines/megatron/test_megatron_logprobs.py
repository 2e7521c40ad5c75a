"""The Megatron engine's log-prob head (`head_logprobs`) on one rank against ``log_softmax`` and autograd in
float64; over two vocabulary slices (TP 2, and with a sequence-parallel gather) in test_megatron_dist.py."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.training.megatron.logprobs import head_logprobs
from tandem.models.logprobs import token_logprobs

from .workers import HEAD_VOCAB, head_inputs


def head_reference(hidden, weight, targets, temperature):
    """float64 log-probs and entropy of ``hidden @ weight[:HEAD_VOCAB].T / temperature``, differentiable."""
    z = (hidden.double() @ weight.double()[:HEAD_VOCAB].t()) / temperature
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_matches_log_softmax_and_ignores_padded_rows(temperature):
    hidden, weight, targets, _, _ = head_inputs()  # the padded rows' logits are huge: they must not count
    logp, ent = head_logprobs(hidden, weight, targets, vocab_start=0, vocab_size=HEAD_VOCAB,
                              temperature=temperature, chunk=3, with_entropy=True)
    ref_logp, ref_ent = head_reference(hidden, weight, targets, temperature or 1.0)  # 0: greedy, the plain softmax
    assert logp.dtype == torch.float32 and logp.shape == (7,)
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5


def test_gradients_match_autograd_in_chunks_and_equal_the_fsdp_head():
    hidden, weight, targets, w_logp, w_ent = head_inputs()
    hidden.requires_grad_(), weight.requires_grad_()
    logp, ent = head_logprobs(hidden, weight, targets, vocab_start=0, vocab_size=HEAD_VOCAB, temperature=0.7,
                              chunk=3, with_entropy=True)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = head_reference(hidden, weight, targets, 0.7)
    ((ref_logp * w_logp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    assert (ours[0] - hidden.grad).abs().max() < 1e-5
    assert (ours[1] - weight.grad).abs().max() < 1e-5
    assert not ours[1][HEAD_VOCAB:].any()  # the padded rows get no gradient
    # one TP rank: the FSDP engine's head, bit for bit
    same, _ = token_logprobs(hidden.detach(), weight.detach()[:HEAD_VOCAB], targets, temperature=0.7, chunk_size=3)
    assert torch.equal(logp.detach(), same)


def test_head_refuses_bad_input_by_name():
    h, w, t = torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden \(4, 8\) must be \[M, H\], weight \(10, 8\) .* got \(3,\)"):
        head_logprobs(h, w, t[:3], vocab_start=0, vocab_size=10)
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        head_logprobs(h, w, t, vocab_start=0, vocab_size=10, chunk=0)
    with pytest.raises(ValueError, match="temperature=-0.5 must be >= 0"):
        head_logprobs(h, w, t, vocab_start=0, vocab_size=10, temperature=-0.5)
