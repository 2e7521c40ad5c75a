"""`read_safetensors`: a model file read tensor by tensor into memory of our own (no memory map), and
`CausalLM.from_pretrained` on it: the same values as safetensors' own reader, ``given`` tensors held as they are."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.models.registry import resolve_model
from tandem.models.safetensors_read import read_safetensors
from tandem.models.transformer import CausalLM


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 64, generator=g).to(torch.bfloat16),
        "f16": torch.randn(33, generator=g).half(),
        "fp8": torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(-5, 6),
        "u8": torch.arange(200, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_every_tensor_reads_back_bit_for_bit_in_memory_of_its_own(tmp_path):
    want = _tensors()
    save_file(want, tmp_path / "m.safetensors")
    got = dict(read_safetensors(tmp_path / "m.safetensors"))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else got[name],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
        assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage, not a map


def test_floating_tensors_convert_to_the_dtype_asked_and_skipped_names_are_not_read(tmp_path):
    want = _tensors()
    save_file(want, tmp_path / "m.safetensors")
    got = dict(read_safetensors(tmp_path / "m.safetensors", dtype=torch.float32, skip=lambda n: n == "f16"))
    assert "f16" not in got
    assert got["bf16"].dtype == torch.float32 and torch.equal(got["bf16"], want["bf16"].float())
    assert got["i64"].dtype == torch.int64 and got["flag"].dtype == torch.bool  # not floating: as stored


def _write(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_damaged_file_is_refused_naming_the_tensor_and_the_sizes(tmp_path):
    f = tmp_path / "bad.safetensors"
    _write(f, {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}, b"\0" * 40)
    with pytest.raises(ValueError, match=r"w spans bytes 0-64 .* the file holds 40"):
        list(read_safetensors(f))
    _write(f, {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}, b"\0" * 64)
    with pytest.raises(ValueError, match=r"shape \[4, 4\] of F32 is 64 bytes"):
        list(read_safetensors(f))
    _write(f, {"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(ValueError, match=r"w has dtype 'C64', not one of"):
        list(read_safetensors(f))
    f.write_bytes(struct.pack("<Q", 2**40))
    with pytest.raises(ValueError, match=r"header of 1099511627776 bytes exceeds the format's limit"):
        list(read_safetensors(f))
    f.write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="not a safetensors file"):
        list(read_safetensors(f))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_from_pretrained_loads_the_values_safetensors_reads(name):
    path = resolve_model(name)
    ref = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    sd = CausalLM.from_pretrained(path).hf_state_dict()
    assert sd.keys() <= ref.keys()
    assert all(torch.equal(sd[k], ref[k].float()) for k in sd)


def test_from_pretrained_holds_given_tensors_and_reads_only_the_rest():
    path = resolve_model("tiny-llama")
    files = CausalLM.from_pretrained(path).hf_state_dict()
    norm = torch.full_like(files["model.norm.weight"], 3.0)  # a value the file does not hold: proves no read
    q = "model.layers.0.self_attn.q_proj.weight"
    model = CausalLM.from_pretrained(path, given={"model.norm.weight": norm, q: files[q].double()},
                                     unallocated=["model.layers.1.mlp.up_proj.weight"])
    sd = model.hf_state_dict()
    assert sd["model.norm.weight"].data_ptr() == norm.data_ptr()
    assert sd[q].dtype == torch.float32 and torch.equal(sd[q], files[q])  # another dtype: read from the file
    assert sd["model.layers.1.mlp.up_proj.weight"].is_meta


def test_the_index_reads_any_tensor_by_name_as_the_sequential_reader_does(tmp_path):
    from tandem.models.safetensors_read import SafetensorsIndex

    tensors = _tensors()
    save_file(dict(list(tensors.items())[: len(tensors) // 2]), str(tmp_path / "a.safetensors"))
    save_file(dict(list(tensors.items())[len(tensors) // 2 :]), str(tmp_path / "b.safetensors"))
    index = SafetensorsIndex(sorted(tmp_path.glob("*.safetensors")))
    assert sorted(index.names()) == sorted(tensors)
    for name in reversed(list(tensors)):  # any order, across files
        got = index.read(name)
        want = tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
        assert index.shape(name) == tuple(tensors[name].shape)
    float_name = next(n for n, t in tensors.items() if t.dtype == torch.float32)
    assert index.read(float_name, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(KeyError, match="'nope' is not in the safetensors files"):
        index.read("nope")


def test_the_index_reads_a_range_of_rows_alone(tmp_path):
    from tandem.models.safetensors_read import SafetensorsIndex

    tensors = _tensors()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    index = SafetensorsIndex([tmp_path / "m.safetensors"])
    for name in ("f32", "bf16", "i64"):
        full = tensors[name]
        for start, stop in ((0, 1), (1, full.shape[0]), (2, 2)):
            assert torch.equal(index.read_rows(name, start, stop), full[start:stop]), (name, start, stop)
    assert index.read_rows("f32", 1, 3, torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match=r"rows \[5, 9\) of f32 \(shape \[7, 5\]\) are out of range"):
        index.read_rows("f32", 5, 9)
    with pytest.raises(ValueError, match="out of range"):
        index.read_rows("scalar", 0, 1)
