"""The torch engine on the real SmolLM2-135M-Instruct (slow: the model is 538 MB in float32)."""

from __future__ import annotations

import pytest
import torch

from tandem.models import load_model
from tests.engines.test_torch_engine import hf_greedy
from tests.engines.torch_helpers import STOP, chat_prompts, make_engine, requests, teacher_forced

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is 12 + 7?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Why is the sky blue? Answer briefly.",
]


@pytest.mark.slow
@pytest.mark.ci
def test_smollm2_greedy_matches_hf_generate():
    ps = chat_prompts(MODEL, QUESTIONS[:3])
    hf = load_model(MODEL)
    with make_engine(MODEL, max_num_seqs=4, max_model_len=512) as engine:
        results = engine.generate(requests(ps, temperature=0, max_new_tokens=24, stop_token_ids=(STOP,)))
    for p, res in zip(ps, results, strict=True):
        assert res.completions[0].token_ids == hf_greedy(hf, p, 24)


@pytest.mark.slow
def test_smollm2_sampled_logprobs_match_teacher_forced_forward():
    ps = chat_prompts(MODEL, QUESTIONS)
    with make_engine(MODEL, max_num_seqs=3, max_model_len=512, prefill_chunk=40) as engine:
        results = engine.generate(requests(ps, temperature=0.8, n=2, max_new_tokens=40, seed=3))
        pairs = [(p, c.token_ids) for p, r in zip(ps, results, strict=True) for c in r.completions]
        expected = teacher_forced(engine, pairs, temperature=0.8)
    got = [torch.tensor(c.log_probs) for r in results for c in r.completions]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-4)
