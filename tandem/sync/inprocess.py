"""In-process sync: trainer and engine share one process (the colocated default).

No serialisation and no staging copy: the engine copies each trainer tensor straight into its own
existing parameter storage (``update_weights`` validates every name and shape before it writes).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch

from tandem.core.protocols import InferenceEngine
from tandem.sync.base import SyncError


class InProcessSync:
    """``send(buckets, version)`` -> ``engine.update_weights(all tensors, version)``."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        # References only: materialising the list costs nothing and lets the engine validate the
        # whole update before it copies anything.
        named = list(itertools.chain.from_iterable(buckets))
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        try:
            self.engine.update_weights(named, version)
        except Exception as e:
            raise SyncError(f"in-process sync to version {version} failed: {e}") from e
        dt = time.perf_counter() - t0
        return {"sync/bytes": float(nbytes), "sync/seconds": dt, "sync/gbps": nbytes / max(dt, 1e-9) / 1e9}

    def close(self) -> None:
        pass
