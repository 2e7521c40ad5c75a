"""The model registry: tiny random models and the real SmolLM2, without a hub."""

from __future__ import annotations

import pytest
import torch

from tandem.models import ModelNotFoundError, list_models, load_model, load_tokenizer, resolve_model

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-glm4-moe"]


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_loads_and_trains_fast(name):
    model = load_model(name)
    tok = load_tokenizer(name)
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 500_000
    ids = torch.randint(0, len(tok), (2, 32))
    model.train()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_tiny_models_are_deterministic(tmp_path, monkeypatch):
    """A rebuild in a fresh cache gives the same weights bit for bit."""
    a = load_model("tiny-qwen3").state_dict()
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny-qwen3")
    assert str(path).startswith(str(tmp_path))
    b = load_model("tiny-qwen3").state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_tiny_tokenizer_has_chatml_template():
    tok = load_tokenizer("tiny-llama")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok("What is 2 + 3?")["input_ids"]
    assert tok.decode(ids) == "What is 2 + 3?"


def test_local_folder_and_unknown_name(tmp_path):
    folder = resolve_model("tiny-llama")
    assert resolve_model(str(folder)) == folder
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="not a folder holding config.json"):
        resolve_model(str(tmp_path))


def test_registry_lists_required_models():
    assert {"smollm2-135m-instruct", *TINY} <= set(list_models())


@pytest.mark.slow
@pytest.mark.ci
def test_smollm2_loads_and_greedy_generates_text():
    model = load_model("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.tie_word_embeddings) == (
        "llama",
        30,
        576,
        True,
    )
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert text
    assert "Paris" in text
