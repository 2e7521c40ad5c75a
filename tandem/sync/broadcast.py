"""torch.distributed broadcast: trainer rank 0 -> engine processes, in a dedicated process group.

The group is separate from the trainer's own (FSDP) group: a `TCPStore` hosted by the sender plus a
`ProcessGroupGloo` on CPU or a `ProcessGroupNCCL` on GPU (``device="cuda"``), rank 0 the sender and
ranks ``1..num_receivers`` the engine processes.

Protocol of one update (sequence number ``seq`` within a group):

1. the sender *announces* it in the store (``announce/<seq>`` = version, verify flag). Receivers wait
   for announcements in the store, not inside a collective, so an engine can idle for longer than the
   collective timeout between syncs (a gloo op times out after ``timeout_s``);
2. per bucket it broadcasts a control word ``[magic, version, header bytes, body bytes]``, the JSON
   header and the flat body. The next bucket is gathered and flattened while the current one is on
   the wire; each receiver checks a bucket's checksum in a helper thread while the next one arrives;
3. a ``COMMIT`` control word ends the update (``ABORT``: the sender's producer failed; receivers drop
   what they staged). Two all-reduces (MIN) follow: *prepared* (every receiver holds the whole update
   with good checksums) and *applied* (every engine took it). A transfer problem on any receiver
   therefore changes no engine; an engine that rejects the update (e.g. a shape mismatch) keeps its
   old weights and reports why in the store (``result/<seq>/<rank>``), and the sender raises
   `SyncError` naming it. With verify the results carry each engine's verify report.

If a peer dies mid-transfer the sender sets ``abort`` in the group's store and raises `SyncError`;
surviving receivers notice it while waiting on their collective, drop the staged update (the engine
keeps its weights and version) and wait for the sender to re-form the group: the next ``send`` starts
a new generation under a fresh store prefix and waits up to ``timeout_s`` for every receiver to join.
A broken group is kept referenced for the life of the process (``_ABANDONED``: its pending work may
block until the collective timeout, and destroying it would block the caller).

**Authentication** (``secret``; docs/sync.md, "Security"; `tandem.sync.auth`): the store and gloo listen
on ``host``'s interface only; joins answer a challenge and are admitted with HMAC-SHA256 tags;
announcements, results and every bucket (header and body, tagged beside the transfer and listed in a
tagged commit record) are checked before anything is applied. Without a secret on both sides nothing
is authenticated (the library default; a run always has one).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.sync import auth
from tandem.sync.apply import call_apply
from tandem.sync.base import (
    BucketHeader,
    BufferPool,
    SyncError,
    check_bucket,
    flatten_bucket,
    sync_metrics,
    tensor_hashes,
    unflatten_bucket,
)
from tandem.sync.broadcast_group import _allreduce_min, _bcast, _get, _Group, _status
from tandem.sync.verify import check_reports

__all__ = ["BroadcastReceiver", "BroadcastSender"]

log = logging.getLogger(__name__)

MAGIC = 0x54414E44  # "TAND"
COMMIT, ABORT = -1, -2
SESSION_KEY = "tandem-sync/session"  # "<sender token>:<generation>", the group to join
CLOSED_KEY = "tandem-sync/closed"
_POLL_S = 0.001  # NCCL: sleep between completion checks of a collective
_ABORT_EVERY = 50  # NCCL: check the store's abort key every this many polls
_ABORT_CHECK_S = 0.1  # gloo: check the store's abort key this often while waiting on a collective
_IDLE_POLL_S = 0.05  # sleep between checks for a group to join (or close acknowledgements)
_IDLE_WAIT_S = 0.5  # an idle receiver's blocking wait for the next announcement, per slice
ApplyFn = Callable[..., Any]
# Groups abandoned after a failed update (either side). Destroying a gloo group with a collective still
# posted blocks until that collective times out (gloo cannot cancel it), so they are parked here rather
# than on the sender / receiver: dropping one of those (an engine process closing its receiver after a
# failover, tandem.sync.failover) must not wait out `timeout_s`. The engine process ends with os._exit,
# which destroys nothing; a plain interpreter exit still waits (docs/sync.md, "Known limit").
_ABANDONED: list[_Group] = []


class _Aborted(SyncError):
    """The sender abandoned the group (a peer died) while this receiver waited on a collective."""


class BroadcastSender:
    """Trainer side. Hosts the rendezvous store on ``host:port`` (port 0 picks a free one).

    ``verify``: every receiver hashes its engine's weights after applying; `send` compares them with
    the hashes of what it sent (`tandem.sync.verify`). ``device="cuda"`` uses NCCL with GPU buffers
    (buckets are then sent without a checksum unless ``hash_buckets``: hashing needs a host copy).
    ``secret``: authenticate the receivers and every update (module docstring); may also be set as the
    attribute before the first `send`.
    """

    def __init__(
        self,
        *,
        num_receivers: int,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
        verify: bool = False,
        device: str = "cpu",
        hash_buckets: bool | None = None,
        secret: bytes | str | None = None,
    ):
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be >= 1")
        self.device = torch.device(device)
        if self.device.type == "cuda":
            from tandem.sync.cuda import require_cuda

            require_cuda("transport 'broadcast' on device 'cuda' (NCCL)")
        self.num_receivers, self.timeout_s, self.verify = num_receivers, timeout_s, verify
        self.hash_buckets = self.device.type == "cpu" if hash_buckets is None else hash_buckets
        self.secret = auth.as_key(secret)
        self.store = auth.listening_store(host, port, timeout_s)  # on host only
        self.host, self.port = host, self.store.port
        self._token = secrets.token_hex(4)  # a restarted sender never reuses a generation name
        self._generation = 0
        self._group: _Group | None = None
        self._pool = BufferPool(self.device)
        self._last_buckets = 0
        self._bucket_tags: list[str] = []
        self._tagger = ThreadPoolExecutor(1, thread_name_prefix="tandem-sync-tag")
        self._cancelled = threading.Event()

    def _connect(self) -> _Group:
        if self._group is None:
            self._generation += 1
            session = f"{self._token}:{self._generation}"
            # every receiver announces itself (and, with a secret, answers a challenge) before the group is
            # formed, in short polls: the group's own rendezvous blocks in C++ for timeout_s, and a thread
            # stuck there (a receiver that died first) cannot be interrupted, which also aborts the
            # interpreter if it exits meanwhile
            nonce = auth.post_challenge(self.store, session)
            self.store.set(SESSION_KEY, session)
            auth.admit_receivers(self.store, session, nonce, self.num_receivers, self.secret,
                                 timeout_s=self.timeout_s, cancelled=self._cancelled)
            try:
                self._group = _Group(self.store, session, 0, self.num_receivers + 1, self.timeout_s, self.device,
                                     self.host)
            except Exception as e:
                raise SyncError(
                    f"broadcast sync: {self.num_receivers} receiver(s) did not join within {self.timeout_s}s "
                    f"({type(e).__name__}: {e})"
                ) from e
        return self._group

    def cancel(self) -> None:
        """Stop waiting for receivers that will not come (e.g. the engine process died); a `send`
        waiting for them raises `SyncError` within a poll interval, and later sends fail at once."""
        self._cancelled.set()

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Stream ``buckets`` to every receiver as update ``version``; raise `SyncError` on failure."""
        t0 = time.perf_counter()
        group = self._connect()
        group.seq += 1
        seq = group.seq
        announce = {"version": version, "verify": self.verify}
        if self.secret:
            announce["tag"] = auth.tag(self.secret, "announce", group.session, seq, version, self.verify)
        group.store.set(f"announce/{seq}", json.dumps(announce))
        sent: dict[str, int] = {}
        try:
            nbytes = self._stream(group, buckets, version, sent)
            if self.secret:  # before COMMIT: receivers check it when they see COMMIT
                tags = self._bucket_tags
                group.store.set(f"commit/{seq}", json.dumps({"buckets": tags, "tag": auth.tag(
                    self.secret, "commit", group.session, seq, version, len(tags), *tags)}))
            self._control(group, version, COMMIT, self._last_buckets)
            prepared = _status(1, self.device)
            _allreduce_min(group.pg, prepared).wait()
            applied = _status(1, self.device)
            if int(prepared.item()) == 1:
                _allreduce_min(group.pg, applied).wait()
        except _ProducerFailed as e:
            cause = e.__cause__
            raise SyncError(
                f"sync to version {version} cancelled, weights unchanged: the trainer's buckets failed: "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        except Exception as e:
            self._abandon(group, f"{type(e).__name__}: {e}")
            raise SyncError(f"broadcast sync to version {version} failed: {type(e).__name__}: {e}") from e
        results = self._results(group, seq)
        authentic = self.secret is None or all(res.get("ok") for res in results.values())
        if int(prepared.item()) != 1 or int(applied.item()) != 1 or not authentic:
            reasons = [f"receiver {r}: {res.get('error')}" for r, res in results.items() if not res.get("ok")]
            raise SyncError(
                f"sync to version {version} was not applied ({'; '.join(reasons) or 'no reason given'})"
            )
        extra = {}
        if self.verify:
            reports = {f"receiver {r}": res.get("report") for r, res in results.items()}
            extra = check_reports(sent, reports, version)
        return sync_metrics(nbytes, time.perf_counter() - t0, buckets=self._last_buckets, **extra)

    def _stream(self, group: _Group, buckets, version: int, sent: dict[str, int]) -> int:
        nbytes = 0
        pending = None  # the body in flight; its buffer (a pool slot) lives until it completed
        tags: list[Future] = []
        it = iter(buckets)
        i = 0
        while True:
            try:
                bucket = next(it)
            except StopIteration:
                break
            except Exception as e:  # the trainer's producer failed: cancel the update, keep the group
                if pending is not None:
                    pending.wait()
                self._control(group, version, ABORT, 0)
                raise _ProducerFailed() from e
            if i >= 2 and self.secret:
                tags[i - 2].result()  # that bucket's buffer is reused now
            flat, header = flatten_bucket(bucket, self._pool, i % 2, hashed=self.hash_buckets)
            if self.verify:
                sent.update(tensor_hashes(bucket))
            text = header.to_json()
            if self.secret:  # the header holds the body's xxh3: tagging it binds the body (see _check)
                tags.append(self._tagger.submit(auth.body_tag, self.secret, (group.session, group.seq, version, i,
                                                                             text), None))
            hdr = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
            if pending is not None:
                pending.wait()
            self._control(group, version, hdr.numel(), flat.numel())
            _bcast(group.pg, hdr.to(self.device)).wait()
            pending = _bcast(group.pg, flat)
            nbytes += flat.numel()
            i += 1
        if pending is not None:
            pending.wait()
        self._last_buckets = i
        self._bucket_tags = [t.result() for t in tags]
        return nbytes

    def _control(self, group: _Group, version: int, kind: int, n: int) -> None:
        _bcast(group.pg, torch.tensor([MAGIC, version, kind, n], dtype=torch.int64, device=self.device)).wait()

    def _results(self, group: _Group, seq: int) -> dict[int, dict]:
        out = {}
        for r in range(1, self.num_receivers + 1):
            key = f"result/{seq}/{r}"
            out[r] = json.loads(group.store.get(key).decode()) if group.store.check([key]) else {}
            group.store.delete_key(key)
            if self.secret and out[r] and not auth.check_tag(self.secret, out[r].pop("tag", None), "result",
                                                             group.session, seq, r, json.dumps(out[r], sort_keys=True)):
                out[r] = {"ok": False, "error": "its result failed authentication"}
        group.store.delete_key(f"announce/{seq}")
        return out

    def _abandon(self, group: _Group, reason: str) -> None:
        """Tell surviving receivers to drop this group; the next `send` forms a new one."""
        try:
            group.store.set("abort", reason)
        except Exception:  # noqa: BLE001 - best effort: the store is ours, this should not fail
            log.exception("could not post the abort of sync group %s", group.session)
        _ABANDONED.append(group)
        self._group = None

    def close(self, wait_s: float = 5.0) -> None:
        """Tell receivers that no more updates come (their `receive` returns None); wait up to
        ``wait_s`` for each to acknowledge, so none mistakes the store's shutdown for a crash."""
        try:
            self.store.set(CLOSED_KEY, "1")
            acks = [f"{CLOSED_KEY}/{r}" for r in range(1, self.num_receivers + 1)]
            deadline = time.monotonic() + wait_s
            while not self.store.check(acks) and time.monotonic() < deadline:
                time.sleep(_IDLE_POLL_S)
        except Exception:  # noqa: BLE001
            log.warning("could not post the sync sender's close")
        self._group = None
        self._tagger.shutdown(wait=False)
        self._pool.clear()


class _ProducerFailed(Exception):
    """The bucket iterator raised; the update was cancelled with ABORT and the group is intact."""


class BroadcastReceiver:
    """Engine side: joins the sender's store, receives whole updates and applies them.

    ``receive(apply)`` blocks until one update arrived and was applied (or rejected). Staging buffers
    are kept between updates (see `BufferPool`).
    """

    def __init__(
        self,
        *,
        rank: int,
        num_receivers: int,
        host: str,
        port: int,
        timeout_s: float = 120.0,
        device: str = "cpu",
        secret: bytes | str | None = None,
    ):
        if not 1 <= rank <= num_receivers:
            raise ValueError(f"receiver rank={rank} must be in [1, {num_receivers}]")
        self.rank, self.size, self.timeout_s = rank, num_receivers + 1, timeout_s
        self.host, self.port = host, port
        self.secret = auth.as_key(secret)
        self._expected: list[str] | None = None  # the bucket tags of the update being committed
        self.device = torch.device(device)
        self.stop_requested = False  # set by `EngineReceiver.stop`: idle waits return None
        self.store = self._store()
        self._group: _Group | None = None
        self._seen_session = ""
        self._pool = BufferPool(self.device)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tandem-sync-hash")
        self.corrupt_next_bucket = False  # fault injection for tests: flip a byte after receiving

    def _store(self) -> dist.TCPStore:
        """A client of the sender's store, retried in short attempts (so a stop request is heard)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            attempt = min(2.0, max(0.1, deadline - time.monotonic()))
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=attempt))
                store.set_timeout(timedelta(seconds=self.timeout_s))
                return store
            except Exception as e:
                if self.stop_requested or time.monotonic() >= deadline:
                    raise SyncError(f"cannot reach the sync sender's store at {self.host}:{self.port}: {e}") from e

    def _connect(self) -> _Group | None:
        """The live group, or join the sender's newest one (None: the sender closed, or stop)."""
        if self._group is not None:
            return self._group
        while True:
            state = self._poll_store([SESSION_KEY])
            if state is None:
                return None
            session = self.store.get(SESSION_KEY).decode() if state else ""
            if session and session != self._seen_session:
                break
            time.sleep(_IDLE_POLL_S)
        self._seen_session = session
        try:
            if not auth.join(self.store, session, self.rank, self.secret, timeout_s=self.timeout_s,
                             poll=self._poll_join):
                return None
            self._group = _Group(self.store, session, self.rank, self.size, self.timeout_s, self.device,
                                 auth.local_address(self.host))
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"could not join sync group {session}: {type(e).__name__}: {e}") from e
        return self._group

    def _poll_join(self, keys: list[str]) -> bool | None:
        found = self._poll_store(keys)
        if not self._seen_session:  # reconnected to a restarted sender: its sessions are new
            raise SyncError("the sync sender restarted; rejoining")
        return found

    def _poll_store(self, keys: list[str]) -> bool | None:
        """Whether ``keys`` exist (None: the sender closed or a stop was requested). Reconnects to a
        restarted sender's store."""
        if self.stop_requested:
            return None
        try:
            if self.store.check([CLOSED_KEY]):
                self.store.set(f"{CLOSED_KEY}/{self.rank}", "1")
                return None
            return self.store.check(keys)
        except Exception as e:  # the sender's process (which hosts the store) went away
            if self.stop_requested:
                return None
            log.warning("lost the sync sender's store (%s); reconnecting", e)
            self._drop_group()
            self.store = self._store()
            self._seen_session = ""
            return False

    def _wait_announce(self, group: _Group) -> dict | None:
        """The next update's announcement (None: the sender closed, or a stop was requested).

        The store serves a blocking ``wait``, so an idle receiver costs the sender's store one request
        per ``_IDLE_WAIT_S`` (not a poll every few ms) and wakes up as soon as the key is set.
        """
        key = f"announce/{group.seq + 1}"
        while True:
            try:
                group.store.wait([key], timedelta(seconds=_IDLE_WAIT_S))
                announced = json.loads(group.store.get(key).decode())
            except RuntimeError:  # timed out (or the store went away: _poll_store finds out)
                announced = None
            if announced is not None:
                if self.secret is None or auth.check_tag(self.secret, announced.get("tag"), "announce", group.session,
                                                         group.seq + 1, announced.get("version"),
                                                         announced.get("verify")):
                    return announced
                self._drop_group()
                raise SyncError(f"the announcement of update {group.seq + 1} failed authentication; rejoining")
            if self._poll_store([SESSION_KEY]) is None:
                return None
            if self._group is not group:  # the store was reconnected
                raise SyncError("the sync sender restarted; rejoining")
            if self.store.get(SESSION_KEY).decode() != group.session:
                self._drop_group()
                raise SyncError("the sync sender re-formed the group; rejoining")

    def _wait(self, group: _Group, work) -> None:
        """Wait for a collective, giving up if the sender abandons the group meanwhile.

        gloo: block in ``wait`` for slices of ``_ABORT_CHECK_S`` (it returns the moment the op
        completes; a timed-out slice leaves the op pending). NCCL: poll ``is_completed``.
        """
        while True:
            if self.device.type == "cuda":
                for _ in range(_ABORT_EVERY):
                    if work.is_completed():
                        break
                    time.sleep(_POLL_S)
            else:
                try:
                    work.wait(timedelta(seconds=_ABORT_CHECK_S))
                    return
                except RuntimeError:
                    pass
            if work.is_completed():
                work.wait()  # raises if the collective failed
                return
            if group.store.check(["abort"]):
                raise _Aborted(f"the sender aborted the update: {group.store.get('abort').decode()}")

    def _drop_group(self) -> None:
        if self._group is not None:
            _ABANDONED.append(self._group)
        self._group = None

    def receive(self, apply: ApplyFn) -> int | None:
        """Block until one update arrives; stage, check and ``apply(named_tensors, version)`` it.

        Returns the applied version, or None if the sender closed (or `stop_requested`). A failed
        update raises `SyncError` and leaves the engine on its weights and version; the next call
        receives the next update (rejoining the group if it broke).
        """
        group = self._connect()
        if group is None:
            return None
        announced = self._wait_announce(group)
        if announced is None:
            return None
        group.seq += 1
        version = int(announced["version"])
        try:
            staged = self._stage(group, version)
        except SyncError:
            self._drop_group()
            raise
        except Exception as e:
            self._drop_group()
            raise SyncError(f"sync receive of version {version} failed: {type(e).__name__}: {e}") from e
        if staged is None:  # ABORT: the sender's producer failed; the group is fine
            raise SyncError(f"sync to version {version} was cancelled by the sender; weights unchanged")
        return self._commit(group, staged, version, apply, bool(announced.get("verify")))

    def _stage(self, group: _Group, version: int) -> list[tuple[torch.Tensor, BucketHeader, Future]] | None:
        staged = []
        i = 0
        while True:
            ctrl = torch.empty(4, dtype=torch.int64, device=self.device)
            self._wait(group, _bcast(group.pg, ctrl))
            magic, sent_version, kind, n = (int(x) for x in ctrl.tolist())
            if magic != MAGIC or sent_version != version:
                raise SyncError(f"bad control word {ctrl.tolist()} for version {version}: not this update's stream")
            if kind == ABORT:
                return None
            if kind == COMMIT:
                if self.secret:
                    self._expected = self._commit_record(group, version, len(staged))
                return staged
            hdr = torch.empty(kind, dtype=torch.uint8, device=self.device)
            self._wait(group, _bcast(group.pg, hdr))
            flat = self._pool.get(i, n)
            self._wait(group, _bcast(group.pg, flat))
            if self.corrupt_next_bucket:
                flat[0] ^= 0xFF
                self.corrupt_next_bucket = False
            text = bytes(hdr.cpu().numpy()).decode()
            header = BucketHeader.from_json(text)
            staged.append((flat, header, self._hasher.submit(self._check, flat, header,
                                                             (group.session, group.seq, version, i, text))))
            i += 1

    def _check(self, flat: torch.Tensor, header: BucketHeader, fields: tuple) -> str | None:
        """The bucket's checksum, and with a secret the tag of its header (compared with the commit's at
        `_commit`). The header carries the body's xxh3, checked here: the tag binds the body through it.
        xxh3 is not a MAC, but only admitted members (who answered the challenge) send on this group, so a
        full-body HMAC (measured: 3.3 -> 1.2 GB/s on 2 cores) would guard only against an attacker who can
        already rewrite loopback TCP streams."""
        check_bucket(flat, header)
        if self.secret is None:
            return None
        return auth.body_tag(self.secret, fields, None)

    def _commit_record(self, group: _Group, version: int, count: int) -> list[str] | None:
        """The bucket tags the sender committed (None: missing, another count, or not authentic)."""
        record = auth.json_or_none(_get(group.store, f"commit/{group.seq}") or b"")
        tags = record.get("buckets") if isinstance(record, dict) else None
        if not isinstance(tags, list) or len(tags) != count or not auth.check_tag(
                self.secret, record.get("tag"), "commit", group.session, group.seq, version, count, *tags):
            return None
        return tags

    def _commit(self, group: _Group, staged, version: int, apply: ApplyFn, verify: bool) -> int:
        """Phase 1: all checksums good everywhere; phase 2: apply and report."""
        result: dict[str, Any] = {"ok": True}
        try:
            tags = [hashed.result() for _, _, hashed in staged]
            if self.secret and (self._expected is None or not all(
                    hmac.compare_digest(a, b) for a, b in zip(tags, self._expected, strict=True))):
                raise SyncError(f"update {group.seq} failed authentication (its commit, or a bucket's tag, does not "
                                "match: not from the sender that holds the sync secret)")
        except SyncError as e:
            result = {"ok": False, "error": str(e)}
        try:
            prepared = _status(int(result["ok"]), self.device)
            self._post_result(group, result)
            self._wait(group, _allreduce_min(group.pg, prepared))
            if int(prepared.item()) != 1:
                raise SyncError(f"sync to version {version} not applied: {result.get('error') or 'another receiver failed'}")
            try:
                named = [nt for flat, header, _ in staged for nt in unflatten_bucket(flat, header, verify=False)]
                result["report"] = call_apply(apply, named, version, verify=verify)
            except Exception as e:  # noqa: BLE001 - reported to the sender, weights untouched
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                log.error("sync to version %d not applied: %s", version, e)
            self._post_result(group, result)
            applied = _status(int(result["ok"]), self.device)
            self._wait(group, _allreduce_min(group.pg, applied))
        except _Aborted:
            self._drop_group()
            raise
        except SyncError:
            raise
        except Exception as e:
            self._drop_group()
            raise SyncError(f"sync commit of version {version} failed: {type(e).__name__}: {e}") from e
        if not result["ok"]:
            raise SyncError(f"sync to version {version} was not applied: {result['error']}")
        return version

    def _post_result(self, group: _Group, result: dict[str, Any]) -> None:
        posted = dict(result)
        if self.secret:
            posted["tag"] = auth.tag(self.secret, "result", group.session, group.seq, self.rank,
                                     json.dumps(result, sort_keys=True))
        group.store.set(f"result/{group.seq}/{self.rank}", json.dumps(posted))

    def close(self) -> None:
        self._drop_group()
        self._hasher.shutdown(wait=False)
        self._pool.clear()
