"""The engine side of every transport: apply one whole, checked update to an inference engine.

`WeightApplier(engine)` is what a receiver calls with a staged update. Before it touches the engine
it enforces the sync rules that do not depend on the transport:

* **Versions never go backwards**: an update older than the engine's ``weight_version`` is rejected
  (a re-sent equal version is allowed: resuming a run re-sends its checkpoint's version).
* **LoRA adapters**: an adapter-only update (peft names, ``...lora_A.weight``) goes to the engine's
  ``load_lora_adapter(named_tensors, version)`` where its ``info.lora_adapters`` says it has one; an
  engine without it rejects the update with a message saying to send merged weights
  (``sync.lora_mode: merged``). Adapter and full tensors are never mixed in one update.
* **Quantize-on-send**: with ``dequantize=QuantConfig``, fp8/int4 tensors and their scales are turned
  back into the engine's dtype with `tandem.kernels.dequantize_state_dict`, the op the trainer's
  fake-quantized forward uses, so the engine holds exactly the trainer's forward weights. Without it a
  quantized update is rejected with a message naming the missing config.

* **Name / layout mapping**: ``transform(named_tensors) -> named_tensors`` turns HF-named tensors into
  the engine's own (e.g. fusing ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj``); it sees the
  whole staged update at once. Whoever builds the applier passes it.

Then ``engine.update_weights`` validates every name and shape before copying anything, so a rejected
update leaves the engine on its previous weights and version. With ``verify`` the applier hashes the
engine's weights afterwards (`tandem.sync.verify`), against the mapped tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from tandem.core.protocols import LoRAEngine
from tandem.kernels.config import QuantConfig
from tandem.kernels.state_dict import COMPANION_SUFFIXES, FP8_DTYPE, dequantize_state_dict
from tandem.models.registry import DTYPES
from tandem.sync.base import NamedList, SyncError, tensor_hashes
from tandem.sync.verify import verify_applied

__all__ = ["WeightApplier", "call_apply", "is_adapter_name"]


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter tensor (peft naming: ``.lora_A.``, ``.lora_B.``, ...)."""
    return ".lora_" in name


def _looks_quantized(named: NamedList) -> str | None:
    """A tensor that only a quantized update holds: fp8 codes, or a scale/packed/zero-point companion
    sent next to its weight (a weight merely named ``..._scale`` does not count)."""
    names = {n for n, _ in named}
    for name, t in named:
        if t.dtype == FP8_DTYPE:
            return name
        for suffix in COMPANION_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and (base in names or f"{base}_packed" in names):
                return name
    return None


def _example(names: list[str]) -> str:
    return f"{len(names)} tensor(s), e.g. {names[0]!r}"


class WeightApplier:
    """``applier(named_tensors, version, verify=False) -> report | None`` for one engine.

    ``dequantize``: the `QuantConfig` of quantize-on-send (the trainer's); ``dtype``: what to
    dequantize into (default: the engine's ``info.dtype``); ``transform``: HF names and layouts -> the
    engine's (default: none).
    """

    def __init__(
        self,
        engine: Any,
        *,
        dequantize: QuantConfig | None = None,
        dtype: torch.dtype | None = None,
        transform: Callable[[NamedList], NamedList] | None = None,
    ):
        self.engine = engine
        self.dequantize = dequantize
        self.dtype = dtype
        self.transform = transform
        # one update at a time: the version check and the update are one step, also when two receivers
        # (a failover pair, tandem.sync.failover) apply through this applier from two threads
        self._lock = threading.Lock()

    def __call__(self, named: NamedList, version: int, *, verify: bool = False) -> dict[str, Any] | None:
        with self._lock:
            return self._apply(named, version, verify=verify)

    def _apply(self, named: NamedList, version: int, *, verify: bool) -> dict[str, Any] | None:
        engine = self.engine
        current = int(engine.weight_version)
        if version < current:
            raise SyncError(
                f"update to version {version} is older than the engine's version {current} (versions never "
                "go backwards): rejected, weights untouched"
            )
        adapters = [n for n, _ in named if is_adapter_name(n)]
        if adapters:
            self._load_adapter(named, adapters, version)
            return None
        applied = self._dequantized(named, version)
        if self.transform is not None:
            try:
                applied = list(self.transform(applied))
            except Exception as e:
                raise SyncError(f"mapping the update to version {version} failed: {type(e).__name__}: {e}; "
                                "weights untouched") from e
        try:
            engine.update_weights(applied, version)
        except Exception as e:
            raise SyncError(f"{type(engine).__name__} rejected the update to version {version}: {e}") from e
        return verify_applied(engine, applied, named) if verify else None

    def _load_adapter(self, named: NamedList, adapters: list[str], version: int) -> None:
        engine = self.engine
        if len(adapters) != len(named):
            full = [n for n, _ in named if not is_adapter_name(n)]
            raise SyncError(
                f"update to version {version} mixes LoRA adapter tensors ({_example(adapters)}) with full "
                f"weights ({_example(full)}): send one or the other; weights untouched"
            )
        if not engine.info.lora_adapters:
            raise SyncError(
                f"update to version {version} holds LoRA adapter tensors only ({_example(adapters)}), but "
                f"{engine.info.name} cannot load adapters (its info.lora_adapters is false): send merged "
                f"weights instead (sync.lora_mode: merged). The engine kept version {engine.weight_version} "
                "and its weights"
            )
        lora: LoRAEngine = engine
        lora.load_lora_adapter(named, version)

    def _dequantized(self, named: NamedList, version: int) -> NamedList:
        if self.dequantize is None:
            quantized = _looks_quantized(named)
            if quantized is not None:
                raise SyncError(
                    f"update to version {version} is quantized ({quantized!r}) but this receiver has no "
                    "dequantize config: give the engine side the trainer's sync.quantize; weights untouched"
                )
            return named
        dtype = self.dtype or _engine_dtype(self.engine)
        try:
            return list(dequantize_state_dict(named, self.dequantize, dtype).items())
        except ValueError as e:
            raise SyncError(f"update to version {version} cannot be dequantized: {e}; weights untouched") from e


def _engine_dtype(engine: Any) -> torch.dtype:
    return DTYPES.get(engine.info.dtype, torch.float32)


def call_apply(apply: Callable[..., Any], named: NamedList, version: int, *, verify: bool) -> dict[str, Any] | None:
    """Call a receiver's ``apply``: a `WeightApplier`, an engine's bound ``update_weights``, or any
    ``fn(named, version)``. With ``verify`` the result is a verify report; a plain function's report
    says its engine weights could not be checked (the sender's verify then fails, as it should)."""
    if isinstance(apply, WeightApplier):
        return apply(named, version, verify=verify)
    result = apply(named, version)
    if not verify:
        return result if isinstance(result, dict) else None
    owner = getattr(apply, "__self__", None)
    reason = "the receiver applies through a plain function, not an engine"
    if owner is not None:
        try:
            return verify_applied(owner, named, named)
        except SyncError as e:
            reason = str(e)
    return {"received": tensor_hashes(named), "mismatched": [f"engine weights not checked: {reason}"]}
