"""LoRA adapters served by the embedded engine, unmerged, several at once, chosen per request.

The base model's weights are never touched. Each linear layer an adapter targets gets a forward hook
that adds the low-rank update of the rows whose request uses that adapter::

    y[rows] = (y[rows] + lora_B(lora_A(x[rows])) * scaling).to(y.dtype)     # scaling = alpha / rank

which is peft's own forward (``LoraLayer``: ``result + lora_B(lora_A(dropout(x))) * scaling`` with the
input cast to the adapter's dtype, then the result cast back), operation for operation. Under the
batch-invariant mode every row of these products has the same bits whatever else is in the batch,
so rollout log-probs equal the LoRA trainer's bit for bit (the exact contract holds for LoRA when the
adapters are synced unmerged, ``sync.lora_mode: adapter``). Merged weights would not: ``W + s·BA``
rounds differently from ``Wx + s·B(Ax)``.

A step's rows are grouped by adapter (`AdapterRows`): one group (the RL case: every request uses the
policy's adapter) costs two small matmuls per targeted layer over all rows; several groups gather
their rows. Rows of requests without an adapter skip the hooks' work entirely.

Outside the batch-invariant mode the engine may fold one adapter, the synced policy's, into its
oneDNN-packed float32 weight copies (``merged``: ``pack(W + s·BA)``, `TorchEngine` "merge_lora"): rows
of that adapter then cost nothing here, and rows of other adapters or of the base model subtract its
update (``- s·B(Ax)``) before adding their own. The plain weights stay the base model's.

Adapters arrive as peft-named tensors (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``,
what `tandem export --adapter-only` writes and `sync.lora_mode: adapter` sends) or as a peft adapter
folder (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tandem.ops.linear import CAN_PACK, linear, pack_into

__all__ = ["Adapter", "AdapterRows", "ServedAdapters", "parse_adapter"]

_PREFIX = "base_model.model."
_SHOWN = 5


@dataclass(kw_only=True, slots=True)
class Adapter:
    name: str
    rank: int
    alpha: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])
    version: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # peft's LoraLayer.update_layer (no rslora)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def parse_adapter(named_tensors: Sequence[tuple[str, torch.Tensor]], linears: dict[str, nn.Linear], *,
                  name: str, alpha: float, max_rank: int) -> Adapter:
    """Check peft-named tensors against the model's linear layers; raise ValueError listing what is wrong
    (nothing is loaded then)."""
    errors: list[str] = []
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, t in named_tensors:
        prefix, _, rest = tensor_name.partition(_PREFIX)
        module, _, part = rest.rpartition(".lora_")
        if prefix or part not in ("A.weight", "B.weight"):
            errors.append(f"{tensor_name!r} is not a peft LoRA tensor name ({_PREFIX}<module>.lora_A.weight)")
        elif module not in linears:
            errors.append(f"{tensor_name}: the model has no linear layer {module!r}")
        elif not t.is_floating_point():
            errors.append(f"{tensor_name}: dtype {t.dtype} is not floating point")
        else:
            parts.setdefault(module, {})[part[0]] = t
    ranks: set[int] = set()
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            errors.append(f"{module}: lora_A and lora_B must come together")
            continue
        a, b = ab["A"], ab["B"]
        out_dim, in_dim = linears[module].weight.shape
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
            errors.append(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                          f"weight {(out_dim, in_dim)}")
            continue
        ranks.add(rank)
        modules[module] = (a, b)
    if len(ranks) > 1:
        errors.append(f"adapters of several ranks {sorted(ranks)} in one adapter")
    elif ranks and max(ranks) > max_rank:
        errors.append(f"rank {max(ranks)} > lora_max_rank={max_rank}")
    if not named_tensors:
        errors.append("no tensors")
    if errors:
        more = f" (+{len(errors) - _SHOWN} more)" if len(errors) > _SHOWN else ""
        raise ValueError(f"LoRA adapter {name!r} rejected, engine untouched: " + "; ".join(errors[:_SHOWN]) + more)
    return Adapter(name=name, rank=ranks.pop(), alpha=float(alpha), modules=modules)


def read_adapter_folder(path: str | Path) -> tuple[list[tuple[str, torch.Tensor]], float]:
    """``(peft-named tensors, lora_alpha)`` of a peft adapter folder."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg_path, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{root} is not a peft adapter folder (needs adapter_config.json and "
                                "adapter_model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_rslora") or cfg.get("use_dora"):
        raise ValueError(f"{root}: only plain LoRA adapters are served (peft_type LORA, no rslora, no DoRA)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{root}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not supported")
    return sorted(load_file(str(weights)).items()), float(cfg["lora_alpha"])


@dataclass(slots=True)
class AdapterRows:
    """One forward's rows by adapter: ``(adapter, row indices or None for all rows, sign)``; sign -1
    removes the ``merged`` adapter's update from rows that do not use it."""

    groups: list[tuple[Adapter, torch.Tensor | None, float]] = field(default_factory=list)

    @classmethod
    def of(cls, names: Sequence[str | None], adapters: dict[str, Adapter], device: torch.device,
           merged: Adapter | None = None) -> AdapterRows:
        if merged is not None:  # rows of the merged adapter need nothing; every other row subtracts it
            keep = merged.name
            names = [None if n == keep else (n if n is not None else _BASE) for n in names]
        if not names or all(n is None for n in names):
            return cls()
        first = names[0]
        if first is not None and all(n == first for n in names):
            return cls(_group(first, None, adapters, merged))
        rows: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                rows.setdefault(n, []).append(i)
        return cls([g for n, r in rows.items()
                    for g in _group(n, torch.tensor(r, dtype=torch.long, device=device), adapters, merged)])


_BASE = "\0base"  # rows without an adapter while one is merged (not a valid adapter name)


def _group(name: str, idx: torch.Tensor | None, adapters: dict[str, Adapter],
           merged: Adapter | None) -> list[tuple[Adapter, torch.Tensor | None, float]]:
    out = [(merged, idx, -1.0)] if merged is not None else []
    return out + ([(adapters[name], idx, 1.0)] if name != _BASE else [])


class ServedAdapters:
    """The adapters an engine serves, and the hooks that apply them (module docstring)."""

    def __init__(self, model: nn.Module, *, max_adapters: int, max_rank: int) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self.adapters: dict[str, Adapter] = {}
        self.merged: Adapter | None = None  # folded into the engine's packed weights (module docstring)
        self._rows = AdapterRows()
        self._hooked: dict[str, torch.utils.hooks.RemovableHandle] = {}

    def add(self, adapter: Adapter) -> None:
        """Serve ``adapter`` (replacing one of the same name). Call between two steps."""
        if adapter.name not in self.adapters and len(self.adapters) >= self.max_adapters:
            raise ValueError(f"LoRA adapter {adapter.name!r} rejected: {len(self.adapters)} adapters are loaded "
                             f"(max_loras={self.max_adapters}: {', '.join(sorted(self.adapters))}); remove one first")
        self.adapters[adapter.name] = adapter
        for module in adapter.modules:
            if module not in self._hooked:
                self._hooked[module] = self.linears[module].register_forward_hook(self._hook(module))

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no LoRA adapter {name!r} is loaded (loaded: {', '.join(sorted(self.adapters)) or 'none'})")
        del self.adapters[name]
        targeted = {m for a in self.adapters.values() for m in a.modules}
        for module in [m for m in self._hooked if m not in targeted]:
            self._hooked.pop(module).remove()

    @contextlib.contextmanager
    def rows(self, names: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """Within this block, the model's forward applies adapter ``names[i]`` to row ``i``."""
        self._rows = AdapterRows.of(names, self.adapters, device, self.merged)
        try:
            yield
        finally:
            self._rows = AdapterRows()

    def _hook(self, module: str):
        def hook(_layer: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            groups = self._rows.groups
            if not groups:
                return None
            x = args[0]
            for adapter, idx, sign in groups:
                ab = adapter.modules.get(module)
                if ab is None:
                    continue
                a, b = ab
                scaling = adapter.scaling * sign
                if idx is None:
                    xa = x if x.dtype == a.dtype else x.to(a.dtype)
                    out = (out + linear(linear(xa, a), b) * scaling).to(out.dtype)
                else:
                    xs = x[idx]
                    xa = xs if xs.dtype == a.dtype else xs.to(a.dtype)
                    out[idx] = (out[idx] + linear(linear(xa, a), b) * scaling).to(out.dtype)
            return out

        return hook


class AdapterMethods:
    """`TorchEngine`'s LoRA methods (`LoRAEngine` and named adapters); the engine holds ``adapters``
    (`ServedAdapters`) and ``_policy_adapter`` (the name `load_lora_adapter` serves by default)."""

    POLICY = "policy"  # the adapter a LoRA run syncs; requests without ``lora`` use it
    BASE = "base"  # ``GenerationRequest.lora = "base"``: the base model, no adapter

    def load_lora_adapter(self, named_tensors, version: int) -> None:
        """`LoRAEngine`: serve these adapter tensors (peft names, ``alpha = config.lora_alpha``) as the
        default adapter of every later request, between two steps; ``weight_version`` becomes ``version``."""
        if self.config.lora_alpha is None:
            raise ValueError("load_lora_adapter: TorchEngineConfig.lora_alpha is not set; set it to the trainer's "
                             "LoRA alpha (a run with sync.lora_mode: adapter fills it in), or send merged weights")
        adapter = parse_adapter(list(named_tensors), self.adapters.linears, name=self.POLICY,
                                alpha=self.config.lora_alpha, max_rank=self.config.lora_max_rank)
        adapter.modules = {m: (a.detach().clone(), b.detach().clone()) for m, (a, b) in adapter.modules.items()}
        adapter.version = int(version)
        with self._between_steps():
            self.train_drafter()  # on the rollouts of the adapter being replaced
            self.adapters.add(adapter)
            self._policy_adapter = self.POLICY
            self._fold_policy()
            self._version = int(version)

    def add_lora_adapter(self, name: str, source, *, alpha: float | None = None) -> None:
        """Serve another adapter under ``name`` (requests pick it with ``lora=name``): a peft adapter folder
        (its ``lora_alpha`` used) or peft-named tensors with ``alpha``."""
        if name in (self.POLICY, self.BASE) or not name or len(name) > 128:
            raise ValueError(f"LoRA adapter name {name!r} is reserved or invalid ({self.POLICY!r} is the synced "
                             f"policy, {self.BASE!r} the base model; 1 to 128 characters)")
        if isinstance(source, str | Path):
            tensors, folder_alpha = read_adapter_folder(source)
            alpha = folder_alpha if alpha is None else alpha
        else:
            tensors = list(source)
            if alpha is None:
                raise ValueError(f"add_lora_adapter({name!r}): tensors need their alpha (alpha=)")
        adapter = parse_adapter(tensors, self.adapters.linears, name=name, alpha=alpha,
                                max_rank=self.config.lora_max_rank)
        dtype = next(iter(self.adapters.linears.values())).weight.dtype
        adapter.modules = {m: (a.to(dtype).contiguous(), b.to(dtype).contiguous())
                           for m, (a, b) in adapter.modules.items()}
        with self._between_steps():
            self.adapters.add(adapter)

    def remove_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; refused while a request in flight uses it."""
        with self._between_steps():
            self._absorb()
            users = [s.request.request_id for s in self._request_states() if self._adapter_of(s.request) == name]
            if users:
                raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} request(s) in flight")
            if name == self._policy_adapter:
                self._policy_adapter = None
                self._fold_policy()
            self.adapters.remove(name)

    def lora_adapters(self) -> dict[str, dict]:
        """The loaded adapters: name -> rank, alpha, targeted modules, bytes, version."""
        return {n: {"rank": a.rank, "alpha": a.alpha, "modules": len(a.modules), "bytes": a.nbytes,
                    "version": a.version} for n, a in self.adapters.adapters.items()}

    def _policy_to_merge(self) -> Adapter | None:
        """The policy adapter where it may be folded into the packed weights: ``merge_lora`` on, not the
        deterministic mode (the exact contract needs the unmerged sum), packed weights (CPU, ``pack_weights``)
        and every targeted weight float32 (in bfloat16, ``W + s·BA`` would round small updates away)."""
        cfg = self.config
        adapter = self.adapters.adapters.get(self._policy_adapter) if self._policy_adapter is not None else None
        if (adapter is None or not cfg.merge_lora or cfg.deterministic or not cfg.pack_weights or not CAN_PACK
                or self.cache.device.type != "cpu"):
            return None
        if any(self.adapters.linears[m].weight.dtype != torch.float32 for m in adapter.modules):
            return None
        return adapter

    def _fold_policy(self, packing: bool = False) -> None:
        """Re-pack the weights the merged adapter and the policy adapter target, so that the packed copies
        hold ``W + s·BA`` for the policy adapter where `_policy_to_merge` allows it and ``W`` elsewhere
        (``ServedAdapters.merged``, module docstring). Between steps; a no-op while nothing is packed."""
        served = self.adapters
        if not (self._packed or packing):
            served.merged = None
            return
        new, old = self._policy_to_merge(), served.merged
        names = set(old.modules if old is not None else ()) | set(new.modules if new is not None else ())
        with torch.no_grad():
            for name in sorted(names):
                w = served.linears[name].weight
                source = self._fold_base(w)  # the base the fold starts from
                if new is not None and name in new.modules:
                    a, b = new.modules[name]
                    source = torch.addmm(source, b.to(w.dtype), a.to(w.dtype), alpha=new.scaling)
                pack_into(self._packed, w, source)  # into the existing packed copy where it can
        served.merged = new

    def _request_states(self) -> list:
        """The requests in the scheduler (running or waiting), once each."""
        states = {id(q.request): q.request for q in self.scheduler.running.values()}
        states |= {id(r): r for r in self.scheduler.waiting}
        return list(states.values())

    def _adapter_of(self, request) -> str | None:
        if request.lora is None:
            return self._policy_adapter
        return None if request.lora == self.BASE else request.lora

    def _check_adapter(self, request) -> str | None:
        """The error message for a request naming an adapter that is not loaded."""
        name = request.lora
        if name is not None and name != self.BASE and name not in self.adapters.adapters:
            loaded = ", ".join(sorted(self.adapters.adapters)) or "none"
            return f"LoRA adapter {name!r} is not loaded (loaded: {loaded}; 'base' = no adapter)"
        return None

    def _row_adapters(self, plan) -> list[str | None] | None:
        """The adapter of every row of a step's forward (decode rows, then prefill chunks); None if no
        adapter is loaded."""
        if not self.adapters.adapters:
            return None
        names = [self._adapter_of(s.request.request) for s in plan.decode]
        for seq, chunk in [*plan.prefill, *((s, c) for s, c, _ in plan.verify)]:
            names += [self._adapter_of(seq.request.request)] * chunk.count
        return names
