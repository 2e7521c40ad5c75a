"""Vocab-parallel log-probs and entropy on one rank against plain ``log_softmax`` and autograd."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.training.megatron.logprobs import vocab_parallel_logprobs


def _reference(logits, targets, vocab, temperature):
    z = logits[:, :vocab].double() / temperature
    logp_all = torch.log_softmax(z, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_and_ignores_padded_columns(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 12, generator=g) * 4
    logits[:, 10:] = 50.0  # padded vocabulary columns: huge logits that must not count
    targets = torch.randint(0, 10, (6,), generator=g)
    logp, ent = vocab_parallel_logprobs(
        logits, targets, vocab_start=0, vocab_size=10, temperature=temperature, with_entropy=True
    )
    ref_logp, ref_ent = _reference(logits, targets, 10, temperature)
    assert logp.dtype == torch.float32 and logp.shape == (6,)
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    greedy, _ = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=10, temperature=0.0)
    assert torch.allclose(greedy.double(), _reference(logits, targets, 10, 1.0)[0], atol=1e-5)


def test_gradients_of_log_probs_and_entropy_match_autograd():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 9, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 8, (5,), generator=g)
    w_lp, w_ent = torch.randn(5, generator=g), torch.randn(5, generator=g)
    logp, ent = vocab_parallel_logprobs(
        logits, targets, vocab_start=0, vocab_size=8, temperature=0.8, with_entropy=True
    )
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref_logp, ref_ent = _reference(logits, targets, 8, 0.8)
    ((ref_logp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    assert (ours - logits.grad).abs().max() < 1e-5
    assert not ours[:, 8:].any()  # the padded column gets no gradient


def test_bad_shapes_name_the_shapes():
    with pytest.raises(ValueError, match=r"logits \(4,\) must be \[M, V_local\]"):
        vocab_parallel_logprobs(torch.zeros(4), torch.zeros(4, dtype=torch.long), vocab_start=0, vocab_size=4)
    with pytest.raises(ValueError, match="temperature=-1.0 must be >= 0"):
        vocab_parallel_logprobs(
            torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), vocab_start=0, vocab_size=4, temperature=-1.0
        )
