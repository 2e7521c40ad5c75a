"""HF <-> Megatron weight layouts on hand-built tensors (pure torch: runs without megatron-core)."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.training.megatron import convert
from tandem.models import resolve_model
from tandem.models.transformer import UnsupportedModelError

# 4 query heads in 2 groups, head dim 2, hidden 3: small enough to write the expected layout out.
LAYOUT = convert.Layout(
    num_layers=1,
    hidden_size=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    vocab_size=5,
    padded_vocab_size=8,
    tie_word_embeddings=False,
    qkv_bias=True,
)


def _rule(name: str, layout: convert.Layout = LAYOUT) -> convert.Rule:
    return {r.megatron: r for r in convert.rules(layout)}[name]


def test_qkv_is_grouped_query_heads_then_key_then_value():
    # row r of q_proj is query head r // 2, dim r % 2; values encode (tensor, row) so the order is visible
    q = torch.arange(8.0)[:, None].repeat(1, 3) + 100
    k = torch.arange(4.0)[:, None].repeat(1, 3) + 200
    v = torch.arange(4.0)[:, None].repeat(1, 3) + 300
    rule = _rule("decoder.layers.0.self_attention.linear_qkv.weight")
    fused = convert.to_megatron(rule, LAYOUT, dict(zip(rule.hf, (q, k, v), strict=True)))
    # group 0: query heads 0, 1 (rows 0-3), key head 0, value head 0; then group 1
    expected = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert fused[:, 0].tolist() == expected
    # TP 2 hands each rank one whole group
    assert convert.shard(rule, fused, 1, 2)[:, 0].tolist() == expected[8:]
    back = dict(convert.from_megatron(rule, LAYOUT, fused))
    assert (
        torch.equal(back[rule.hf[0]], q)
        and torch.equal(back[rule.hf[1]], k)
        and torch.equal(back[rule.hf[2]], v)
    )
    bias_rule = _rule("decoder.layers.0.self_attention.linear_qkv.bias")
    bias = convert.to_megatron(
        bias_rule, LAYOUT, dict(zip(bias_rule.hf, (q[:, 0], k[:, 0], v[:, 0]), strict=True))
    )
    assert bias.tolist() == expected


def test_gate_up_shards_keep_each_ranks_gate_above_its_up():
    gate, up = torch.arange(4.0)[:, None], torch.arange(4.0)[:, None] + 10
    rule = _rule("decoder.layers.0.mlp.linear_fc1.weight")
    full = convert.to_megatron(rule, LAYOUT, {rule.hf[0]: gate, rule.hf[1]: up})
    assert full[:, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    shards = [convert.shard(rule, full, r, 2) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    assert torch.equal(convert.unshard(rule, shards), full)


def test_row_parallel_splits_columns_and_vocab_is_padded_with_zero_rows():
    proj = _rule("decoder.layers.0.self_attention.linear_proj.weight")
    w = torch.arange(24.0).view(3, 8)
    assert torch.equal(convert.shard(proj, w, 1, 2), w[:, 4:])
    emb = _rule("embedding.word_embeddings.weight")
    table = torch.randn(5, 3)
    padded = convert.to_megatron(emb, LAYOUT, {emb.hf[0]: table})
    assert padded.shape == (8, 3) and torch.equal(padded[:5], table) and not padded[5:].any()
    assert torch.equal(dict(convert.from_megatron(emb, LAYOUT, padded))[emb.hf[0]], table)
    with pytest.raises(ValueError, match="does not split over 3 tensor-parallel ranks"):
        convert.shard(proj, w, 0, 3)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_through_shards_is_bit_identical(name, tp):
    from safetensors.torch import load_file

    from tandem.engines.training.megatron.model import padded_vocab_size, read_args

    path = resolve_model(name)
    hf = load_file(str(next(path.glob("*.safetensors"))))
    args = read_args(path)
    layout = convert.Layout.from_args(args, padded_vocab_size=padded_vocab_size(args.vocab_size, 96, tp))
    shards = [convert.convert_hf_to_megatron(layout, hf, tp_rank=r, tp_size=tp) for r in range(tp)]
    table = {r.megatron: r for r in convert.rules(layout)}
    assert set(shards[0]) == set(table)
    if layout.tie_word_embeddings:
        assert "output_layer.weight" not in table and "lm_head.weight" not in hf
    full = {name: convert.unshard(table[name], [s[name] for s in shards]) for name in table}
    back = dict(convert.export_megatron_to_hf(layout, lambda rule: full[rule.megatron]))
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_names_translate_between_global_and_one_ranks_modules():
    name = "decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight"
    local = convert.localize(name, layer_offset=4, expert_offset=4)
    assert local == "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    assert convert.globalize(local, 4, 4) == name
    assert convert.globalize("embedding.word_embeddings.weight", 4, 4) == "embedding.word_embeddings.weight"


def test_unsupported_layouts_say_why():
    from tandem.engines.training.megatron.model import read_args

    args = read_args(resolve_model("tiny-llama"))
    args.o_bias, args.mlp_bias = True, False
    with pytest.raises(UnsupportedModelError, match="add_bias_linear sets both together"):
        convert.Layout.from_args(args, padded_vocab_size=512)
    with pytest.raises(ValueError, match="padded_vocab_size=4 must be >= vocab_size=5"):
        convert.Layout(
            num_layers=1,
            hidden_size=3,
            num_heads=4,
            num_kv_heads=2,
            head_dim=2,
            vocab_size=5,
            padded_vocab_size=4,
            tie_word_embeddings=True,
        )
    with pytest.raises(ValueError, match="missing"):
        convert.convert_hf_to_megatron(LAYOUT, {})


def test_missing_megatron_core_names_the_install(monkeypatch):
    import sys

    from tandem.engines.training.megatron import MegatronConfig, MegatronEngine
    from tandem.models import ModelConfig

    monkeypatch.setitem(sys.modules, "megatron", None)  # as if megatron-core were not installed
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"pip install 'tandem-rl\[megatron\]'"):
        MegatronEngine(MegatronConfig(model=ModelConfig(name="tiny-qwen3")))
