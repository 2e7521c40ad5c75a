"""Failover: a failed weight sync is tried again, then sent through another transport.

`FailoverSender(primary, fallback, retries=)` wraps the trainer-side senders of two transports (a run
builds it from ``sync.retries`` / ``sync.fallback``: `tandem.sync.factory.build_sender`). One ``send``:

1. the *active* transport (the primary, until a failover) sends the update; a transport failure
   (`SyncError`, which is also how the transports report their timeouts, or an `OSError` /
   `TimeoutError` / `RuntimeError` from below them) is logged and the same version is sent again, up to
   ``retries`` more times;
2. when the primary's attempts are spent, the same version goes through the fallback (with its own
   ``retries``), and the fallback stays the active transport for the rest of the run: the primary is
   closed (its receivers stop). Why sticky and not "try the primary again every K versions":

   * a broadcast that failed mid-collective may have left a collective posted on the abandoned group
     (gloo cannot cancel one); a re-formed group usually works, but a primary that failed ``retries + 1``
     times in a row is broken for a reason a retry did not fix, and each probe of it would cost up to
     ``sync.timeout_s`` per attempt inside a training step;
   * the engine-side disk receiver loads only the tensors whose hash differs from what *it* loaded last
     (delta); an update through another transport in between would make that record wrong. A fallback
     that never hands back keeps it exact;
   * one transport for the rest of the run keeps its metrics (``sync/gbps``) comparable.

   A new run (or ``--resume``) starts on the primary again.

Not retried: an update the engine applied but ``verify`` found different (`VerifyError`: sending it
again changes nothing), a sync cancelled because the engine process died (`cancel`), and a failure of
the trainer's own bucket iterator (the weights are not there to send; the transports report it as a
cancelled update).

**The weights of a retry.** The loop hands ``send`` a one-shot generator (under FSDP a collective that
every rank drains once). The sender keeps every bucket it took from it until the send returns and
replays them for a retry (continuing the generator where the failed attempt stopped), so no rank
gathers twice. The cost: the references to one update's tensors stay alive for the duration of the
send (a single-process trainer's own parameters, no copy; gathered full tensors under FSDP with more
than one rank, i.e. up to one model's worth on the sending rank).

**Versions** stay the transports' own rules: an attempt that failed applied nothing (broadcast commits
in two phases; disk moves ``LATEST`` last), so the engine keeps its version and weights and the retry
or the fallback carries the same version. Should a broadcast fail after the engine applied (its result
lost), the engine holds that version whole and the re-sent same version is accepted (re-sending the
current version is allowed).

Metrics added to every send's: ``sync/retries`` (attempts after the first in this send),
``sync/failovers`` (1 if this send switched to the fallback) and ``sync/transport_fallback`` (1 while the
fallback is the active transport). Without a fallback only ``sync/retries`` is added, when non-zero.

Engine side: `FailoverReceiver` pairs the receivers of both transports; `EngineReceiver` runs one
receiving thread for each, applying through one `WeightApplier` (whose version check and update are
atomic), so whichever transport carries a version, the engine applies it once, in order.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tandem.sync.base import SyncError
from tandem.sync.verify import VerifyError

__all__ = ["FailoverReceiver", "FailoverSender", "clear_versions"]

log = logging.getLogger(__name__)

Bucket = list[tuple[str, torch.Tensor]]
# what a transport raises when it fails (its own timeouts are SyncErrors; torch.distributed and store
# errors are RuntimeErrors); anything else (a TypeError, ...) is a bug and is not retried
TRANSPORT_ERRORS = (SyncError, OSError, TimeoutError, RuntimeError)


class _Replay:
    """Iterates a one-shot bucket iterator once, keeping every bucket, so a retry can iterate again: it
    replays the kept buckets, then continues the source where the previous attempt stopped."""

    def __init__(self, source: Iterable[Bucket]) -> None:
        self._source = iter(source)
        self._kept: list[Bucket] = []
        self._done = False
        self.error: BaseException | None = None  # the source itself raised (the trainer's gather failed)

    def __iter__(self) -> Iterator[Bucket]:
        i = 0
        while True:
            if i < len(self._kept):
                yield self._kept[i]
                i += 1
                continue
            if self._done:
                return
            if self.error is not None:
                raise self.error
            try:
                bucket = next(self._source)
            except StopIteration:
                self._done = True
                return
            except Exception as e:
                self.error = e
                raise
            self._kept.append(bucket)

    def release(self) -> None:
        self._kept.clear()


def _name(sender: Any) -> str:
    inner = getattr(sender, "sender", sender)
    return {"BroadcastSender": "broadcast", "DiskSender": "disk"}.get(type(inner).__name__, type(inner).__name__)


class FailoverSender:
    """A `WeightSync`: ``primary``, retried ``retries`` times, then ``fallback`` (sticky; module docstring).

    ``fallback=None``: retries only; the last failure is raised. ``secret`` set on this object reaches
    both transports; ``host`` / ``port`` are the primary's (a broadcast sender's rendezvous).
    """

    def __init__(self, primary: Any, fallback: Any = None, *, retries: int = 1) -> None:
        if retries < 0:
            raise ValueError(f"retries={retries} must be >= 0")
        self.primary, self.fallback, self.retries = primary, fallback, retries
        self.primary_name = _name(primary)
        self.fallback_name = _name(fallback) if fallback is not None else None
        self.on_fallback = False  # sticky: once true, every send goes through the fallback
        self.total_retries = 0
        self.failovers = 0
        self._cancelled = threading.Event()
        self._closed = False
        self._closing_primary: threading.Thread | None = None

    # -- what the run's builder and loop reach through the wrapper ---------------------------------------

    @property
    def secret(self) -> Any:
        return getattr(self.primary, "secret", None)

    @secret.setter
    def secret(self, value: Any) -> None:
        for sender in (self.primary, self.fallback):
            if sender is not None and hasattr(sender, "secret"):
                sender.secret = value

    @property
    def host(self) -> str:
        return self.primary.host

    @property
    def port(self) -> int:
        return self.primary.port

    @property
    def active(self) -> Any:
        return self.fallback if self.on_fallback else self.primary

    @property
    def active_name(self) -> str:
        return self.fallback_name if self.on_fallback else self.primary_name

    def cancel(self) -> None:
        """The engine process died: end a wait for it now, and retry nothing (later sends fail at once)."""
        self._cancelled.set()
        for sender in (self.primary, self.fallback):
            cancel = getattr(getattr(sender, "sender", sender), "cancel", None)
            if callable(cancel):
                cancel()

    # -- sending ----------------------------------------------------------------------------------------

    def send(self, buckets: Iterable[Bucket], version: int) -> dict[str, float]:
        replay = _Replay(buckets)
        retries = 0
        failed_over = False
        try:
            while True:
                sender, name = self.active, self.active_name
                try:
                    metrics, used = self._attempts(sender, name, replay, version)
                except _Exhausted as spent:
                    retries += spent.retries
                    if self.on_fallback or self.fallback is None:
                        raise spent.error from spent.error.__cause__
                    self._fail_over(version, spent.error)
                    failed_over = True
                    continue
                retries += used
                break
        finally:
            replay.release()
            self.total_retries += retries
        extra = {"sync/retries": float(retries)} if retries or self.fallback is not None else {}
        if self.fallback is not None:
            extra |= {"sync/failovers": float(failed_over), "sync/transport_fallback": float(self.on_fallback)}
        return metrics | extra

    def _attempts(self, sender: Any, name: str, replay: _Replay, version: int) -> tuple[dict[str, float], int]:
        """``sender.send`` up to ``1 + retries`` times: (its metrics, the retries used), or `_Exhausted`."""
        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            if self._cancelled.is_set():
                raise SyncError(f"weight sync to version {version} cancelled (the engine process is gone)")
            try:
                return sender.send(replay, version), attempt - 1
            except VerifyError:
                raise  # applied, but different: sending it again changes nothing
            except TRANSPORT_ERRORS as e:
                if replay.error is not None:  # the trainer's buckets failed, not the transport
                    raise
                if self._cancelled.is_set():
                    raise
                last = attempt == attempts
                log.warning("weight sync to version %d through %s failed (attempt %d of %d): %s: %s%s", version,
                            name, attempt, attempts, type(e).__name__, e, "" if last else "; sending it again")
                if last:
                    error = e if isinstance(e, SyncError) else SyncError(
                        f"{name} sync to version {version} failed: {type(e).__name__}: {e}")
                    if error is not e:
                        error.__cause__ = e
                    raise _Exhausted(error, attempt - 1) from e
        raise AssertionError("unreachable")

    def _fail_over(self, version: int, error: BaseException) -> None:
        log.error("weight sync to version %d: %s failed %d time(s) (%s); falling back to %s for this and every later "
                  "version of the run (a failed %s may have left its group broken)", version, self.primary_name,
                  self.retries + 1, error, self.fallback_name, self.primary_name)
        self.on_fallback = True
        self.failovers += 1
        # its receivers stop; it is not used again in this run. In the background: a broadcast sender's
        # close waits (up to seconds) for receivers that may be gone, and the fallback should not wait
        self._closing_primary = threading.Thread(target=self._close_primary, name="tandem-sync-close-primary",
                                                 daemon=True)
        self._closing_primary.start()

    def _close_primary(self) -> None:
        close = self.primary.close
        try:  # a broadcast sender waits for its receivers' acknowledgements: briefly, they may be gone
            close(wait_s=2.0) if "wait_s" in inspect.signature(close).parameters else close()
        except Exception:  # noqa: BLE001 - the primary is already failing; the fallback carries on
            log.warning("closing the failed %s sender raised", self.primary_name, exc_info=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._closing_primary is None:
            self.primary.close()
        else:  # a failover closes it already
            self._closing_primary.join(10)
        if self.fallback is not None:
            self.fallback.close()


class _Exhausted(Exception):
    """Every attempt of one transport failed; ``error`` is the last failure (a `SyncError`)."""

    def __init__(self, error: SyncError, retries: int) -> None:
        super().__init__(str(error))
        self.error, self.retries = error, retries


class FailoverReceiver:
    """Engine side of a failover pair: the primary transport's receiver and the fallback's, each served
    by its own thread of an `EngineReceiver` (``fallback_verify``: disk's engine-side verify)."""

    def __init__(self, primary: Any, fallback: Any, *, names: tuple[str, str] = ("primary", "fallback"),
                 fallback_verify: bool = False) -> None:
        self.primary, self.fallback, self.names = primary, fallback, names
        self.fallback_verify = fallback_verify

    def parts(self, verify: bool) -> list[tuple[str, Any, bool]]:
        """``(name, receiver, verify)`` of each transport (``verify``: what the primary was given)."""
        return [(self.names[0], self.primary, verify), (self.names[1], self.fallback, self.fallback_verify)]


def clear_versions(directory: str | Path) -> list[str]:
    """Remove the versions a disk sync directory holds (``LATEST``, manifests, blobs); other files stay.

    A fallback directory must start empty: its engine-side receiver listens from the engine's start and
    would load a version an earlier run left there (possibly a newer number than this run's, which
    would then refuse this run's updates as older). Returns what was removed.
    """
    root = Path(directory)
    removed = []
    for path in [root / "LATEST", *root.glob("manifests/v*.json"), *root.glob("blobs/*.safetensors")]:
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(str(path.relative_to(root)))
    if removed:
        log.info("sync fallback directory %s: removed %d file(s) an earlier run left", root, len(removed))
    return removed
