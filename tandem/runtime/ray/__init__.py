"""``runtime.placement: ray``: the trainer ranks and N inference replicas as Ray actors (docs/ray.md).

The driver (``tandem train``) only orchestrates: it holds actor handles, versions and the data position;
weights live in the trainer ranks, the replicas and the object store. `RayPlacement` builds the
placement group, the trainer actor group (`RayTrainerGroup`, the loop's training engine) and the
replicas behind a `tandem.runtime.router.Router` (the loop's inference engine), and syncs weights from
trainer rank 0 to every replica through the object store. Ray is imported only here, when a run asks
for this placement.
"""

from __future__ import annotations

from typing import Any

__all__ = ["import_ray"]


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"runtime.placement: ray needs Ray ({e}): pip install 'tandem-rl[ray]'") from e
    return ray
