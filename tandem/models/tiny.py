"""Tiny random models for tests: real HF architectures, a few hundred thousand parameters.

Each is built from a config with a fixed seed (the same weights on every machine and every run) and
shares a tiny byte-level BPE tokenizer trained in-process on a fixed synthetic corpus, with the
ChatML chat template of SmolLM2 (special tokens at the same ids: 0 ``<|endoftext|>``,
1 ``<|im_start|>``, 2 ``<|im_end|>``). A forward/backward takes milliseconds.

Weights are initialised with a larger standard deviation than HF's default (0.02) so that the next
token distribution is peaked: greedy decoding then has clear margins and does not flip on
floating-point noise between two correct implementations.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it you that he was for on are with as I his they be at one have this from or had "
    "by word but what some we can out other were all there when up use your how said each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think say help low line "
    "answer question plus minus times equals sum total tool call result user assistant system calculator"
).split()


def _corpus(seed: int = 0, n: int = 3000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(
            f"What is {a} {op} {b}? {words.capitalize()}. <answer>{rng.randint(-999, 9999)}</answer>"
        )
        lines.append(f'{{"name": "calculator", "arguments": {{"expression": "{a} {op} {b}"}}}}')
    return lines


def build_tokenizer(out_dir: Path) -> None:
    """Train the tiny tokenizer (deterministic: fixed corpus) and save it as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=1024,
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(str(out_dir))


def _common(vocab: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_theta=10000.0,
    )


def tiny_config(family: str, vocab: int):
    """The HF config of tiny model ``family`` (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``,
    ``glm4_moe``; the last two have no native implementation and run on the HF model)."""
    from transformers import AutoConfig

    kw = _common(vocab)
    if family == "llama":
        kw.update(tie_word_embeddings=True, head_dim=16)
    elif family == "qwen2":
        kw.update(tie_word_embeddings=False)
    elif family == "qwen3":
        kw.update(tie_word_embeddings=False, head_dim=16)
    elif family == "qwen3_moe":
        kw.update(
            tie_word_embeddings=False,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    elif (
        family == "deepseek_v3"
    ):  # MLA attention, sigmoid group-limited routing, a shared expert, 1 dense layer
        kw.update(
            tie_word_embeddings=False,
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            norm_topk_prob=True,
        )
    elif family == "glm4_moe":  # GLM-4.5(-Air): partial rotary, q/k/v bias, shared expert, 1 dense layer
        kw.update(
            tie_word_embeddings=False,
            num_hidden_layers=3,
            head_dim=16,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=False,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            norm_topk_prob=True,
        )
    else:
        raise ValueError(f"unknown tiny model family {family!r}")
    return AutoConfig.for_model(family, **kw)


def build_tiny_model(family: str, out_dir: Path, *, seed: int = 0) -> None:
    """Build tiny model ``family`` with fixed-seed weights and save it (fp32 safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    config = tiny_config(family, len(tok))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 2
    model.generation_config.eos_token_id = 2
    model.save_pretrained(str(out_dir))
