"""Checkpoints: DCP save/load of sharded models and optimizers, atomically; export to an HF folder.

Layout of a checkpoint directory::

    .metadata, __*_*.distcp      torch.distributed.checkpoint: {role: {"model", "optim"}} (sharded)
    schedulers.pt                LR scheduler state per role (rank 0)
    rng_rank{r}.pt               torch / CUDA / python / numpy RNG state of rank r
    tandem_checkpoint.json       step, model, LoRA settings; written last

Atomicity: everything is written into ``.<name>.partial`` next to the target and renamed into place
only after every rank has finished and the files are flushed to disk. A crash mid-save leaves at
most a ``.partial`` directory, never a directory that `load` accepts: `load` requires
``tandem_checkpoint.json``, which only a finished save contains. All ranks must see the same file
system (a shared one across nodes).

With LoRA only the trainable (adapter) weights are saved; the frozen base is re-read from the model
folder named in the metadata. Checkpoint files are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.engines.training.common.checkpoint import (
    MARKER,
    partial_dir,
    publish_dir,
    quiet_single_process,
    read_marker,
)
from tandem.engines.training.fsdp.parallel import DistContext

__all__ = ["MARKER", "Checkpointable", "load_checkpoint", "publish_dir", "read_metadata", "save_checkpoint"]

FORMAT = "tandem-fsdp-1"


@dataclass(kw_only=True, slots=True)
class Checkpointable:
    """One trained role: its (sharded) module, optimizer and LR scheduler."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    frozen_params_saved: bool = True  # False with LoRA: the frozen base comes from the model folder


def _options(c: Checkpointable, *, loading: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    skip_frozen = not c.frozen_params_saved
    return StateDictOptions(ignore_frozen_params=skip_frozen, strict=not (loading and skip_frozen))


def _app_state(roles: Mapping[str, Checkpointable]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = {}
    for name, c in roles.items():
        model_sd, optim_sd = get_state_dict(c.module, c.optimizer, options=_options(c, loading=False))
        state[name] = {"model": _drop_frozen(c.module, model_sd, c.frozen_params_saved), "optim": optim_sd}
    return state


def _drop_frozen(module: nn.Module, model_sd: dict[str, Any], keep: bool) -> dict[str, Any]:
    """``ignore_frozen_params`` misses a frozen weight's tied alias (a tied LM head); drop it too."""
    if keep:
        return model_sd
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trainable}


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike, roles: Mapping[str, Checkpointable], ctx: DistContext, metadata: dict[str, Any]
) -> Path:
    """Save ``roles`` into directory ``path`` (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    final = Path(path).absolute()
    tmp = partial_dir(final)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.barrier()
    with quiet_single_process():
        dcp.save(_app_state(roles), checkpoint_id=str(tmp), no_dist=not ctx.sharded)
    torch.save(_rng_state(), tmp / f"rng_rank{ctx.rank}.pt")
    ctx.barrier()
    if ctx.is_main:
        torch.save({name: c.scheduler.state_dict() for name, c in roles.items()}, tmp / "schedulers.pt")
        meta = {"format": FORMAT, "world_size": ctx.world_size, "roles": sorted(roles), **metadata}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        publish_dir(tmp, final)
    ctx.barrier()
    return final


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a finished checkpoint; raises FileNotFoundError for anything else."""
    return read_marker(path, FORMAT)


def load_model_weights(
    path: str | os.PathLike, role: str, module: nn.Module, *, frozen_params_saved: bool = True
) -> None:
    """Load only ``role``'s model weights (no optimizer) into a plain, unsharded module."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    probe = Checkpointable(module=module, optimizer=None, scheduler=None, frozen_params_saved=frozen_params_saved)
    model_sd = get_model_state_dict(module, options=_options(probe, loading=False))
    state = {role: {"model": _drop_frozen(module, model_sd, frozen_params_saved)}}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(module, state[role]["model"], options=_options(probe, loading=True))


def load_checkpoint(path: str | os.PathLike, roles: Mapping[str, Checkpointable], ctx: DistContext) -> dict:
    """Restore ``roles`` (model, optimizer, scheduler) and this rank's RNG; returns the metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    meta = read_metadata(path)
    missing = sorted(set(roles) - set(meta["roles"]))
    if missing:
        raise ValueError(f"{path}: checkpoint has roles {meta['roles']}, not {missing}")
    state = _app_state(roles)
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=not ctx.sharded)
    for name, c in roles.items():
        set_state_dict(
            c.module,
            c.optimizer,
            model_state_dict=state[name]["model"],
            optim_state_dict=state[name]["optim"],
            options=_options(c, loading=True),
        )
    schedulers = torch.load(Path(path) / "schedulers.pt", weights_only=True)
    for name, c in roles.items():
        c.scheduler.load_state_dict(schedulers[name])
    rng_file = Path(path) / f"rng_rank{ctx.rank}.pt"
    if rng_file.is_file():  # a different world size resumes with fresh RNG on the new ranks
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return meta
