"""The native decode-attention kernel (tandem/ops/csrc/decode_attention.c): its build, its fallback, and
its results against the torch path it replaces, alone and inside the embedded engine."""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.engines.inference.torch.kv_cache import _masked_attention, _small_chunk_attention
from tandem.ops import native

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler: the torch path is used")


def _case(s, hkv, g, d, slot_len, length, dtype, seed=0):
    """A cache of ``s + 2`` slots; decode rows in slots 1 .. s (keys ``< limit``); the torch path's view."""
    gen = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(s + 2, hkv, slot_len, d, generator=gen).to(dtype)
    cache_v = torch.randn(s + 2, hkv, slot_len, d, generator=gen).to(dtype)
    q = torch.randn(s, hkv, g, d, generator=gen).to(dtype)
    limit = torch.randint(1, length + 1, (s,), generator=gen)
    limit[0] = length
    return q, cache_k, cache_v, torch.arange(1, s + 1), limit


def _view(cache, s, length):  # the strided view of slots 1 .. s the torch path reads
    return cache[1 : s + 1, :, :length]


# a build: (-march=, macros, the pair kernel's vector bits it must report; None: this CPU's)
_BUILDS = {"native": ("native", (), None), "x86-64-v3": ("x86-64-v3", (), 256),
           "portable": ("native", ("TANDEM_PORTABLE_ATTENTION",), 0)}


@pytest.fixture(params=list(_BUILDS))
def lib(request):
    """The kernel of this CPU, its AVX2 build (on x86) and its portable loop: each code path of
    csrc/decode_attention.c runs on whichever CPU CI lands on (AVX-512: pair16; AVX2: pair8; the loop of
    CPUs with neither)."""
    if request.param == "native":
        return native.load()
    march, defines, bits = _BUILDS[request.param]
    try:
        built = native.load_variant("decode_attention", march, defines)
    except native.NativeKernelError as e:
        pytest.skip(f"no {request.param} build here: {e}")
    assert built.tandem_decode_attention_vector_bits() == bits
    return built


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("s,hkv,g,d,length", [(5, 3, 3, 64, 82), (1, 1, 1, 32, 1), (7, 2, 8, 128, 300), (4, 4, 1, 16, 9),
                                             (2, 2, 2, 48, 40), (3, 1, 16, 80, 130), (2, 1, 3, 256, 33),
                                             (2, 2, 2, 40, 17)])  # head dims off the specialised 64 / 128
def test_matches_the_torch_path(lib, dtype, tol, s, hkv, g, d, length):
    q, cache_k, cache_v, slots, limit = _case(s, hkv, g, d, 512, length, dtype)
    scale = d**-0.5
    want = _masked_attention(q, _view(cache_k, s, length), _view(cache_v, s, length), limit, scale)
    got = native.decode_attention(lib, q, cache_k, cache_v, slots, limit, scale)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # rows in any order of slots (decode rows are not always the slot order): the same per row
    perm = torch.randperm(s)
    got_perm = native.decode_attention(lib, q[perm], cache_k, cache_v, slots[perm], limit[perm], scale)
    assert torch.equal(got_perm, got[perm])


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 5), (37, 5), (100, 16)])
def test_chunk_rows_match_the_small_chunk_path(lib, dtype, tol, start, n):
    """A short chunk (a speculative verification, a sibling's last prompt token) as rows of one slot with
    causal limits ``start + i + 1`` equals `_small_chunk_attention`."""
    hkv, g, d = 3, 3, 64
    gen = torch.Generator().manual_seed(start + n)
    cache_k = torch.randn(4, hkv, 256, d, generator=gen).to(dtype)
    cache_v = torch.randn(4, hkv, 256, d, generator=gen).to(dtype)
    q = torch.randn(n, hkv * g, d, generator=gen).to(dtype)
    end = start + n
    want = _small_chunk_attention(q, cache_k[2, :, :end], cache_v[2, :, :end], start, d**-0.5)
    got = native.decode_attention(lib, q.view(n, hkv, g, d), cache_k, cache_v, torch.full((n,), 2),
                                  torch.arange(start + 1, end + 1), d**-0.5)
    torch.testing.assert_close(got.view(n, hkv * g, d).float(), want.float(), atol=tol, rtol=tol)


@needs_native
def test_each_row_sees_only_its_keys():
    """Keys past a row's limit do not matter: poisoning them changes nothing (NaN would spread)."""
    q, cache_k, cache_v, slots, limit = _case(6, 2, 3, 64, 128, 100, torch.float32, seed=1)
    lib = native.load()
    before = native.decode_attention(lib, q, cache_k, cache_v, slots, limit, 0.125)
    for s, n in zip(slots.tolist(), limit.tolist(), strict=True):
        cache_k[s, :, n:] = float("nan")
        cache_v[s, :, n:] = float("inf")
    cache_k[0], cache_v[-1] = float("nan"), float("nan")  # slots no row reads
    after = native.decode_attention(lib, q, cache_k, cache_v, slots, limit, 0.125)
    assert torch.equal(before, after) and torch.isfinite(after).all()


@needs_native
def test_rows_are_independent_of_the_batch():
    """A row's result is the same bits alone or among others (each (sequence, head) is its own loop)."""
    q, cache_k, cache_v, slots, limit = _case(8, 3, 3, 64, 256, 200, torch.float32, seed=2)
    lib = native.load()
    batch = native.decode_attention(lib, q, cache_k, cache_v, slots, limit, 0.125)
    for s in (0, 5):
        one = slice(s, s + 1)
        alone = native.decode_attention(lib, q[one], cache_k, cache_v, slots[one], limit[one], 0.125)
        assert torch.equal(alone[0], batch[s])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_each_rows_key_and_value_before_any_row_reads(dtype):
    """``new_k, new_v``: three decode rows (slots 1-3) and a 5-row chunk of slot 5 (row i sees the keys of rows
    < i of its own chunk) give the bits of writing the rows with index_copy_ first and reading after, and
    leave the cache as that write does; nothing else in the cache changes."""
    hkv, g, d, slot_len = 3, 3, 64, 96
    gen = torch.Generator().manual_seed(7)
    cache_k = torch.randn(6, hkv, slot_len, d, generator=gen).to(dtype)
    cache_v = torch.randn(6, hkv, slot_len, d, generator=gen).to(dtype)
    slots = torch.tensor([1, 2, 3, 5, 5, 5, 5, 5])
    positions = torch.tensor([40, 7, 90, 20, 21, 22, 23, 24])
    q = torch.randn(8, hkv, g, d, generator=gen).to(dtype)
    k, v = (torch.randn(8, hkv, d, generator=gen).to(dtype) for _ in range(2))
    for s, p in zip(slots.tolist(), positions.tolist(), strict=True):  # stale keys where the rows go
        cache_k[s, :, p], cache_v[s, :, p] = float("nan"), float("nan")
    want_k, want_v = cache_k.clone(), cache_v.clone()
    rows = ((slots * hkv * slot_len + positions)[:, None] + torch.arange(hkv) * slot_len).reshape(-1)
    want_k.view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
    want_v.view(-1, d).index_copy_(0, rows, v.reshape(-1, d))
    lib = native.load()
    want = native.decode_attention(lib, q, want_k, want_v, slots, positions + 1, d**-0.5)
    got = native.decode_attention(lib, q, cache_k, cache_v, slots, positions + 1, d**-0.5, new_k=k, new_v=v)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
    assert torch.equal(got, want) and torch.isfinite(got).all()


@needs_native
def test_refuses_new_rows_of_the_wrong_shape_or_dtype():
    q, cache_k, cache_v, slots, limit = _case(2, 1, 1, 16, 16, 4, torch.float32)
    lib = native.load()
    good = torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="come together"):
        native.decode_attention(lib, q, cache_k, cache_v, slots, limit, 1.0, new_k=good)
    with pytest.raises(ValueError, match=r"must be \[2, 1, 16\] in torch.float32, got \(2, 1, 8\)"):
        native.decode_attention(lib, q, cache_k, cache_v, slots, limit, 1.0, new_k=good[..., :8], new_v=good)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        native.decode_attention(lib, q, cache_k, cache_v, slots, limit, 1.0, new_k=good.bfloat16(), new_v=good)


def test_shapes_over_the_limits_use_the_torch_path():
    cpu = torch.device("cpu")
    assert not native.supports(17, 64, torch.float32, cpu)  # a group of 17 query heads per key head
    assert not native.supports(2, 512, torch.float32, cpu)
    assert not native.supports(2, 64, torch.float16, cpu)
    assert not native.supports(2, 64, torch.float32, torch.device("meta"))
    assert native.supports(3, 64, torch.float32, cpu) and native.supports(8, 128, torch.bfloat16, cpu)


@needs_native
def test_refuses_bad_arguments():
    q, cache_k, cache_v, slots, limit = _case(2, 1, 1, 8, 16, 4, torch.float32)
    lib = native.load()
    with pytest.raises(ValueError, match="contiguous last dimension"):
        native.decode_attention(lib, q, cache_k.transpose(-1, -2), cache_v, slots, limit, 1.0)
    with pytest.raises(ValueError, match="max_len=17 exceeds the 16 cached positions"):
        native.decode_attention(lib, q, cache_k, cache_v, slots, torch.tensor([4, 17]), 1.0)
    with pytest.raises(ValueError, match="int64 with 2 entries"):
        native.decode_attention(lib, q, cache_k, cache_v, slots.int(), limit, 1.0)


@needs_native
def test_loading_leaves_the_process_float_state_alone():
    """Linking with -ffast-math would add crtfastmath.o, which sets flush-to-zero and denormals-are-zero
    for the whole process when the library loads: subnormal numbers would become 0 in torch and numpy."""
    import subprocess
    import sys

    code = ("from tandem.ops import native; assert native.load() is not None; x = float('5e-324'); "
            "import torch; t = torch.tensor([1e-40]); print(x * 1.0 > 0, bool((t * 1.0 > 0).all()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


@needs_native
def test_builds_into_the_cache_once(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert native.load() is not None
    built = list((tmp_path / "kernels").glob("libdecode_attention-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob(".*"))  # no temporary left
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_libs", {})
    assert native.load() is not None  # a new process would find it: no rebuild
    assert built[0].stat().st_mtime_ns == mtime


def test_a_broken_compiler_falls_back_or_fails_clearly(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: no such luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="tandem.ops.native"):
        assert native.load() is None  # auto: the torch path, with the reason logged
    assert "using the torch path" in caplog.text and "no such luck" in caplog.text
    with pytest.raises(native.NativeKernelError, match="no such luck"):
        native.load(required=True)  # asked for explicitly: the reason, not a silent fallback


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setenv("TANDEM_NATIVE_KERNELS", "0")
    assert native.load() is None
    with pytest.raises(native.NativeKernelError, match="TANDEM_NATIVE_KERNELS=0"):
        native.load(required=True)


def test_engine_config_refuses_an_unknown_choice():
    from tandem.engines.inference.torch.config import TorchEngineConfig

    with pytest.raises(ValueError, match="decode_attention='fast'"):
        TorchEngineConfig(decode_attention="fast")


@needs_native
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_engine_decodes_the_same_with_either_attention(dtype, tol):
    """Greedy decoding with native and torch decode attention: the same tokens in fp32, and the same
    log-probs up to float rounding (bf16: up to the first token where rounding flips a near tie)."""
    from tests.engines.torch_helpers import make_engine, prompts, requests

    batch = prompts([5, 3, 9, 1, 17, 4], seed=3)
    results, health = {}, {}
    for mode in ("torch", "native"):
        engine = make_engine("tiny-qwen3", dtype=dtype, decode_attention=mode)
        health[mode] = engine.health()["decode_attention"]
        results[mode] = engine.generate(requests(batch, temperature=0.0, max_new_tokens=40, seed=0))
        engine.close()
    assert health == {"torch": "torch", "native": "native"}
    for a, b in zip(results["torch"], results["native"], strict=True):
        ca, cb = a.completions[0], b.completions[0]
        if dtype == "float32":
            assert ca.token_ids == cb.token_ids
        pairs = zip(ca.token_ids, cb.token_ids, strict=False)  # bf16 may diverge (and then end) at a tie
        n = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(ca.token_ids), len(cb.token_ids)))
        assert n > 0
        torch.testing.assert_close(torch.tensor(cb.log_probs[:n]), torch.tensor(ca.log_probs[:n]), atol=tol, rtol=0)


def test_deterministic_engine_keeps_its_invariant_attention():
    from tests.engines.torch_helpers import make_engine

    engine = make_engine(deterministic=True, decode_attention="auto")
    assert engine.health()["decode_attention"] == "torch"  # the batch-invariant kernel, never replaced
    engine.close()
