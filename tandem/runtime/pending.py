"""Rollouts in flight, written into a checkpoint so that an asynchronous run resumes without losing them.

``one_step_off``: while step S trains, the rollout of step S+1 is generated with the weights of step S-1.
A checkpoint of step S therefore holds that batch (its samples, with their log-probs and weight versions,
and its metrics), taken once it is complete; the resumed run trains on it exactly as the uninterrupted
run did, and is bit-identical to it. ``fully_async``: a checkpoint holds the finished groups waiting in
the queue (with their weight versions) and requeues the prompts of the groups still generating (they
are generated again from their prompt: a partial response is not kept); no prompt is lost or repeated.

A checkpoint written in one mode and resumed in another requeues the saved prompts instead (the samples
were made for the other mode's schedule).

Samples are stored as JSON (`sample_to_dict` / `sample_from_dict`): floats round-trip exactly (Python
writes the shortest repr that reads back to the same double), routed experts as integer lists with
their dtype and shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from tandem.core.sample import Sample, SampleStatus

__all__ = ["decode_groups", "decode_samples", "encode_groups", "encode_samples", "sample_from_dict",
           "sample_to_dict"]

log = logging.getLogger(__name__)

_FIELDS = tuple(f.name for f in fields(Sample))


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON types (numpy scalars and arrays as Python numbers and lists); anything else is
    written as its repr, with a warning naming where (sample metadata is free-form)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    log.warning("checkpoint of rollouts in flight: %s is a %s; stored as its text", where, type(value).__name__)
    return repr(value)


def sample_to_dict(s: Sample) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(s, name)
        if name == "status":
            value = value.value
        elif name == "rollout_routed_experts" and value is not None:
            value = {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}
        else:
            value = _plain(value, f"sample {s.index}: {name}")
        out[name] = value
    return out


def sample_from_dict(d: dict[str, Any]) -> Sample:
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise ValueError(f"a saved sample has fields this version does not know: {unknown}")
    kw = dict(d)
    kw["status"] = SampleStatus(kw.get("status", SampleStatus.PENDING.value))
    experts = kw.get("rollout_routed_experts")
    if experts is not None:
        kw["rollout_routed_experts"] = np.asarray(experts["data"], dtype=experts["dtype"]).reshape(experts["shape"])
    return Sample(**kw)


def encode_samples(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    return [sample_to_dict(s) for s in samples]


def decode_samples(rows: Iterable[dict[str, Any]]) -> list[Sample]:
    return [sample_from_dict(r) for r in rows]


def encode_groups(groups: Iterable[tuple[int, Sequence[Sample], dict[str, float]]]) -> list[dict[str, Any]]:
    """Fully-async queue items ``(prompt place, samples, metrics)`` as JSON."""
    return [{"prompt": place, "samples": encode_samples(samples), "metrics": dict(metrics)}
            for place, samples, metrics in groups]


def decode_groups(rows: Iterable[dict[str, Any]]) -> list[tuple[int, list[Sample], dict[str, float]]]:
    return [(int(r["prompt"]), decode_samples(r["samples"]), dict(r["metrics"])) for r in rows]
