"""HF parameters that transformers builds from other checkpoint tensors while loading, read without loading them.

transformers 5 keeps a MoE layer's experts as one tensor per projection (``mlp.experts.gate_up_proj``:
``[experts, 2 x intermediate, hidden]``; ``mlp.experts.down_proj``), where checkpoints store one tensor per
expert and projection (``mlp.experts.3.gate_proj.weight``). `from_pretrained` fuses them with the conversions of
`transformers.conversion_mapping` (a `WeightConverter`: ``MergeModulelist(dim=0)``, the experts stacked, then
``Concatenate(dim=1)``, gate and up side by side), after any `WeightRenaming` of module names (Mixtral's
``block_sparse_moe`` -> ``mlp``). DeepSeek-V3, GLM-4.5, Qwen3-MoE and Mixtral are converted this way.

`checkpoint_sources` maps each such parameter to a `Stacked` source: which checkpoint tensors build it and how.
A deferred load (fsdp/deferred.py) then reads a parameter, or the rows of dim 0 a rank keeps (its experts), from
those tensors alone. Any conversion other than these two operations, or names it cannot find, leaves the model
to load whole (`from_pretrained`), as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tandem.models.safetensors_read import SafetensorsIndex

__all__ = ["Stacked", "checkpoint_sources"]


@dataclass(frozen=True)
class Stacked:
    """A parameter built as ``cat([stack(part) for part in parts], dim=concat_dim)``: each part one checkpoint
    tensor per expert (dim 0 of the result)."""

    parts: tuple[tuple[str, ...], ...]
    concat_dim: int
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"the {self.shape[0]} experts' {' + '.join(part[0] for part in self.parts)} (...)"

    def read(self, index: SafetensorsIndex, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The parameter, or its experts ``rows = (start, stop)``, read from the experts' tensors alone."""
        start, stop = rows if rows is not None else (0, self.shape[0])
        stacks = [torch.stack([index.read(name, dtype) for name in part[start:stop]])
                  if stop > start else torch.empty((0, *index.shape(part[0])), dtype=dtype) for part in self.parts]
        return stacks[0] if len(stacks) == 1 else torch.cat(stacks, dim=self.concat_dim)


def _plain(pattern: str) -> str | None:
    """A transformers pattern as a plain string ('*' kept for the expert index), or None where it is a regex."""
    unescaped = pattern.replace(r"\.", ".")
    return None if re.search(r"[\\^$()\[\]{}+?|]", unescaped) else unescaped


def _conversions(lm) -> tuple[list[tuple[object, list[str], str, int]], list[tuple[str, str]]] | None:
    """``(converters, renamings)`` that `from_pretrained` would apply to HF model ``lm``: each converter
    ``(the transformers object, source patterns, target pattern, concat dim)``, each renaming ``(checkpoint
    substring, model substring)``; None where a converter is not one this module reads. Renamings given as
    regular expressions (transformers' legacy ones) are left out: a name only they explain is not found."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    converters, renamings = [], []
    for item in get_model_conversion_mapping(lm):
        sources = [_plain(p) for p in item.source_patterns]
        targets = [_plain(p) for p in item.target_patterns]
        if type(item) is WeightRenaming:
            if len(sources) == 1 and len(targets) == 1 and None not in sources + targets:
                renamings.append((sources[0], targets[0]))
            continue
        ops = list(item.operations) if type(item) is WeightConverter else None
        if (not ops or None in sources + targets or len(targets) != 1 or getattr(item, "scope_prefix", None)
                or type(ops[0]) is not MergeModulelist or ops[0].dim != 0):
            return None
        if len(ops) == 1 and len(sources) == 1:
            converters.append((item, sources, targets[0], 1))
        elif len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
            converters.append((item, sources, targets[0], ops[1].dim))
        else:
            return None
    return converters, renamings


def _find(name: str, index: SafetensorsIndex, renamings: list[tuple[str, str]]) -> str | None:
    """``name`` as the checkpoint spells it: itself, or with a renaming undone."""
    if name in index:
        return name
    for before, after in renamings:
        if after in name and name.replace(after, before) in index:
            return name.replace(after, before)
    return None


def checkpoint_sources(lm, index: SafetensorsIndex) -> dict[str, str | Stacked] | None:
    """Where each parameter of HF model ``lm`` comes from: its checkpoint name (renamings undone), or a `Stacked`
    source; None where one of them cannot be found this way (the model then loads whole). The converters used
    are recorded on ``lm`` as `from_pretrained` records them (``_weight_conversions``), so a weight sync names
    the tensors as the checkpoint does (models/hf_names.py)."""
    conv = _conversions(lm)
    if conv is None:
        return None
    converters, renamings = conv
    out: dict[str, str | Stacked] = {}
    used: list[object] = []
    for name, p in lm.named_parameters():
        shape = tuple(p.shape)
        found = _find(name, index, renamings)
        if found is not None and index.shape(found) == shape:
            out[name] = found
            continue
        for converter in converters:
            out[name] = _stacked(name, shape, converter[1:], index, renamings)
            if out[name] is not None:
                used += [converter[0]] if all(c is not converter[0] for c in used) else []
                break
        else:
            return None
    lm._weight_conversions = used
    return out


def _stacked(name: str, shape: tuple[int, ...], converter: tuple[list[str], str, int], index: SafetensorsIndex,
             renamings: list[tuple[str, str]]) -> Stacked | None:
    sources, target, dim = converter
    if not name.endswith(target) or not shape or (not target.startswith(".") and name != target
                                                  and not name.endswith("." + target)):
        return None
    prefix, parts = name[: len(name) - len(target)], []
    for pattern in sources:
        part = tuple(_find(prefix + pattern.replace("*", str(e)), index, renamings) for e in range(shape[0]))
        if None in part or len({index.shape(n) for n in part}) != 1:
            return None
        parts.append(part)
    stacked = [(shape[0], *index.shape(part[0])) for part in parts]
    if any(len(s) != len(shape) for s in stacked):
        return None
    got = list(stacked[0])
    got[dim] = sum(s[dim] for s in stacked)
    if tuple(got) != shape or any(s[:dim] + s[dim + 1:] != stacked[0][:dim] + stacked[0][dim + 1:] for s in stacked):
        return None
    return Stacked(tuple(parts), dim, shape)
