"""Batch-invariant mode: row-count invariant matmuls, length-invariant attention, and exact rollout/train parity."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tandem.models.attention import VarlenAttention
from tandem.ops import InvariantVarlenAttention, batch_invariant_mode, invariant_attention, is_batch_invariant
from tandem.ops.batch_invariant import KEY_TILE, group_queries, packed_attention, padded_rows, ungroup_queries
from tests.engines.torch_helpers import chat_prompts, make_engine, prompts, requests, teacher_forced

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_do_not_depend_on_the_row_count(dtype, bias):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=g).to(dtype)
    b = torch.randn(1536, generator=g).to(dtype) if bias else None
    x = torch.randn(300, 576, generator=g).to(dtype)
    with batch_invariant_mode():
        full = F.linear(x, weight, b)
        for rows in [*range(1, 20), 31, 64, 129]:
            for start in (0, 7, 100):
                assert torch.equal(
                    F.linear(x[start : start + rows], weight, b), full[start : start + rows]
                ), (rows, start)
        # a 3-D input is the same product
        assert torch.equal(F.linear(x[:6].view(2, 3, 576), weight, b).view(6, -1), full[:6])


@pytest.mark.parametrize("path", ["probed", "tiled", "float32"])
def test_a_bfloat16_training_forward_gives_the_rollout_bits_and_gradients(path, monkeypatch):
    """A trainer's bf16 forward under the mode (grad on) equals the engine's (no grad) row for row, on the path
    this CPU's probe picks (`bf16_invariant_path`: oneDNN bf16 as is; in fixed row tiles where its rows depend on
    the row count, AMX) and on the other two where oneDNN runs bf16, and backward runs through it."""
    from tandem.ops import batch_invariant
    from tandem.ops.linear import ONEDNN_BF16

    if path != "probed":
        if not ONEDNN_BF16:
            pytest.skip("no oneDNN bfloat16 on this CPU: bf16 products take F.linear, padded as float32's")
        monkeypatch.setattr(batch_invariant, "_BF16_PATH", [path])
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(576, 1536, generator=g).bfloat16().requires_grad_()
    x = torch.randn(40, 1536, generator=g).bfloat16().requires_grad_()
    with batch_invariant_mode():
        y = F.linear(x, weight)
        with torch.no_grad():
            rows = [F.linear(x[i : i + 1], weight) for i in range(40)]
    assert y.dtype == torch.bfloat16 and torch.equal(torch.cat(rows), y.detach())
    y.float().square().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(x.grad.float()).all() and weight.grad.abs().sum() > 0


def test_padded_rows_rule():
    assert [padded_rows(m) for m in (1, 3, 4, 5, 8, 9, 15, 16, 17, 100)] == [
        4,
        4,
        4,
        8,
        8,
        16,
        16,
        16,
        17,
        100,
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_attention_does_not_depend_on_buffer_length_or_other_rows(dtype):
    g = torch.Generator().manual_seed(1)
    s, hkv, d = 3, 2, 16
    keys = torch.randn(s, hkv, 4 * KEY_TILE, d, generator=g).to(dtype)
    values = torch.randn(s, hkv, 4 * KEY_TILE, d, generator=g).to(dtype)
    q = torch.randn(s, hkv, 40, d, generator=g).to(dtype)
    limits = torch.randint(1, 70, (s, 40), generator=g)
    full = invariant_attention(q, keys, values, limits, 0.25)  # 256-key buffer, 40 rows
    # 128 keys suffice for limits < 70; fewer rows; one sequence of the batch alone
    short = invariant_attention(q[:, :, :5], keys[:, :, :128], values[:, :, :128], limits[:, :5], 0.25)
    single = invariant_attention(
        q[1:2, :, 7:8], keys[1:2, :, : KEY_TILE * 2], values[1:2, :, : KEY_TILE * 2], limits[1:2, 7:8], 0.25
    )
    assert torch.equal(short, full[:, :, :5])
    assert torch.equal(single, full[1:2, :, 7:8])
    # garbage past the limit (a reused KV-cache slot) changes nothing
    dirty_k, dirty_v = keys.clone(), values.clone()
    dirty_k[:, :, 200:] += 7.0
    dirty_v[:, :, 200:] -= 3.0
    assert torch.equal(invariant_attention(q, dirty_k, dirty_v, limits, 0.25), full)
    # and it is attention: compare with a float64 reference
    ref = _reference_attention(q.double(), keys.double(), values.double(), limits, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(full.double(), ref, rtol=0, atol=tol)


def _reference_attention(q, k, v, limits, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = torch.arange(k.shape[2]) < limits[:, :, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v)


def test_invariant_attention_rejects_unaligned_buffers():
    q, k = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 100, 8)
    with pytest.raises(ValueError, match="key length 100 must be a multiple of KEY_TILE=64"):
        invariant_attention(q, k, k, torch.ones(1, 4, dtype=torch.long), 1.0)


def test_group_queries_round_trip():
    q = torch.randn(5, 6, 4)
    grouped = group_queries(q, 2)
    assert grouped.shape == (2, 15, 4)
    assert torch.equal(grouped[1, 3 * 2 + 1], q[2, 1 * 3 + 1])  # kv head 1, position 2, head 1 of the group
    assert torch.equal(ungroup_queries(grouped, 5), q)


def test_invariant_varlen_matches_stock_attention_and_trains():
    torch.manual_seed(0)
    q = torch.randn(30, 4, 16, requires_grad=True)
    k, v = torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    lengths = [7, 20, 3]
    ours = InvariantVarlenAttention.from_lengths(lengths).attend(0, q, k, v, 0.25)
    stock = VarlenAttention.from_lengths(lengths).attend(0, q, k, v, 0.25)
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-5)
    (ours * torch.arange(16.0)).sum().backward()
    grad = q.grad.clone()
    q.grad = None
    (stock * torch.arange(16.0)).sum().backward()
    torch.testing.assert_close(grad, q.grad, rtol=0, atol=1e-5)


def test_mode_is_thread_local_and_reentrant():
    seen = {}
    with batch_invariant_mode():
        with batch_invariant_mode():
            assert is_batch_invariant()
        assert is_batch_invariant()
        assert isinstance(packed_attention(torch.tensor([0, 3])), InvariantVarlenAttention)
        worker = threading.Thread(target=lambda: seen.update(inside=is_batch_invariant()))
        worker.start()
        worker.join()
    assert not is_batch_invariant() and seen["inside"] is False
    assert isinstance(packed_attention(torch.tensor([0, 3])), VarlenAttention)
    with batch_invariant_mode(enabled=False):
        assert not is_batch_invariant()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3-moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_training_forward_equals_engine_logprobs_exactly(name, dtype):
    """The acceptance test of the mode: rollout log-probs == training log-probs, bit for bit.

    The engine decodes a mixed batch (different prompt lengths, chunked prefill, n samples sharing a
    prefill, sequences joining as others finish); a trainer-style packed forward of prompt + response
    under the mode, in another order and with other neighbours, gives the same float32 values.
    """
    ps = prompts([4, 45, 17, 1, 29], seed=3)
    with make_engine(name, dtype=dtype, deterministic=True, max_num_seqs=4, prefill_chunk=24) as engine:
        results = engine.generate(requests(ps, temperature=0.8, n=2, max_new_tokens=18, seed=7))
        pairs = [(p, c.token_ids) for p, r in zip(ps, results, strict=True) for c in r.completions]
        trained = teacher_forced(engine, pairs[::-1], temperature=0.8, invariant=True)[::-1]
        stock = teacher_forced(engine, pairs, temperature=0.8, invariant=False)
    rollout = [torch.tensor(c.log_probs) for r in results for c in r.completions]
    for got, expected in zip(rollout, trained, strict=True):
        assert torch.equal(got, expected)
    # without the mode the two sides disagree (this is what the mode fixes)
    assert any(not torch.equal(a, b) for a, b in zip(rollout, stock, strict=True))


@pytest.mark.slow
def test_smollm2_rollout_equals_training_forward_exactly():
    questions = ["What is 12 + 7?", "Name a colour.", "Write one word about the sea."]
    ps = chat_prompts("smollm2-135m-instruct", questions)
    for dtype in ["float32", "bfloat16"]:
        with make_engine(
            "smollm2-135m-instruct", dtype=dtype, deterministic=True, max_model_len=512
        ) as engine:
            results = engine.generate(requests(ps, temperature=1.0, max_new_tokens=24, seed=1))
            pairs = [(p, r.completions[0].token_ids) for p, r in zip(ps, results, strict=True)]
            trained = teacher_forced(engine, pairs, invariant=True)
        for r, expected in zip(results, trained, strict=True):
            assert torch.equal(torch.tensor(r.completions[0].log_probs), expected), dtype


def test_fast_linear_matches_f_linear_with_gradients_autocast_and_packed_weights():
    from tandem.ops.linear import fast_linear, pack_weights

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 16, generator=g, requires_grad=True)
    layer = torch.nn.Linear(16, 8)
    y, ref = fast_linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-5)
    upstream = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad((y * upstream).sum(), (x, layer.weight, layer.bias))
    expected = torch.autograd.grad((ref * upstream).sum(), (x, layer.weight, layer.bias))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = fast_linear(x, layer.weight, layer.bias)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=5e-2)
    packed = pack_weights(layer)
    with torch.no_grad():
        rows = torch.randn(7, 16, generator=g)
        assert torch.equal(
            fast_linear(rows, layer.weight, layer.bias, packed=packed),
            fast_linear(rows, layer.weight, layer.bias),
        )
