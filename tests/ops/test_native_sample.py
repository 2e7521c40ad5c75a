"""The native sampling kernel (tandem/ops/csrc/sample.c) against the torch sampler it replaces
(tandem/engines/inference/torch/sampling.py): the same draw for the same uniform numbers, the log-probs up
to rounding, the edge cases of the inverse CDF, and inside the embedded engine."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.inference.torch.sampling import RowSampler, sample_tokens, token_log_probs
from tandem.ops import native

needs_native = pytest.mark.skipif(native.load("sample") is None, reason="no C compiler: the torch path is used")


def _rows(temps, seed=0):
    return [RowSampler(t, 0, 1.0, torch.Generator().manual_seed(seed + i)) for i, t in enumerate(temps)]


@needs_native
@pytest.mark.parametrize("vocab", [49152, 700, 256, 3])
def test_draws_what_the_torch_path_draws(vocab):
    """Same generators, same logits: the same tokens (a uniform number within rounding of a CDF step
    could differ; none does here), log-probs within 1e-5 of the torch path's, greedy rows included."""
    torch.manual_seed(vocab)
    temps = [1.0, 0.7, 0.0, 1.6, 1.0, 0.0, 0.3, 2.0] * 8
    logits = torch.randn(len(temps), vocab) * 3
    want_tok, want_lp = sample_tokens(logits, _rows(temps))
    got_tok, got_lp = sample_tokens(logits, _rows(temps), native.load("sample"))
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    # and the generators moved alike: a second draw from each agrees too
    rows_a, rows_b = _rows(temps, 99), _rows(temps, 99)
    sample_tokens(logits, rows_a)
    sample_tokens(logits, rows_b, native.load("sample"))
    assert [r.generator.get_state().tolist() for r in rows_a] == [r.generator.get_state().tolist() for r in rows_b]


@needs_native
def test_inverse_cdf_edges():
    lib = native.load("sample")
    logits = torch.full((4, 600), -torch.inf)
    logits[:, 300] = 0.0  # one token holds all the mass (block 1 of 3)
    logits[1, 5], logits[2, 599] = 0.0, 0.0
    u = torch.tensor([0.0, 1.0 - 2**-53, 1.0 - 2**-53, 0.5], dtype=torch.float64)
    tok, lp = native.sample(lib, logits, torch.ones(4), u)
    assert tok.tolist() == [300, 300, 599, 300]  # u -> 1 ends at the last token with mass, never past it
    torch.testing.assert_close(lp, torch.tensor([0.0, -0.6931472, -0.6931472, 0.0]), atol=1e-6, rtol=0)
    # no token of zero probability is ever drawn, whatever the uniform number
    many = native.sample(lib, logits[1:2].expand(200, -1).contiguous(), torch.ones(200),
                         torch.linspace(0, 1 - 1e-12, 200, dtype=torch.float64))[0]
    assert set(many.tolist()) == {5, 300}


@needs_native
def test_distribution_matches_softmax():
    """10^5 draws of one row (4 blocks of the inverse CDF) against softmax(logits / T): total variation
    below 0.02 (its expectation here is ~0.008; a wrong block walk or scaling moves it past 0.1)."""
    torch.manual_seed(1)
    logits = torch.randn(1, 1000) * 2
    n = 100_000
    tok, lp = native.sample(native.load("sample"), logits.expand(n, -1).contiguous(), torch.full((n,), 0.8),
                            torch.rand(n, dtype=torch.float64))
    p = torch.softmax(logits[0] / 0.8, -1)
    freq = torch.bincount(tok, minlength=1000).double() / n
    assert 0.5 * (freq - p.double()).abs().sum() < 0.02
    torch.testing.assert_close(lp, token_log_probs(logits.expand(n, -1) / 0.8, tok), atol=1e-5, rtol=0)


@needs_native
def test_rows_with_top_k_or_top_p_keep_the_torch_path():
    torch.manual_seed(0)
    logits = torch.randn(3, 500)
    rows = [RowSampler(1.0, 0, 1.0, torch.Generator().manual_seed(i)) for i in range(3)]
    restricted = [RowSampler(1.0, 20 if i == 1 else 0, 0.9 if i == 2 else 1.0, torch.Generator().manual_seed(i))
                  for i in range(3)]
    again = [RowSampler(r.temperature, r.top_k, r.top_p, torch.Generator().manual_seed(i)) for i, r in enumerate(restricted)]
    assert torch.equal(sample_tokens(logits, restricted, native.load("sample"))[1], sample_tokens(logits, again)[1])
    assert sample_tokens(logits, rows, native.load("sample"))[0].shape == (3,)


@needs_native
def test_refuses_bad_arguments():
    lib = native.load("sample")
    with pytest.raises(ValueError, match="CPU float32"):
        native.sample(lib, torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="need 2 entries"):
        native.sample(lib, torch.zeros(2, 8), torch.ones(3), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be 'auto', 'native' or 'torch'"):
        from tandem.engines.inference.torch.config import TorchEngineConfig

        TorchEngineConfig(sampler="fast")


@needs_native
def test_engine_samples_the_same_with_either_sampler():
    """Temperature 1 with per-request seeds: the same tokens from both samplers, log-probs up to rounding;
    the deterministic mode keeps the torch sampler (its log-probs are the trainer's bits)."""
    from tests.engines.torch_helpers import generate_either_way, make_engine

    results, health = generate_either_way("sampler")
    assert health == {"torch": "torch", "native": "native"}
    for a, b in zip(results["torch"], results["native"], strict=True):
        ca, cb = a.completions[0], b.completions[0]
        assert ca.token_ids == cb.token_ids
        torch.testing.assert_close(torch.tensor(cb.log_probs), torch.tensor(ca.log_probs), atol=1e-4, rtol=0)
    det = make_engine(deterministic=True, sampler="auto")
    assert det.health()["sampler"] == "torch"
    det.close()
