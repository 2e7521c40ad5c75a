"""``verify: true``: after a sync, compare the engine's weights with the trainer's, tensor by tensor.

A debug tool (off by default): it costs a few hash passes over the model. It checks the whole chain
by per-tensor xxh3-64 digests, so it works across processes without moving tensors back:

1. the sender hashes every tensor it sends (what the trainer holds, after quantize-on-send if any);
2. the engine side hashes every tensor it received (catches a transport or layout bug), and after
   applying, hashes each engine weight and compares it with the received tensor as the engine should
   hold it (cast to the engine's dtype, dequantized if quantize-on-send is on): catches a name mapping,
   tied-weight or in-place-copy bug;
3. the engine side returns ``{"received": {name: hash}, "mismatched": [...]}`` and the sender checks
   it against its own hashes; any difference raises `VerifyError` naming the tensors.

A failed verify means the engine *did* apply the update (verification runs after it), so the error
says so; the sync is not rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tandem.core.protocols import WeightsView
from tandem.sync.base import SyncError, checksum

__all__ = ["VerifyError", "check_reports", "engine_weights", "verify_applied"]

_SHOWN = 5  # names listed in an error message


class VerifyError(SyncError):
    """The engine's weights after a sync differ from what the trainer sent."""


def engine_weights(engine: Any) -> Mapping[str, torch.Tensor]:
    """The engine's live weights by HF name (``named_weights()``, where ``info.exposes_weights``)."""
    if not engine.info.exposes_weights:
        raise SyncError(
            f"verify: {engine.info.name} does not expose its weights (info.exposes_weights is false), so a "
            "sync to it cannot be verified; set sync.verify: false"
        )
    view: WeightsView = engine
    return view.named_weights()  # a mapping: an engine may produce a weight only when it is read


def verify_applied(
    engine: Any, applied: Iterable[tuple[str, torch.Tensor]], received: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, Any]:
    """Engine-side check, after ``applied`` was loaded into ``engine``.

    ``received``: the tensors as they arrived (hashed for the sender); ``applied``: what was handed to
    the engine (the same, or their dequantized form). Returns the JSON-able report.
    """
    weights = engine_weights(engine)
    mismatched = []
    for name, t in applied:
        w = weights.get(name)
        if w is None:
            mismatched.append(f"{name}: not an engine weight")
            continue
        want = t if (t.dtype == w.dtype and t.shape == w.shape) else t.to(w.dtype)
        if checksum(w) != checksum(want):
            mismatched.append(f"{name}: engine weight differs from the received tensor")
    return {"received": {name: checksum(t) for name, t in received}, "mismatched": mismatched}


def _limited(items: list[str]) -> str:
    more = f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return "; ".join(items[:_SHOWN]) + more


def check_reports(sent: Mapping[str, int], reports: Mapping[str, dict | None], version: int) -> dict[str, float]:
    """Sender side: compare each receiver's report with the hashes of what was sent.

    ``reports`` maps a receiver's label to its report (None: it sent none). Raises `VerifyError`
    naming the receivers and tensors that differ; returns ``{"verified_tensors": n}`` otherwise.
    """
    problems = []
    for who, report in reports.items():
        if not report or "received" not in report:
            problems.append(f"{who}: no verify report (its receiver does not verify)")
            continue
        received = {k: int(v) for k, v in report["received"].items()}
        bad = [f"{n}: not received" for n in sent if n not in received]
        bad += [f"{n}: received bytes differ from the sent ones" for n in sent if n in received and received[n] != sent[n]]
        bad += [f"{n}: received but never sent" for n in received if n not in sent]
        bad += list(report.get("mismatched", []))
        if bad:
            problems.append(f"{who}: {_limited(bad)}")
    if problems:
        raise VerifyError(
            f"verify after sync to version {version} failed (the update was applied): " + " | ".join(problems)
        )
    return {"verified_tensors": float(len(sent))}
