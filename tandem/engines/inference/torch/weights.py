"""`TorchEngine`'s weight path: live updates from a trainer and the packed copies the step reads.

`update_weights` checks a whole update before copying any of it, then copies each tensor into the live
weight in place, between two steps; where a weight has a packed copy (oneDNN's blocked layout, built by
`tandem.ops.linear.pack_weights`), one pass of the native kernel writes the plain and the packed copy
together (`copy_and_repack`), else the packed copy is rebuilt after the plain one is written. A mixin of
`tandem.engines.inference.torch.engine.TorchEngine`, like `AdapterMethods` and `ScoringMethods`: the
engine holds ``model``, ``config``, ``cache``, ``adapters``, ``_weights``, ``_packed``, ``_freed``, ``_quant``,
``_policy_adapter``, ``_version``, ``_shared``, ``_frozen_quant`` and ``_between_steps``.

With ``sleep_frees_weights``, `sleep` drops the packed copy of every packed-only weight but one per shape
and dtype, which stays as the layout template, and records each in ``_freed`` (weight id -> template); an
update that writes one gets new memory in that layout (`packed_like`), packs into it and takes it off. Until
every freed weight is rewritten, `wake_up`, ``score``, `named_weights` of it and a plain copy of it are refused
(`EngineAsleepError`, naming the weights).

With ``quantization`` (a QLoRA base, a QAT policy), `sleep` also stores every targeted weight that still has a
plain copy as its quantized tensors (FP8 + scales: a quarter of float32) where they give back exactly the same
bits (`AsleepQuantizedWeight`; ``_asleep``: weight id -> (name, weight, tensors)). Where the steps read packed
copies (CPU, ``pack_weights``) such a weight stays held quantized after `wake_up`: its packed copy is built from
its dequantized values, one weight at a time, and an adapter fold dequantizes it for the fold alone; its plain
copy comes back, dequantized, only for what reads the plain values (`named_weights`, an update, `score` while
asleep), and on other devices at `wake_up`. A merged LoRA engine kept a plain float32 copy of every targeted
weight (the base its fold starts from); a QLoRA engine now holds its base in the format's bits throughout.

`share_weights` (a colocated LoRA run, `tandem.sync.inprocess.share_frozen_base`): the engine holds the trainer's
frozen base tensors as its weights (``_shared``: their ids) instead of its own copies, after checking they are
equal, element for element; a quantized engine records a QLoRA base's quantized tensors (``_frozen_quant``) and
holds those while asleep instead of quantizing its own copy. Adapter-only sync never writes the base; an update
that writes a shared weight gives it its own memory first (copy-on-write) and forgets its quantized tensors.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping

import numpy as np
import torch

from tandem.core.protocols import EngineAsleepError, NamedTensors
from tandem.kernels.state_dict import dequantize_tensor, find_quantized, quantize_tensor
from tandem.ops.linear import (
    CAN_PACK,
    PackedOnlyWeight,
    copy_and_repack,
    drop_plain,
    pack_into,
    pack_weights,
    packed_like,
    packs_in_place,
    repack,
    restore_plain,
)

__all__ = ["AsleepQuantizedWeight", "WeightMethods"]


class AsleepQuantizedWeight(PackedOnlyWeight):
    """A weight stored quantized since the engine slept (its values: ``dequantize_tensor`` of the engine's
    record, and, awake, its packed copy); shape and dtype answer, `fast_linear` runs its packed copy, every
    other operation raises until the engine gives it back."""

    refusal = ("a weight the engine holds quantized (its values: its packed copy, or its quantized tensors while "
               "asleep): named_weights() gives its values back")


class _UnpackOnRead(Mapping):
    """The engine's weights by name; a packed-only weight is unpacked from its packed copy at each read."""

    def __init__(self, weights: dict[str, torch.Tensor], packed: dict, freed: Mapping[int, torch.Tensor]) -> None:
        self._weights, self._packed, self._freed = weights, packed, freed

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self._weights[name]
        if id(w) in self._freed:
            raise EngineAsleepError(f"{name}: its memory was freed while the engine sleeps (sleep_frees_weights) "
                                    "and no update has rewritten it yet")
        return self._packed[id(w)].to_dense() if w.is_meta else w.detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


_PARALLEL_COPY_BYTES = 8 << 20


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same device and the same values, element for element."""
    return a.device == b.device and torch.equal(a, b)


def _same_tensors(a: Mapping[str, torch.Tensor] | None, b: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``a`` and ``b`` hold the same tensors (the same memory under the same names)."""
    return a is not None and a.keys() == b.keys() and all(
        a[k].data_ptr() == b[k].data_ptr() and a[k].shape == b[k].shape for k in a)


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into ``target`` in place. Same-dtype CPU tensors under 8 MiB go through numpy:
    measured under load, 272 per-tensor torch ``copy_`` calls (each an OpenMP region) ran at 2.6 GB/s
    against 8.6 GB/s for ``np.copyto``; larger ones (an embedding) through torch's copy on all threads
    (SmolLM2's 113 MB embedding: 9.0 ms against 13.9 ms for numpy's single-threaded copy)."""
    src = source.detach()
    if (target.device.type == src.device.type == "cpu" and target.dtype == src.dtype
            and target.dtype != torch.bfloat16 and target.is_contiguous() and src.is_contiguous()
            and target.numel() * target.element_size() < _PARALLEL_COPY_BYTES):
        np.copyto(target.numpy(), src.numpy())
    else:
        target.copy_(src)


class WeightMethods:
    """`TorchEngine`'s ``update_weights`` and the packing of its weights (see the module docstring)."""

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy HF-named tensors into the live weights in place, between two steps.

        Every tensor is checked (known name, same shape, floating point) before any is copied, so a bad
        update leaves the weights untouched. A partial update (one bucket of many) is allowed. With
        ``quantization``, targeted weights are stored dequantized (`tandem.kernels.load`): quantized
        tensors + scales are dequantized, full-precision ones quantized then dequantized, and ones the
        sync layer already dequantized on the same grid are kept as they are.
        """
        items = self._incoming(list(named_tensors), version)
        errors = []
        for name, tensor in items:
            target = self._weights.get(name)
            if target is None:
                errors.append(f"unknown weight {name!r}")
            elif tuple(tensor.shape) != tuple(target.shape):
                errors.append(f"{name}: shape {tuple(tensor.shape)} != engine shape {tuple(target.shape)}")
            elif not tensor.is_floating_point():
                errors.append(f"{name}: dtype {tensor.dtype} is not floating point")
            elif self._quant is not None and (problem := self._quant.problem(name, tensor)):
                errors.append(problem)
        if errors:
            more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
            raise ValueError(
                f"update_weights(version={version}) rejected, weights untouched: "
                + "; ".join(errors[:5])
                + more
            )
        with self._between_steps(), torch.no_grad():
            self.train_drafter()  # the draft head learns the weights that produced its rollouts, before they change
            self._restore_asleep()  # written in place below
            stale = []
            for name, tensor in items:
                target = self._weights[name]
                self._own(target)  # a shared frozen tensor is the trainer's: never written here
                source = tensor if self._quant is None else self._quant.served(name, tensor, target.dtype)
                if type(target) is PackedOnlyWeight:  # the packed copy is the weight
                    template = self._freed.get(id(target))
                    if template is not None:  # freed at sleep: new memory in its layout (what the trainer freed)
                        self._packed[id(target)] = packed_like(template)
                    pack_into(self._packed, target, source.detach().to(target.dtype).contiguous())
                    self._freed.pop(id(target), None)  # rewritten: whole again
                elif not copy_and_repack(self._packed, target, source):  # one pass into both copies, in place
                    _copy_into(target, source)
                    stale.append(target)
            repack(self._packed, stale)
            if self._policy_adapter is not None:  # full weights replace the synced adapter (as vLLM does)
                policy, self._policy_adapter = self._policy_adapter, None
                self._fold_policy()  # packed copies it was merged into go back to the (new) plain weights
                self.adapters.remove(policy)
            self._version = int(version)

    def _incoming(self, items: list, version: int) -> list:
        """``items`` with quantized tensors + companions dequantized (needs ``quantization``)."""
        try:
            if self._quant is not None:
                return self._quant.unpack(items, self.model.dtype)
            quantized = find_quantized(items)
            if quantized is not None:
                raise ValueError(f"{quantized!r} is a quantized tensor but TorchEngineConfig.quantization is not set")
        except ValueError as e:
            raise ValueError(f"update_weights(version={version}) rejected, weights untouched: {e}") from e
        return items

    def _packs(self) -> bool:
        """Whether the steps read oneDNN-packed weight copies (CPU, ``pack_weights``)."""
        return bool(self.config.pack_weights and self.cache.device.type == "cpu" and CAN_PACK)

    def _pack(self) -> None:
        if self.config.pack_weights and self.cache.device.type == "cpu":
            merge = self._policy_to_merge()  # its weights are packed once, merged, by _fold_policy
            skip = frozenset(id(self.adapters.linears[m].weight) for m in merge.modules) if merge else frozenset()
            skip |= self._unpacked_head()
            self._packed.update(pack_weights(self.model, skip=skip))  # packed-only weights kept theirs
            for key in [k for k in self._asleep if k not in skip and k not in self._packed]:
                pack_into(self._packed, self._asleep[key][1], self._held_value(key))  # held quantized: one at a time
            self.adapters.merged = None
            self._fold_policy(packing=True)
            self._drop_plain()

    def _unpacked_head(self) -> frozenset[int]:
        """``{id}`` of the vocabulary projection's weight when it is the input embedding's tensor and
        ``pack_tied_head`` is off (it then stays plain only: the lookup needs that copy anyway), else empty."""
        if self.config.pack_tied_head:
            return frozenset()
        head = getattr(self.model, "lm_head", None)
        embed = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if head is None or embed is None or head.weight is not embed.weight:
            return frozenset()
        return frozenset({id(head.weight)})

    def _drop_plain(self) -> None:
        """Free the plain copy of every packed linear weight of the decoder layers (`drop_plain`) unless
        ``keep_plain_weights`` or the model was passed in; not those a merged LoRA adapter ever targeted (their plain copy is the base
        the fold starts from), nor those a sync cannot pack in place (`packs_in_place`: shapes whose rows are
        not a multiple of 64; each sync would allocate anew). So a packed-only weight's packed copy always
        holds exactly the weight, and a sync writes it where it is."""
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if self.config.keep_plain_weights or not self._owns_model or layers is None:
            return  # a model the caller passed in (``model=``) is theirs: its values stay readable
        for module in layers.modules():
            w = getattr(module, "weight", None)
            if (isinstance(module, torch.nn.Linear) and w is not None and not w.is_meta and id(w) in self._packed
                    and id(w) not in self._plain_needed and packs_in_place(w)):
                drop_plain(w)

    def _plain(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with its values, kept from now on: a packed-only one gets its plain copy back (between
        steps, while its packed copy still holds exactly the weight)."""
        if id(weight) in self._freed:
            self._check_weights_held("restoring a plain weight")
        if id(weight) in self._asleep:
            self._restore_asleep()
        if weight.is_meta:
            restore_plain(weight, self._packed[id(weight)])
        self._plain_needed.add(id(weight))
        return weight

    def _release_packed(self) -> None:
        """Sleep: drop the packed copies that a plain copy can rebuild (packed-only weights keep theirs)."""
        packed_only = {id(w) for w in self._weights.values() if w.is_meta}
        for key in [k for k in self._packed if k not in packed_only]:
            del self._packed[key]

    def _free_weights(self) -> None:
        """Sleep with ``sleep_frees_weights``: drop the packed copy of every packed-only weight but the first
        of each shape and dtype (kept whole, the layout the others get back), so the allocator hands their
        memory to the trainer's step, and the sync after it takes the memory for them from what the step freed.
        (Returning the pages to the system instead, ``madvise``, kept the allocation: the sync faulted fresh
        pages in while the allocator still held the step's, and the process peaked nearly as high.)"""
        templates: dict[tuple, torch.Tensor] = {}
        for w in {id(w): w for w in self._weights.values()}.values():  # tied names once
            if type(w) is not PackedOnlyWeight or id(w) in self._freed:
                continue
            key = (tuple(w.shape), w.dtype)
            if key not in templates:
                templates[key] = self._packed[id(w)]
            else:
                self._freed[id(w)] = templates[key]
                del self._packed[id(w)]

    @torch.no_grad()
    def _quantize_asleep(self) -> None:
        """Sleep of a quantized engine: each targeted weight with a plain copy becomes its quantized tensors
        (``_asleep``: weight id -> (name, weight, tensors)) where dequantizing them gives its bits back exactly;
        a format whose second quantization moves values (int4_asym) keeps the float copy. A weight whose
        tensors a colocated trainer holds (``_frozen_quant``) takes those, packed-only or not (its packed copy
        is freed too; wake_up packs it again)."""
        if self._quant is None:
            return
        for name, w in self._weights.items():
            if name not in self._quant.weight_names:
                continue
            if id(w) in self._asleep:  # held quantized while awake too: its packed copy goes, wake_up packs it again
                self._packed.pop(id(w), None)
                continue
            tensors = self._frozen_quant.get(id(w))  # the trainer's, checked equal at share_weights
            if w.is_meta:  # packed-only: its packed copy goes too where the trainer's tensors hold its values
                if tensors is None or id(w) in self._freed:
                    continue
                del self._packed[id(w)]
            elif tensors is None:
                tensors = dict(quantize_tensor(name, w.detach(), self._quant.cfg))
                if not torch.equal(dequantize_tensor(name, tensors, self._quant.cfg, w.dtype), w.detach()):
                    continue
            self._hold_quantized(name, w, tensors)

    def _hold_quantized(self, name: str, w: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Hold weight ``w`` as its quantized ``tensors`` (`_asleep`), its own memory freed."""
        self._asleep[id(w)] = (name, w, tensors)
        torch.utils.swap_tensors(w, AsleepQuantizedWeight(
            torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False))

    @torch.no_grad()
    def _restore_asleep(self, keep: Container[int] = ()) -> None:
        """Give every weight `_quantize_asleep` stored, but those whose ids are in ``keep``, its plain copy back
        (the same bits)."""
        for key in [k for k in self._asleep if k not in keep]:
            name, w, _ = self._asleep[key]
            value = self._held_value(key)
            del self._asleep[key]
            torch.utils.swap_tensors(w, torch.nn.Parameter(value, requires_grad=False))

    def _held_value(self, key: int) -> torch.Tensor:
        """The values of a weight held quantized (``_asleep[key]``), dequantized into a new tensor."""
        name, w, tensors = self._asleep[key]
        try:
            value = dequantize_tensor(name, tensors, self._quant.cfg, w.dtype)
        except (KeyError, ValueError, RuntimeError) as e:  # tensors given at build (`_hold_given`) of another format
            raise ValueError(f"{name}: its quantized tensors are not {self._quant.cfg.format}'s: {e}") from None
        if value.shape != w.shape:
            raise ValueError(f"{name}: its quantized tensors dequantize to shape {tuple(value.shape)}, the weight "
                             f"is {tuple(w.shape)}")
        return value

    def _fold_base(self, weight: torch.Tensor) -> torch.Tensor:
        """The base values an adapter fold starts from: a weight held quantized stays so where the steps read
        packed copies (its values dequantized for this fold only); any other gets a plain copy (`_plain`)."""
        if id(weight) in self._asleep and self._packs():
            return self._held_value(id(weight))
        return self._plain(weight)

    def _own_given(self, given: dict[str, torch.Tensor], names: Container[str]) -> None:
        """Give each weight named in ``names`` that views a tensor of ``given`` (the ``base`` it was built on) a
        copy of its own, and forget it in ``given``: it is about to be written."""
        for name in [n for n in given if n in names]:
            t = given.pop(name)
            w = self.model.get_parameter(name)
            if w.data_ptr() == t.data_ptr():
                torch.utils.swap_tensors(w, torch.nn.Parameter(t.clone(), requires_grad=False))

    def _hold_given(self, given: Mapping[str, torch.Tensor], held: Mapping[str, dict[str, torch.Tensor]]) -> None:
        """Record what the engine was built on (a colocated trainer's frozen base, the ``base`` of ``__init__``)
        as `share_weights` would: the weights that view a tensor of ``given`` as shared (copy-on-write, their
        plain copy kept: it costs nothing); each weight left unallocated for ``held`` (quantized tensors) as held
        quantized on them, as a sleeping engine holds it (`_quantize_asleep`): `_pack` packs it from its values.
        Raises ValueError for quantized tensors of a weight this engine does not quantize (`_held_value`, for
        tensors of another format or shape, when `_pack` or `_restore_asleep` first reads them)."""
        for name, w in self._weights.items():
            t = given.get(name)
            if t is not None and w.data_ptr() == t.data_ptr():
                self._shared.add(id(w))
                self._plain_needed.add(id(w))
        for name, tensors in held.items():
            w = self._weights.get(name)
            if w is None or not w.is_meta or self._quant is None or name not in self._quant.weight_names:
                raise ValueError(f"base: quantized tensors for {name} which this engine does not quantize "
                                 f"(quantization={self.config.quantization})")
            self._frozen_quant[id(w)] = tensors
            self._hold_quantized(name, w, tensors)

    @torch.no_grad()
    def share_weights(self, named: Iterable[tuple[str, torch.Tensor]],
                      quantized: Iterable[tuple[str, Mapping[str, torch.Tensor]]] = ()) -> dict[str, float]:
        """Hold tensors that a colocated trainer keeps frozen (a LoRA run's base) as the weights of the same
        HF names instead of copies: each weight then views that tensor's memory and its own copy is freed.
        ``named``: (name, tensor) of the weight's shape, dtype and device, contiguous and equal to it element
        for element. ``quantized`` (a quantized engine only): (name, the weight's quantized tensors as
        `tandem.kernels.state_dict.quantize_tensor` names them) of a QLoRA base; where they dequantize to
        exactly the weight's values, sleep holds them instead of quantizing a copy of its own. Anything else
        is skipped and counted. Copy-on-write: an update that writes a shared weight gives it its own memory
        first. The caller must not write the tensors (a frozen base is never written by the trainer).
        Returns counts and MiB shared."""
        out = {"shared_tensors": 0.0, "shared_mib": 0.0, "quantized_tensors": 0.0, "quantized_mib": 0.0,
               "skipped": 0.0}
        with self._between_steps():
            self._check_weights_held("share_weights()")
            self._restore_asleep(keep=self._frozen_quant)  # held on the trainer's tensors already: they stay so
            counted: set[int] = set()  # storages counted (a tied alias, weights built on them: `_hold_given`)
            for name, tensor in named:
                w = self._weights.get(name)
                t = tensor.detach()
                if w is not None and id(w) in self._shared and w.data_ptr() == t.data_ptr():
                    if t.data_ptr() not in counted:  # already held: built on it, or a tied alias
                        counted.add(t.data_ptr())
                        out["shared_tensors"] += 1
                        out["shared_mib"] += t.numel() * t.element_size() / 2**20
                    continue
                if (w is None or id(w) in self._shared or id(w) in self._asleep or t.shape != w.shape
                        or t.dtype != w.dtype or not t.is_contiguous() or not _equal(self._value(w), t)):
                    out["skipped"] += 1
                    continue
                torch.utils.swap_tensors(w, torch.nn.Parameter(t, requires_grad=False))
                counted.add(t.data_ptr())
                self._shared.add(id(w))
                self._plain_needed.add(id(w))  # its plain copy costs nothing: `_drop_plain` keeps it
                out["shared_tensors"] += 1
                out["shared_mib"] += t.numel() * t.element_size() / 2**20
            for name, tensors in quantized:
                w = self._weights.get(name)
                tensors = {k: v.detach() for k, v in tensors.items()}
                if w is not None and _same_tensors(self._frozen_quant.get(id(w)), tensors):  # held on them already
                    out["quantized_tensors"] += 1
                    out["quantized_mib"] += sum(v.numel() * v.element_size() for v in tensors.values()) / 2**20
                    continue
                if (self._quant is None or w is None or name not in self._quant.weight_names
                        or not self._dequantizes_to(name, tensors, w)):
                    out["skipped"] += 1
                    continue
                self._frozen_quant[id(w)] = tensors
                out["quantized_tensors"] += 1
                out["quantized_mib"] += sum(v.numel() * v.element_size() for v in tensors.values()) / 2**20
        return out

    def _value(self, w: torch.Tensor) -> torch.Tensor:
        """``w``'s values (a packed-only weight's unpacked into a new tensor)."""
        return self._packed[id(w)].to_dense() if w.is_meta else w.detach()

    def _dequantizes_to(self, name: str, tensors: dict[str, torch.Tensor], w: torch.Tensor) -> bool:
        try:
            value = dequantize_tensor(name, tensors, self._quant.cfg, w.dtype)
        except (KeyError, ValueError, RuntimeError):  # another format's tensors
            return False
        return value.shape == w.shape and _equal(value, self._value(w))

    def _own(self, w: torch.Tensor) -> None:
        """Before ``w`` is written: a shared weight gets memory of its own (its values are about to be
        overwritten whole), and quantized tensors recorded for it no longer hold its values."""
        self._frozen_quant.pop(id(w), None)
        if id(w) in self._shared:
            self._shared.discard(id(w))
            torch.utils.swap_tensors(w, torch.nn.Parameter(torch.empty_like(w), requires_grad=False))

    def _check_weights_held(self, what: str) -> None:
        """Refuse ``what`` while a weight that sleep freed has not been rewritten (names the first few)."""
        if not self._freed:
            return
        names = sorted({n for n, w in self._weights.items() if id(w) in self._freed})
        more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        raise EngineAsleepError(
            f"{what} refused: {len(self._freed)} weight(s) freed at sleep (inference.torch.sleep_frees_weights) "
            f"have not been rewritten since: {', '.join(names[:3])}{more}; send a full weight update first, or "
            "set sleep_frees_weights: false to keep them while asleep")

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """The live weights by HF name (`WeightsView`; tied weights appear under both names). A read-only
        mapping: a packed-only weight is unpacked into a new tensor (exact) when it is read, so a caller
        that reads a few names (``sync.verify``, one bucket at a time) does not unpack the whole model.
        Weights a sleeping engine holds quantized get their plain copies back first."""
        self._restore_asleep()
        return _UnpackOnRead(self._weights, self._packed, self._freed)
