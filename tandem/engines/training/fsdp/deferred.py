"""Building a sharded model without a whole copy of it in every rank.

Loading the model and then sharding it (`fully_shard`) makes every rank hold the whole model for a moment:
on a node of 8 GPUs training a 70B model in fp32, 8 x 280 GB of host memory at start-up, before FSDP keeps an
eighth of it. With ``trainer.fsdp.parallel.sharded_load`` (the default) a sharded engine loads its native
model with the checkpoint's matrices (every tensor of two or more dimensions: the decoder layers' projections,
the embedding, an untied LM head) left on the meta device. `fully_shard` takes each module on the meta device
(FSDP's deferred initialisation), and `DeferredWeights.materialize` then reads this rank's rows of each of the
module's matrices from the files (`SafetensorsIndex.read_rows`: FSDP shards dim 0 in chunks of
``ceil(rows / world)``, and rows lie contiguous in a safetensors file) and hands them to FSDP as its shards.
A rank reads and holds its shards and nothing more, whatever the model's size; a node reads its checkpoint
once (with HSDP, once per replica). The native model's norms and other vectors are read whole, as before. The values are the
files' either way, so the model is the same bit for bit (tested).

A QLoRA base is read the same way in any world: `qlora.quantize_base` reads each targeted weight right before
it quantizes it, so the base never exists in full precision (the rest of the model is read as it is sharded, or
at once in one process).

The HF fallback (``packing: false``, or an architecture the native model lacks) is read the same way where its
checkpoint names the model's parameters with their shapes (`hf_on_meta`: the model built with its parameters on
the meta device, buffers computed or read as `from_pretrained` gives them), or where transformers builds them
from the checkpoint's per-expert tensors (fsdp/converted.py: DeepSeek-V3, GLM-4.5, Qwen3-MoE, Mixtral); a rank
reads its experts' tensors alone. Any other conversion loads whole.

Not deferred (the whole model is loaded, then sharded, as before): full fine-tuning and LoRA in one process
(nothing to shard), an HF model whose checkpoint transformers converts otherwise, QAT (its layers are built from whole
weights).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from tandem.engines.training.fsdp.converted import Stacked, checkpoint_sources
from tandem.engines.training.fsdp.vocab_parallel import vocab_rows
from tandem.models.safetensors_read import SafetensorsIndex

__all__ = ["DeferredWeights", "deferred_names", "hf_on_meta"]

_LORA_BASE = ".base_layer."  # fsdp/lora.py keeps a LoRA'd linear's weight under X.base_layer.weight


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, their buffers where they are computed
    (a rotary embedding's ``inv_freq``): each parameter moves to meta as it is registered, before any
    initialisation runs on it. It patches `nn.Module.register_parameter` while it lasts, for this thread's
    calls only (another thread building modules meanwhile keeps its parameters)."""
    register, builder = nn.Module.register_parameter, threading.get_ident()

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and threading.get_ident() == builder:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def hf_on_meta(path: Path, dtype: torch.dtype, attn_implementation: str | None):
    """``(model, DeferredWeights)``: the HF model of folder ``path`` with its parameters on the meta device and
    its persistent buffers read from the files; or None where the checkpoint's names or shapes are not the
    model's, and not one of the conversions fsdp/converted.py reads (a MoE's per-expert weights, fused into one
    tensor per layer, are): such a model loads whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    index = SafetensorsIndex(sorted(Path(path).glob("*.safetensors")))
    config = AutoConfig.from_pretrained(str(path))
    with _parameters_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    sources = checkpoint_sources(lm, index)
    if sources is None:
        return None
    for prefix, module in lm.named_modules():
        for name, buf in module._buffers.items():
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and name not in module._non_persistent_buffers_set and full in index:
                buf.copy_(index.read(full, buf.dtype))
    renamed = {n: src for n, src in sources.items() if src != n}
    return lm.eval(), DeferredWeights(path, index, renamed)  # eval: as `from_pretrained` returns it


def deferred_names(index: SafetensorsIndex) -> list[str]:
    """The checkpoint tensors a sharded load reads module by module: those of two or more dimensions."""
    return [name for name in index.names() if len(index.shape(name)) >= 2]


class DeferredWeights:
    """The meta parameters of one model and where each comes from (its checkpoint name)."""

    def __init__(self, path: str | Path, index: SafetensorsIndex, sources: dict[str, str | Stacked] | None = None
                 ) -> None:
        self.path, self.index = str(path), index
        self.sources = sources or {}  # a parameter built from other checkpoint tensors, or renamed (converted.py)
        self._names: dict[int, str | Stacked] = {}  # key -> checkpoint name, or how to build it
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}  # every (module, attribute) holding it (ties)
        self._slots: dict[tuple[int, str], int] = {}  # (id(module), attribute) -> key: FSDP replaces the object
        self._keys: dict[int, int] = {}  # id(meta parameter) -> key, before sharding
        self._kept: list[nn.Parameter] = []  # the meta parameters, alive so that their ids stay theirs
        self.read_bytes = 0

    def track(self, lm: nn.Module) -> None:
        """Record ``lm``'s meta parameters with their owners; call once its modules are final (after LoRA)."""
        for table in (self._names, self._owners, self._slots, self._keys):
            table.clear()
        self._kept.clear()
        for prefix, module in lm.named_modules(remove_duplicate=False):
            for attr, p in module.named_parameters(recurse=False):
                if p.is_meta:
                    key = self._keys.setdefault(id(p), len(self._kept))
                    if key == len(self._kept):
                        self._kept.append(p)
                    name = f"{prefix}.{attr}" if prefix else attr
                    self._owners.setdefault(key, []).append((module, attr))
                    name = name.replace(_LORA_BASE, ".")
                    self._names.setdefault(key, self.sources.get(name, name))
                    self._slots[(id(module), attr)] = key

    def materialize(self, module: nn.Module, device: torch.device | str = "cpu") -> None:
        """Read ``module``'s deferred parameters from the files (every module holding one gets it), onto ``device``.

        A parameter `fully_shard` already took (a DTensor on the meta device) gets this rank's rows alone, read as
        they lie in the file; FSDP pads and keeps them as its shard (as after ``load_state_dict(assign=True)``).
        Any other gets the whole tensor."""
        from torch.distributed.tensor import DTensor

        for sub in module.modules():
            for attr, p in list(sub._parameters.items()):
                key = self._slots.get((id(sub), attr))
                if p is None or not p.is_meta or key is None or key not in self._names:
                    continue
                name = self._names.pop(key)
                have = name.shape if isinstance(name, Stacked) else self.index.shape(name)
                if have != tuple(p.shape):
                    raise ValueError(f"{self.path}: {name} has shape {have} in the checkpoint, the model expects "
                                     f"{tuple(p.shape)}")
                rows = _shard_rows(p) if isinstance(p, DTensor) else None  # the whole tensor otherwise
                t = self._read(name, p.dtype, rows)  # the model's dtype for it (HF may keep some in fp32)
                self.read_bytes += t.numel() * t.element_size()
                t = t.to(device)
                if isinstance(p, DTensor):
                    t = DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                           run_check=False)
                new = nn.Parameter(t, requires_grad=p.requires_grad)
                for owner, name_in_owner in self._owners.pop(key):
                    setattr(owner, name_in_owner, new)

    def read_rows(self, p: nn.Parameter, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of deferred parameter ``p``, read alone (a vocabulary shard of the embedding);
        ``p`` is then the caller's to replace."""
        key = self._keys[id(p)]
        name = self._names.pop(key)
        self._owners.pop(key, None)
        t = self._read(name, p.dtype, (start, stop))
        self.read_bytes += t.numel() * t.element_size()
        return t

    def _read(self, source: str | Stacked, dtype: torch.dtype, rows: tuple[int, int] | None) -> torch.Tensor:
        if isinstance(source, Stacked):
            return source.read(self.index, dtype, rows)
        return self.index.read(source, dtype) if rows is None else self.index.read_rows(source, *rows, dtype)

    def check_done(self) -> None:
        """Raise if a deferred parameter was never read (a module sharded outside the layers and the root)."""
        if self._names:
            left = sorted(str(n) for n in self._names.values())
            raise RuntimeError(f"{self.path}: {len(left)} deferred weights were never read ({', '.join(left[:3])}"
                               f"{', ...' if len(left) > 3 else ''})")
        self._kept.clear()


def _shard_rows(p) -> tuple[int, int]:
    """``[start, stop)``: the rows of DTensor ``p`` this rank holds, split as FSDP and DTensor split dim 0 (`vocab_rows`:
    chunks of ``ceil(rows / world)``, the last ones short or empty), through each mesh dimension that shards it."""
    start, stop = 0, p.shape[0]
    for dim, placement in enumerate(p.placements):
        if not placement.is_shard():
            continue
        if placement.dim != 0:
            raise ValueError(f"a deferred load reads rows: {placement} of a parameter of shape {tuple(p.shape)} "
                             "is sharded on another dimension")
        first, last = vocab_rows(stop - start, p.device_mesh.size(dim), p.device_mesh.get_local_rank(dim))
        start, stop = start + first, start + last
    return start, stop
