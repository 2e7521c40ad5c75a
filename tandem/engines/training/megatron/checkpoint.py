"""Checkpoints of the Megatron engine: torch.distributed.checkpoint (DCP), saved atomically.

Megatron's own ``dist_checkpointing.save`` calls ``torch.cuda.synchronize()`` while staging tensors,
so it cannot run on a CPU machine; DCP can, on gloo. Every rank writes its shards under *global*
keys (global Megatron parameter names, ``@tp{r}of{n}`` for tensor-parallel slices): replicas over
data parallelism share a key and DCP writes it once; a ZeRO-sharded optimizer contributes each state
tensor from the one rank that owns it. Resuming therefore needs the same tensor / pipeline / expert
parallel sizes (checked, with a message naming both layouts) but may change the data-parallel size.
To change the model-parallel layout, export HF weights (``tandem export``, `export.export_checkpoint`) and start a
new run from them.

Layout of a checkpoint directory::

    .metadata, __*_*.distcp      DCP: {"model/<key>", "master/<key>" (fp32 masters), "optim/<key>/<state>"}
    schedulers.pt                LR scheduler state (rank 0)
    rng_rank{r}.pt               torch / python / numpy RNG and Megatron's RNG tracker states of rank r
    tandem_checkpoint.json       step, model, layout; written last (its presence marks completeness)

Everything is written into ``.<name>.partial`` and renamed into place once all ranks are done.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tandem.engines.training.common.checkpoint import (
    MARKER,
    partial_dir,
    publish_dir,
    quiet_single_process,
    read_marker,
)

__all__ = ["FORMAT", "load_checkpoint", "read_metadata", "save_checkpoint", "shard_key"]

FORMAT = "tandem-megatron-1"
_ADAM_STATES = ("step", "exp_avg", "exp_avg_sq")


def shard_key(name: str, split: str, expert: bool, tp: tuple[int, int], etp: tuple[int, int]) -> str:
    """The DCP key of one rank's slice of parameter ``name`` (global Megatron name)."""
    rank, size = etp if expert else tp
    if split == "replicated" or size == 1:
        return name
    return f"{name}@tp{rank}of{size}"


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    np_state = np.random.get_state()
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _model_state(
    params: Iterable[tuple[str, torch.nn.Parameter]], masters: dict[int, torch.Tensor]
) -> dict[str, torch.Tensor]:
    state = {f"model/{key}": p.data for key, p in params}
    state.update({f"master/{key}": masters[id(p)] for key, p in params if id(p) in masters})
    return state


def _optim_state(
    params: Iterable[tuple[str, torch.nn.Parameter]], optimizer_state: dict
) -> dict[str, torch.Tensor]:
    out = {}
    for key, p in params:
        for name, value in optimizer_state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{key}/{name}"] = value
    return out


def save_checkpoint(
    path: str | Path,
    *,
    params: list[tuple[str, torch.nn.Parameter]],
    owned: set[int],
    optimizer_state,
    masters: dict[int, torch.Tensor],
    schedulers: list[dict],
    rank: int,
    metadata: dict[str, Any],
) -> Path:
    """Save this rank's shards (collective). ``params``: (key, parameter); ``owned``: ids of the parameters
    whose optimizer state this rank holds; ``optimizer_state``: param -> AdamW state; ``masters``: param id
    -> fp32 master weight (low-precision parameters)."""
    import torch.distributed.checkpoint as dcp

    final = Path(path).absolute()
    tmp = partial_dir(final)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _model_state(params, masters)
    state.update(_optim_state([(k, p) for k, p in params if id(p) in owned], optimizer_state))
    with quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        torch.save(schedulers, tmp / "schedulers.pt")
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, **metadata}, indent=2))
        publish_dir(tmp, final)
    dist.barrier()
    return final


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a finished Megatron checkpoint; raises FileNotFoundError for anything else."""
    return read_marker(path, FORMAT, what="a Megatron engine checkpoint")


def load_checkpoint(
    path: str | Path,
    *,
    params: list[tuple[str, torch.nn.Parameter]],
    owned: set[int],
    optimizer_state,
    masters: dict[int, torch.Tensor],
    layout: dict[str, int],
    rank: int,
) -> dict[str, Any]:
    """Restore weights (in place), this rank's optimizer state and RNG; returns metadata incl. schedulers."""
    import torch.distributed.checkpoint as dcp

    meta = read_metadata(path)
    saved = {k: meta["layout"][k] for k in layout}
    if saved != layout:
        raise ValueError(
            f"{path}: saved with parallel layout {saved}, this engine runs {layout}; tensor/pipeline/expert "
            "parallel sizes must match (tandem export writes HF weights to start another layout from)"
        )
    state = _model_state(params, masters)
    if meta.get("has_optimizer_state"):
        for key, p in params:
            if id(p) not in owned:
                continue
            slot = optimizer_state.setdefault(p, {})
            for name in _ADAM_STATES:
                if name not in slot:
                    like = masters.get(id(p), p)
                    slot[name] = (
                        torch.zeros((), dtype=torch.float32, device=p.device)
                        if name == "step"
                        else torch.zeros_like(like)
                    )
                state[f"optim/{key}/{name}"] = slot[name]
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    rng_file = Path(path) / f"rng_rank{rank}.pt"
    if rng_file.is_file():  # a different data-parallel size resumes with fresh RNG on new ranks
        _set_rng_state(torch.load(rng_file, weights_only=True))
    meta["schedulers"] = torch.load(Path(path) / "schedulers.pt", weights_only=True)
    return meta
