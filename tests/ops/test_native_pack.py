"""In-place packing of linear weights (tandem/ops/csrc/pack.c through tandem/ops/linear.py): the bytes oneDNN's
own reorder writes, into the existing packed tensor, and a weight sync into a packing engine that uses it."""

from __future__ import annotations

import pytest
import torch

from tandem.ops import linear, native
from tandem.ops.linear import CAN_PACK, ONEDNN_BF16, copy_and_repack, pack_into, pack_weight, repack
from tests.engines.torch_helpers import AMX_BF16

needs_native = pytest.mark.skipif(not CAN_PACK or native.load("pack") is None,
                                  reason="no oneDNN packing or no C compiler: oneDNN's reorder is used")
SHAPES = [(64, 32), (128, 576), (192, 96), (1536, 576), (64, 512), (128, 2560), (64, 3008)]  # the last two: rows of
# several 32-tile work items (3008: the last one partial)
IN_PLACE_EVERYWHERE = {(1536, 576), (128, 576)}  # SmolLM2's MLP and a 128-row projection: in place on AVX-512 and AVX2
# CPUs alike; oneDNN lays out others by CPU (fp32 192 x 96 in blocks of 16 outputs on an AVX2-only EPYC: written in
# place too, `tandem_pack_b16`), where a layout neither writes falls back to oneDNN's reorder
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not ONEDNN_BF16, reason="oneDNN has no bfloat16 linears on this CPU (AVX2 only): bf16 weights are not packed"))
DTYPES = [torch.float32, BF16]
NOT_AMX = pytest.mark.skipif(AMX_BF16, reason="oneDNN lays bfloat16 weights out for AMX tiles here, a layout "
                                              "csrc/pack.c does not write: every bf16 pack falls back to its reorder")


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_in_place_pack_writes_onednn_bytes_into_the_same_tensor(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    old, new = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    w = old.clone()
    packed = {id(w): pack_weight(w)}
    before = packed[id(w)]
    w.copy_(new)
    repack(packed, [w])
    in_place = linear._in_place_block(native.load("pack"), shape, dtype, 32) != 0  # the probes' verdict here
    assert in_place or shape not in IN_PLACE_EVERYWHERE or (dtype == torch.bfloat16 and AMX_BF16)
    assert (packed[id(w)] is before) == in_place  # written in place, not a new tensor (or a new reorder)
    assert torch.equal(linear._raw(packed[id(w)]), linear._raw(pack_weight(new)))
    x = torch.randn(5, shape[1], generator=gen).to(dtype)
    assert torch.equal(linear._onednn(x, packed[id(w)], None), linear._onednn(x, pack_weight(new), None))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=[*BF16.marks, NOT_AMX])])
def test_copy_and_repack_updates_both_copies_in_one_pass(dtype):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(256, 96, generator=gen).to(dtype)
    source = torch.randn(256, 96, generator=gen).to(dtype)
    packed = {id(w): pack_weight(w)}
    assert copy_and_repack(packed, w, source)
    assert torch.equal(w, source)
    assert torch.equal(linear._raw(packed[id(w)]), linear._raw(pack_weight(source)))
    # where it does not apply it writes nothing and says so
    other = torch.randn(256, 96, generator=gen)
    assert not copy_and_repack({}, w, source)
    if dtype == torch.bfloat16:
        assert not copy_and_repack(packed, w, other)  # another dtype: the caller converts while copying
        assert torch.equal(w, source)
    assert not copy_and_repack(packed, w, torch.randn(96, 256, generator=gen).to(dtype).t())  # not contiguous
    assert torch.equal(w, source)


@needs_native
@pytest.mark.parametrize("shape,dtype", [((100, 32), torch.float32), ((64, 8), torch.float32),
                                         pytest.param((64, 16), torch.bfloat16, marks=BF16.marks)])
def test_shapes_onednn_pads_fall_back_to_a_new_reorder(shape, dtype):
    """oneDNN pads N to 64 and K to 16 (fp32) / 32 (bf16) units: the probe finds the layout differs."""
    w = torch.randn(shape).to(dtype)
    packed = {id(w): pack_weight(w)}
    before = packed[id(w)]
    w.mul_(2)
    pack_into(packed, w)
    assert packed[id(w)] is not before
    x = torch.randn(3, shape[1]).to(dtype)
    assert torch.equal(linear._onednn(x, packed[id(w)], None), linear._onednn(x, pack_weight(w), None))
    assert linear._IN_PLACE[(shape, dtype, 32)] is False


@needs_native
def test_pack_b64_rejects_what_it_cannot_write():
    lib = native.load("pack")
    packed = pack_weight(torch.zeros(64, 16))
    ptr, nbytes = linear._buffer(packed)
    with pytest.raises(ValueError, match="multiple of 64"):
        native.pack_b64(lib, torch.zeros(65, 16), ptr, nbytes)
    with pytest.raises(ValueError, match="destination holds 4096 bytes, the weight 8192"):
        native.pack_b64(lib, torch.zeros(64, 32), ptr, nbytes)
    with pytest.raises(ValueError, match="contiguous CPU float32/bfloat16"):
        native.pack_b64(lib, torch.zeros(16, 64).t(), ptr, nbytes)
    with pytest.raises(ValueError, match="K even"):
        native.pack_b64(lib, torch.zeros(64, 15, dtype=torch.bfloat16), ptr, nbytes)
    with pytest.raises(ValueError, match="plain must be"):
        native.pack_b64(lib, torch.zeros(64, 16), ptr, nbytes, plain=torch.zeros(64, 9))


@needs_native
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=BF16.marks)])
def test_a_weight_sync_into_a_packing_engine_matches_an_engine_built_on_the_new_weights(dtype):
    """The engine's update path (`copy_and_repack`) writes the plain and packed weights in place, and the
    engine then generates exactly what an engine that packed the new weights from scratch generates."""
    from tests.engines.torch_helpers import make_engine, prompts, requests

    engine, fresh = make_engine(dtype=dtype), make_engine(dtype=dtype)
    assert engine._packed, "the engine packs its weights"
    g = torch.Generator().manual_seed(0)
    new = [(k, (v.float() + 0.1 * torch.randn(v.shape, generator=g)).to(v.dtype))
           for k, v in engine.named_weights().items()]
    before = dict(engine._packed)
    engine.update_weights(new, version=1)
    in_place = [k for k, v in before.items() if engine._packed[k] is v]
    if dtype == "float32" or not AMX_BF16:  # with AMX every bf16 weight is repacked by oneDNN's reorder
        assert len(in_place) >= len(before) // 2  # the tiny model's shapes are mostly multiples of 64
    fresh.sleep()
    fresh.update_weights(new, version=1)
    fresh.wake_up()  # packs from scratch (oneDNN's reorder)
    def by_name(e):
        return {n: e._packed[id(m.weight)] for n, m in e.model.named_modules() if id(getattr(m, "weight", None)) in e._packed}

    mine, theirs = by_name(engine), by_name(fresh)
    assert mine.keys() == theirs.keys() and {id(v) for v in mine.values()} == {id(v) for v in engine._packed.values()}
    for name, packed in mine.items():
        assert torch.equal(linear._raw(packed), linear._raw(theirs[name])), name
    ps = prompts([7, 12], seed=4)
    got = engine.generate(requests(ps, max_new_tokens=8, temperature=1.0, seed=5))
    want = fresh.generate(requests(ps, max_new_tokens=8, temperature=1.0, seed=5))
    assert [(c.token_ids, c.log_probs) for r in got for c in r.completions] == [
        (c.token_ids, c.log_probs) for r in want for c in r.completions]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_writes_each_64_rows_in_one_stretch(dtype):
    """The premise of the layout check's blocks (`_in_place_ok`): csrc/pack.c's bytes for a weight are its bytes
    for each block of 64-multiple rows, end to end."""
    lib = native.load("pack")
    w = torch.randn(320, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = torch.zeros(w.numel() * w.element_size(), dtype=torch.uint8)
    native.pack_b64(lib, w, whole.data_ptr(), whole.numel())
    parts = []
    for rows in (w[:64], w[64:192], w[192:]):
        part = torch.zeros(rows.numel() * rows.element_size(), dtype=torch.uint8)
        native.pack_b64(lib, rows.contiguous(), part.data_ptr(), part.numel())
        parts.append(part)
    assert torch.equal(torch.cat(parts), whole)


@needs_native
@pytest.mark.parametrize("where", [0, -1])
def test_the_layout_check_finds_a_difference_in_any_block(monkeypatch, where):
    """A weight of several ~4 MiB blocks: one byte of oneDNN's packing that differs, in the first block or
    the last, makes the check say no (and so the weight is re-packed by oneDNN's reorder, never written)."""
    shape = (4096, 576)  # 9 MiB in float32: three blocks
    real = linear._pack

    def corrupted(weight, batch_hint):
        packed = real(weight, batch_hint)
        raw = linear._raw(packed)
        raw[where] ^= 1
        return packed

    monkeypatch.setattr(linear, "_IN_PLACE", {})
    assert linear._in_place_ok(native.load("pack"), shape, torch.float32, 32)  # the real layout: in place here
    monkeypatch.setattr(linear, "_IN_PLACE", {})
    monkeypatch.setattr(linear, "_pack", corrupted)
    assert not linear._in_place_ok(native.load("pack"), shape, torch.float32, 32)


@needs_native
def test_pack_weights_checks_the_layout_before_it_packs(monkeypatch):
    """`pack_weights` runs each shape's layout check before making any packed copy, so the check's moment of
    twice a weight's memory does not come on top of the copies (nor, later, of a rollout's caches)."""
    net = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
    order = []
    real_pack, real_check = linear._pack, linear._in_place_ok
    monkeypatch.setattr(linear, "_IN_PLACE", {})

    def pack(w, hint):  # a parameter: a packed copy (the check packs a probe tensor of its own)
        if isinstance(w, torch.nn.Parameter):
            order.append(("pack", tuple(w.shape)))
        return real_pack(w, hint)

    monkeypatch.setattr(linear, "_pack", pack)
    monkeypatch.setattr(linear, "_in_place_ok", lambda lib, shape, dtype, hint: order.append(("check", shape))
                        or real_check(lib, shape, dtype, hint))
    packed = linear.pack_weights(net)
    assert len(packed) == 3
    first_copy = next(i for i, (what, _) in enumerate(order) if what == "pack")
    checks = {shape for what, shape in order[:first_copy] if what == "check"}
    assert checks == {(128, 96), (256, 128), (128, 256)}


@needs_native
@pytest.mark.parametrize("shape", [(0, 16), (64, 0)])
def test_an_empty_weight_is_never_written_in_place(shape):
    assert not linear._in_place_ok(native.load("pack"), shape, torch.float32, 32)


@needs_native
@pytest.mark.parametrize("n,k", [(192, 576), (16, 40), (48, 17), (64, 3008)])
def test_blocks_of_16_are_written_as_onednn_lays_them_out(n, k):
    """``block=16`` writes ``[N/16][K][16]`` (the layout oneDNN gives some float32 shapes on AVX2-only CPUs), made
    here by torch so that it runs on any CPU, with the plain copy in the same pass; where oneDNN does use that
    layout for the shape, a repack writes it in place and oneDNN's products read it."""
    lib = native.load("pack")
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    dst, plain = torch.empty(n * k), torch.empty(n, k)
    native.pack_b64(lib, w, dst.data_ptr(), dst.numel() * 4, plain, block=16)
    assert torch.equal(dst, w.view(n // 16, 16, k).transpose(1, 2).reshape(-1)) and torch.equal(plain, w)
    with pytest.raises(ValueError, match="multiple of 16"):
        native.pack_b64(lib, torch.zeros(24, 8), dst.data_ptr(), 24 * 8 * 4, block=16)
    with pytest.raises(ValueError, match="16 for float32"):
        native.pack_b64(lib, torch.zeros(16, 8, dtype=torch.bfloat16), dst.data_ptr(), 16 * 8 * 2, block=16)
    if not linear._packs_in_blocks_of_16((n, k), torch.float32):
        return
    assert linear.packs_in_place(w)
    table = {id(w): pack_weight(w)}
    before = table[id(w)]
    new = torch.randn(n, k, generator=gen)
    w.copy_(new)
    repack(table, [w])
    assert table[id(w)] is before
    assert torch.equal(linear._raw(before), linear._raw(pack_weight(new)))
    x = torch.randn(3, k, generator=gen)
    assert torch.equal(linear._onednn(x, before, None), linear._onednn(x, pack_weight(new), None))


@needs_native
@pytest.mark.parametrize("block", [64, 16])
def test_the_avx2_build_writes_the_same_layout(block):
    """csrc/pack.c's AVX2 tile (four 8 x 8 transposes, each 64-byte line stored as two back-to-back halves, streamed
    where aligned) writes the layout the AVX-512 tile and the scalar loop write: built for ``x86-64-v3`` (on an
    AVX-512 CPU, another build than the default; on an AVX2 CPU, the same code) and compared with torch's
    permutation, aligned (streamed) and not, with the plain copy in the same pass."""
    flags = set(native._cpu_flags().split())
    if not {"avx2", "fma", "f16c", "bmi2"} <= flags:
        pytest.skip("this CPU cannot run an x86-64-v3 (AVX2 + FMA) build")
    try:
        v3 = native.load_variant("pack", "x86-64-v3")
    except native.NativeKernelError as e:
        pytest.skip(f"no x86-64-v3 build here: {e}")
    gen = torch.Generator().manual_seed(block)
    for n, k in [(192, 576), (1536, 576), (64, 40), (128, 3008)]:
        w = torch.randn(n, k, generator=gen)
        want = w.view(n // block, block, k).transpose(1, 2).reshape(-1)
        for offset in (0, 1):  # a 64-byte aligned destination (streamed stores), then one that is not
            buf, plain = torch.empty(n * k + 16), torch.empty(n, k)
            dst = buf[offset:offset + n * k]
            native.pack_b64(v3, w, dst.data_ptr(), n * k * 4, plain, block=block)
            assert torch.equal(dst, want) and torch.equal(plain, w)
