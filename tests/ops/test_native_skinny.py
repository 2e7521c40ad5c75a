"""csrc/skinny.c: few-row float32 products read straight from oneDNN's packed weights (tandem/ops/linear.py,
"Few-row products"): the product within float rounding of a float64 reference, each row's bits its own
(whatever the other rows and the thread count), and used only where it should be (not in the batch-invariant
mode, not past `SKINNY_MAX_ROWS`, not for a shape oneDNN packs otherwise)."""

import ctypes

import pytest
import torch

from tandem.ops import linear, native
from tandem.ops.batch_invariant import invariant_linear
from tandem.ops.linear import CAN_PACK, _buffer, _onednn, fast_linear, pack_weight

LIB = native.load("skinny") if CAN_PACK else None
pytestmark = pytest.mark.skipif(LIB is None or not linear._skinny_ok((576, 576)),
                                reason="no oneDNN packing, no C compiler, or another packed layout on this CPU")


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and its packed copy; skips where oneDNN packs this shape in a layout the kernel does not read
    (blocks of 64 outputs, or of 16 where oneDNN takes those: `_block`)."""
    if not linear._skinny_ok((n, k)):
        pytest.skip(f"oneDNN packs a float32 [{n}, {k}] weight in another layout on this CPU")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, pack_weight(w)


def _block(n: int, k: int) -> int:
    """The output block of oneDNN's float32 layout for this shape here: 16 where it packs ``[N/16][K][16]`` (the
    192-output weights on an AVX2-only CPU), else 64."""
    linear._skinny_ok((n, k))
    return 16 if (n, k, torch.float32) in linear._BLOCKS_OF_16 else 64


def _blocked(w: torch.Tensor, block: int) -> torch.Tensor:
    """``w [N, K]`` laid out as ``[N/block][K][block]`` (oneDNN's packed float32 layouts), made by torch."""
    n, k = w.shape
    return w.view(n // block, block, k).transpose(1, 2).contiguous()


@pytest.mark.parametrize("n,k", [(192, 576), (320, 576), (1536, 576), (576, 1536), (64, 8),
                                 (2048, 64)])  # 2048: unsplit sums
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_the_product_is_the_reference_within_rounding(n, k, rows):
    w, packed = _weight(n, k)
    bias = torch.randn(n) if rows % 2 else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = native.skinny(LIB, x, _buffer(packed)[0], n, bias, block=_block(n, k))
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * k ** 0.5


@pytest.mark.parametrize("n", [1536, 192, 320])  # 3 and 5 blocks: 2 threads split a block's tiles between them
def test_a_rows_bits_depend_on_that_row_alone(n):
    w, packed = _weight(n, 576)
    x = torch.randn(23, 576, generator=torch.Generator().manual_seed(1))
    ptr, block = _buffer(packed)[0], _block(n, 576)
    together = native.skinny(LIB, x, ptr, n, None, block=block)
    for r in (0, 5, 6, 17, 22):  # first and last row of a tile, a short last tile
        assert torch.equal(native.skinny(LIB, x[r : r + 1].contiguous(), ptr, n, None, block=block)[0], together[r])
    assert torch.equal(native.skinny(LIB, x[4:11].contiguous(), ptr, n, None, block=block), together[4:11])
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(native.skinny(LIB, x, ptr, n, None, block=block), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16])
@pytest.mark.parametrize("n,k", [(192, 576), (16, 40), (1536, 576)])
def test_blocks_of_16_give_the_bits_of_blocks_of_64(n, k, rows):
    """The tile for oneDNN's ``[N/16][K][16]`` layout sums each output over k in order with fused multiply-adds,
    as the 64-output tiles do: on the same weight laid out each way (by torch, so on any CPU) the bits are equal,
    and both are the reference within rounding. A row's bits are its own there too."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05
    bias = torch.randn(n) if rows % 2 else None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    b16 = _blocked(w, 16)
    got = native.skinny(LIB, x, b16.data_ptr(), n, bias, block=16)
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert (got.double() - want).abs().max() < 1e-5 * k ** 0.5
    if n % 64 == 0:
        b64 = _blocked(w, 64)
        assert torch.equal(got, native.skinny(LIB, x, b64.data_ptr(), n, bias, block=64))
    assert torch.equal(native.skinny(LIB, x[-1:].contiguous(), b16.data_ptr(), n, bias, block=16)[0], got[-1])


def test_blocks_of_16_refuse_what_they_cannot_read():
    x, w = torch.randn(2, 40), torch.randn(24, 40)
    with pytest.raises(ValueError, match="multiple of 16"):
        native.skinny(LIB, x, w.data_ptr(), 24, None, block=16)
    with pytest.raises(ValueError, match="float32 only"):
        native.skinny(LIB, x.bfloat16(), w.data_ptr(), 16, None, block=16)
    with pytest.raises(ValueError, match="64 or 16"):
        native.skinny(LIB, x, w.data_ptr(), 32, None, block=32)


@pytest.mark.parametrize("n,k", [(192, 576), (192, 1536), (576, 576)])
def test_the_layout_check_says_what_onednn_wrote(n, k):
    """`_packs_in_blocks_of_16` is yes exactly where oneDNN's packed bytes are the ``[N/16][K][16]`` layout (on an
    AVX2-only EPYC: the 192-output weights; 576 outputs take blocks of 64). Where it says yes, `fast_linear`
    runs the 16-output tile on oneDNN's own bytes for up to `SKINNY_MAX_ROWS_256` rows, on every CPU."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05
    packed = pack_weight(w)
    ptr, nbytes = _buffer(packed)
    raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.float32)
    assert linear._packs_in_blocks_of_16((n, k), torch.float32) == torch.equal(raw, _blocked(w, 16).view(-1))
    assert not linear._packs_in_blocks_of_16((n, k), torch.bfloat16)
    assert not linear._packs_in_blocks_of_16((n + 8, k), torch.float32)
    if _block(n, k) != 16:
        return
    few, many = torch.randn(16, k), torch.randn(17, k)
    got = fast_linear(few, w, packed={id(w): packed})
    assert torch.equal(got, native.skinny(LIB, few, ptr, n, None, block=16))
    assert (got.double() - few.double() @ w.double().t()).abs().max() < 1e-5 * k ** 0.5
    assert torch.equal(fast_linear(many, w, packed={id(w): packed}), _onednn(many, packed, None))


def _x86_64_v3_lib():
    flags = set(native._cpu_flags().split())
    if not {"avx2", "fma", "f16c", "bmi2"} <= flags:
        pytest.skip("this CPU cannot run an x86-64-v3 (AVX2 + FMA) build")
    try:
        return native.load_variant("skinny", "x86-64-v3")
    except native.NativeKernelError as e:
        pytest.skip(f"no x86-64-v3 build here: {e}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 64])
def test_the_avx2_build_gives_the_same_bits(rows):
    """The AVX2 tile (256-bit stripes of the block; the 512-bit tile spills on AVX2, 2-4x slower than oneDNN
    per product there) sums each output in the same order with the same fused multiply-adds: on an AVX-512 CPU
    its bits equal the default build's, on an AVX2 CPU the two builds are the same code. Every row count takes
    its own path (1 row; 2-3 rows; 4-6 rows as two 3-row halves; more rows as several tiles)."""
    v3 = _x86_64_v3_lib()
    w, packed = _weight(1536, 576)
    bias = torch.randn(1536) if rows % 2 else None
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    ptr = _buffer(packed)[0]
    got = native.skinny(v3, x, ptr, 1536, bias)
    assert torch.equal(got, native.skinny(LIB, x, ptr, 1536, bias))
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    assert (got.double() - want).abs().max() < 1e-5 * 576 ** 0.5


def test_fast_linear_takes_it_for_few_rows_and_onednn_otherwise(monkeypatch):
    w, packed = _weight(576, 576)
    ptr = _buffer(packed)[0]
    few, many = torch.randn(2, 3, 576), torch.randn(65, 576)  # 6 rows (leading dims flattened); 65 rows
    got = fast_linear(few, w, packed={id(w): packed})
    assert got.shape == (2, 3, 576)
    assert torch.equal(got.view(6, 576), native.skinny(LIB, few.reshape(6, 576), ptr, 576, None))
    assert torch.equal(fast_linear(many, w, packed={id(w): packed}), _onednn(many, packed, None))
    # the batch-invariant mode keeps oneDNN's bits (the trainer's products), as does few_rows=False
    assert torch.equal(invariant_linear(few, w, packed={id(w): packed}), _onednn(few.reshape(6, 576), packed,
                                                                                  None).view(2, 3, 576))
    assert torch.equal(fast_linear(few, w, packed={id(w): packed}, few_rows=False).view(6, 576),
                       _onednn(few.reshape(6, 576), packed, None))
    monkeypatch.setattr(linear, "SKINNY_MAX_ROWS", 0)
    assert torch.equal(fast_linear(few, w, packed={id(w): packed}).view(6, 576),
                       _onednn(few.reshape(6, 576), packed, None))


def test_the_avx2_tile_takes_at_most_16_rows(monkeypatch):
    """The AVX2 tile is slower than oneDNN past 16 rows (measured): there `fast_linear` keeps oneDNN's product."""
    w, packed = _weight(576, 576)
    ptr = _buffer(packed)[0]
    assert LIB.tandem_skinny_vector_bits() in (256, 512)
    assert linear._SKINNY_WIDE == (LIB.tandem_skinny_vector_bits() == 512)
    calls = []  # which rows the kernel ran (oneDNN's bits can equal the kernel's on AVX2)
    kernel = linear._skinny_for((576, 576), torch.float32)
    monkeypatch.setitem(linear._SKINNY, (576, 576, torch.float32),
                        lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    monkeypatch.setattr(linear, "_SKINNY_WIDE", False)
    x16, x17 = torch.randn(16, 576), torch.randn(17, 576)
    assert torch.equal(fast_linear(x16, w, packed={id(w): packed}), native.skinny(LIB, x16, ptr, 576, None))
    assert torch.equal(fast_linear(x17, w, packed={id(w): packed}), _onednn(x17, packed, None))
    assert calls == [16]
    monkeypatch.setattr(linear, "_SKINNY_WIDE", True)
    assert torch.equal(fast_linear(x17, w, packed={id(w): packed}), native.skinny(LIB, x17, ptr, 576, None))
    assert calls == [16, 17]


def test_a_shape_oneDNN_does_not_pack_in_64_row_blocks_stays_with_onednn():
    w = torch.randn(100, 576, generator=torch.Generator().manual_seed(0)) * 0.05  # 100 outputs: not a multiple of 64
    packed = pack_weight(w)
    assert not linear._skinny_ok((100, 576))
    with pytest.raises(ValueError, match="N must be a multiple of 64"):
        native.skinny(LIB, torch.randn(2, 576), _buffer(packed)[0], 100, None)
    x = torch.randn(3, 576)
    assert torch.equal(fast_linear(x, w, packed={id(w): packed}), _onednn(x, packed, None))


@pytest.mark.skipif(not (CAN_PACK and LIB is not None and linear._skinny_ok((192, 576), torch.bfloat16)),
                    reason="no AVX-512 BF16 kernel here, or oneDNN packs bfloat16 weights otherwise")
@pytest.mark.parametrize("rows", [1, 6, 13])
@pytest.mark.parametrize("n", [1536, 2048])  # 24 blocks: sums in two halves; 32: in one
def test_bfloat16_rows_are_the_reference_rounded_and_their_own(rows, n):
    """bfloat16 (AVX-512 BF16: products of column pairs summed in float32, rounded once at the end)."""
    w = (torch.randn(n, 576, generator=torch.Generator().manual_seed(3)) * 0.05).bfloat16()
    packed, bias = pack_weight(w), torch.randn(n).bfloat16()
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = native.skinny(LIB, x, _buffer(packed)[0], n, bias)
    want = x.double() @ w.double().t() + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()  # one bf16 rounding (+ fp32 sums)
    assert torch.equal(native.skinny(LIB, x[-1:].contiguous(), _buffer(packed)[0], n, bias)[0], got[-1])
    assert torch.equal(fast_linear(x, w, bias, packed={id(w): packed}), got)  # the engine's path takes it


def test_the_kept_address_follows_the_packed_memory():
    """`_packed_product` keeps a packed weight's address on the tensor (asking oneDNN costs ~3.5 us a product): an
    in-place re-pack keeps it valid, and `swap_tensors` (which swaps ``__dict__`` too) never makes a product read the
    other tensor's memory."""
    w, packed = _weight(576, 576)
    x = torch.randn(3, 576)
    first = fast_linear(x, w, packed={id(w): packed})
    assert linear._data_ptr(packed) == int(torch.ops.mkldnn.data_ptr(packed))
    w2 = torch.randn(576, 576) * 0.05
    table = {id(w): packed}
    linear.pack_into(table, w, source=w2)  # in place where this CPU allows it, else a new packed tensor
    assert torch.equal(fast_linear(x, w, packed=table), fast_linear(x, w2, packed={id(w2): pack_weight(w2)}))
    assert not torch.equal(fast_linear(x, w, packed=table), first)
    other = pack_weight(torch.randn(576, 576))
    a, b = table[id(w)], other
    want_a, want_b = int(torch.ops.mkldnn.data_ptr(a)), int(torch.ops.mkldnn.data_ptr(b))
    linear._data_ptr(b)
    torch.utils.swap_tensors(a, b)
    assert linear._data_ptr(a) == want_b and linear._data_ptr(b) == want_a
