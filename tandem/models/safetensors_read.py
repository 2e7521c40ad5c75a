"""Read a ``.safetensors`` file tensor by tensor with plain file reads, into tensors of our own.

`safetensors.torch.load_file` maps the file and hands back views of the map; a loader that then converts
or copies them (to own aligned, writable memory) holds the file's pages *and* the copies at once, and the
mapped pages count in the process's resident memory (its peak RSS) for as long as the map lives: for
SmolLM2-135M in float32, 513 MiB of file pages on top of the 513 MiB model while it loads, in every process
that loads it. Here each tensor is read straight into its own storage (``readinto``, no map, no intermediate
copy when the file's dtype is the one wanted), so loading costs the loaded model and one tensor at most.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data, offsets relative to its start, row-major, little-endian.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

__all__ = ["SafetensorsIndex", "read_safetensors"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100 * 2**20  # the format's own limit on the header's size


def _header(f, path: Path) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file ({len(raw)} bytes, no header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise ValueError(f"{path}: safetensors header of {n} bytes exceeds the format's limit of {MAX_HEADER}")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def read_safetensors(path: str | Path, *, dtype: torch.dtype | None = None,
                     skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of ``path`` in file order, each in memory of its own (CPU).
    ``dtype``: floating-point tensors converted to it (one tensor at a time); ``skip(name)``: not read."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        header, start = _header(f, path)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if skip is not None and skip(name):
                continue
            yield name, _read(f, path, name, info, start, size, dtype)


def _read(f, path: Path, name: str, info: dict, start: int, size: int, dtype: torch.dtype | None) -> torch.Tensor:
    """Tensor ``name`` (its header entry ``info``; the data begins at byte ``start`` of a file of ``size``)."""
    file_dtype = DTYPES.get(info["dtype"])
    if file_dtype is None:
        raise ValueError(f"{path}: {name} has dtype {info['dtype']!r}, not one of {sorted(DTYPES)}")
    begin, end = info["data_offsets"]
    tensor = torch.empty(info["shape"], dtype=file_dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if end - begin != nbytes or start + end > size:
        raise ValueError(f"{path}: {name} spans bytes {begin}-{end} of the data ({end - begin} bytes), "
                         f"but shape {info['shape']} of {info['dtype']} is {nbytes} bytes and the file "
                         f"holds {size - start}")
    if nbytes:
        f.seek(start + begin)
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        got = 0
        while got < nbytes:  # readinto may return short on large reads
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{path}: truncated while reading {name} ({got} of {nbytes} bytes)")
            got += n
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


class SafetensorsIndex:
    """The tensors of a model folder's ``*.safetensors`` files by name, each read on demand into memory of its
    own (`read`), as `read_safetensors` reads them: a loader that builds its model on the meta device and
    fills it one module at a time holds one tensor of the files at most."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, tuple[Path, dict, int, int]] = {}
        for path in files:
            path = Path(path)
            with open(path, "rb", buffering=0) as f:
                header, start = _header(f, path)
            size = path.stat().st_size
            for name, info in header.items():
                self._where[name] = (path, info, start, size)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def names(self) -> list[str]:
        return list(self._where)

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (its first dimension), read alone: they lie contiguous in
        the row-major file."""
        if name not in self._where:
            raise KeyError(f"{name!r} is not in the safetensors files ({len(self._where)} tensors)")
        path, info, begin, size = self._where[name]
        shape = info["shape"]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{path}: rows [{start}, {stop}) of {name} (shape {shape}) are out of range")
        row = (info["data_offsets"][1] - info["data_offsets"][0]) // max(1, shape[0])
        part = dict(info, shape=[stop - start, *shape[1:]],
                    data_offsets=[info["data_offsets"][0] + start * row, info["data_offsets"][0] + stop * row])
        with open(path, "rb", buffering=0) as f:
            return _read(f, path, name, part, begin, size, dtype)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` (``dtype``: a floating-point tensor converted to it). KeyError names a missing one."""
        if name not in self._where:
            raise KeyError(f"{name!r} is not in the safetensors files ({len(self._where)} tensors)")
        path, info, start, size = self._where[name]
        with open(path, "rb", buffering=0) as f:
            return _read(f, path, name, info, start, size, dtype)
