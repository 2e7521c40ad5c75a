"""In-process sync: trainer and engine share one process (the colocated default).

No serialisation and no staging copy: the engine copies each trainer tensor straight into its own
existing parameter storage (``update_weights`` validates every name and shape before it writes, so a
rejected update leaves the engine untouched). The only full-model pass is that copy.

`share_frozen_base`: a colocated LoRA run (adapter-only sync) keeps one copy of the frozen base in the process,
the trainer's, which the engine holds as its weights instead of a copy of its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tandem.core.protocols import FrozenBase, FrozenWeights, SharesWeights
from tandem.kernels.config import QuantConfig
from tandem.sync.apply import WeightApplier
from tandem.sync.base import NamedList, SyncError, sync_metrics, tensor_hashes
from tandem.sync.verify import check_reports

__all__ = ["InProcessSync", "frozen_base", "share_frozen_base"]

log = logging.getLogger(__name__)


class InProcessSync:
    """``send(buckets, version)`` -> ``engine.update_weights(all tensors, version)``.

    ``verify``: hash the engine's weights after each sync and compare (`tandem.sync.verify`).
    ``dequantize``: the `QuantConfig` of a quantize-on-send wrapper around this sender
    (`tandem.sync.quantize.QuantizedSender`): the engine receives dequantized weights.
    ``transform``: HF names and layouts -> the engine's (`WeightApplier`), for an engine that needs one.
    """

    def __init__(self, engine: Any, *, verify: bool = False, dequantize: QuantConfig | None = None,
                 transform: Callable[[NamedList], NamedList] | None = None) -> None:
        self.engine = engine
        self.verify = verify
        self.applier = WeightApplier(engine, dequantize=dequantize, transform=transform)

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        # References only: materialising the list costs nothing and lets the engine validate the
        # whole update before it copies anything.
        named = list(itertools.chain.from_iterable(buckets))
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        try:
            report = self.applier(named, version, verify=self.verify)
        except SyncError as e:
            raise SyncError(f"in-process sync to version {version} failed: {e}") from e
        except Exception as e:
            raise SyncError(f"in-process sync to version {version} failed: {type(e).__name__}: {e}") from e
        extra = check_reports(tensor_hashes(named), {"engine": report}, version) if self.verify else {}
        return sync_metrics(nbytes, time.perf_counter() - t0, **extra)

    def close(self) -> None:
        pass


def frozen_base(trainer: Any) -> FrozenBase | None:
    """``trainer``'s frozen base as it holds it (`FrozenWeights`; None for any other trainer or an empty one), for
    an engine to be built on (`tandem.runtime.builders.build_inference_engine`'s ``base``)."""
    if not isinstance(trainer, FrozenWeights):
        return None
    plain, quantized = trainer.frozen_weights()
    return (plain, quantized) if plain or quantized else None


def share_frozen_base(trainer: Any, engine: Any) -> dict[str, float]:
    """Let ``engine`` hold the frozen tensors ``trainer`` keeps (a LoRA base: `FrozenWeights`, `SharesWeights`;
    the engine checks each is equal to its own weight) instead of its own copies.
    For a colocated run whose sync sends the adapters alone: nothing ever writes the base, so one copy serves
    both (SmolLM2-135M in float32: ~540 MB). An engine or trainer without the methods, or a trainer whose
    base is sharded or on a GPU, shares nothing ({})."""
    base = frozen_base(trainer)
    if base is None or not isinstance(engine, SharesWeights):
        return {}
    out = engine.share_weights(*base)
    log.info("the engine holds %d of the trainer's frozen tensors (%.0f MiB) instead of copies, and %d quantized "
             "base weights (%.0f MiB) for its sleep; %d not shared (different values, dtype or layout)",
             out["shared_tensors"], out["shared_mib"], out["quantized_tensors"], out["quantized_mib"], out["skipped"])
    return out
