"""A per-run secret between a sender and its receivers: HMAC-SHA256 tags and a store bound to one address.

The broadcast rendezvous store (a `TCPStore`) and a disk sync directory can be reached by anyone on the
machine (or the network) who can reach the port or the directory. A sender and its receivers share a
secret (`SyncConfig.secret`, or ``TANDEM_SYNC_SECRET``, or a random one the run hands to the engine
process it spawns); every message that decides what an engine loads carries a tag, ``HMAC-SHA256(secret,
label | fields...)``, that only a holder of the secret can compute. The label and fields bind the tag to
its place (the session, the update's sequence number, the bucket), so a tag copied from elsewhere fails.

`listening_store` hosts a `TCPStore` on a socket bound to the given address only (torch's own listener
binds every interface, whatever host it is given).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.sync.base import SyncError

__all__ = ["admit_receivers", "as_key", "body_tag", "check_tag", "join", "json_or_none", "listening_store",
           "local_address", "post_challenge", "tag"]

log = logging.getLogger(__name__)

_JOINING = "tandem-sync/joining"  # "<prefix>/<session>/<rank>": a receiver's claim to join that session's group
_CHALLENGE = "tandem-sync/challenge"  # "<prefix>/<session>": the sender's nonce for that session's joins
_ADMIT = "tandem-sync/admit"  # "<prefix>/<session>/<rank>": the sender admitted that receiver
_POLL_S = 0.05


def as_key(secret: bytes | str | None) -> bytes | None:
    """The secret as bytes (None or empty: no authentication)."""
    if not secret:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def tag(key: bytes, label: str, *fields: object) -> str:
    """HMAC-SHA256 of ``label`` and ``fields`` (hex)."""
    msg = "\x1f".join([label, *(str(f) for f in fields)]).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def check_tag(key: bytes, value: object, label: str, *fields: object) -> bool:
    """Whether ``value`` is the tag of ``label`` and ``fields`` (constant-time comparison)."""
    return isinstance(value, str) and hmac.compare_digest(value, tag(key, label, *fields))


def body_tag(key: bytes, fields: tuple, flat: torch.Tensor | None) -> str:
    """HMAC-SHA256 of ``fields`` and a flat bucket's bytes (None: the fields alone). ~2 GB/s with SHA
    instructions; hashlib releases the GIL, so it runs beside the transfer."""
    nbytes = -1 if flat is None else flat.numel()
    h = hmac.new(key, "\x1f".join(["bucket", *(str(f) for f in fields), str(nbytes)]).encode() + b"\x1e",
                 hashlib.sha256)
    if flat is not None:
        h.update((flat if flat.device.type == "cpu" else flat.cpu()).numpy())
    return h.hexdigest()


def json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


# -- the broadcast rendezvous: a challenge, joins, admissions --------------------------------------------


def post_challenge(store: dist.Store, session: str) -> str:
    """Sender: a fresh nonce for ``session``'s joins (posted before the session is announced)."""
    nonce = secrets.token_hex(16)
    store.set(f"{_CHALLENGE}/{session}", nonce)
    return nonce


def admit_receivers(store: dist.Store, session: str, nonce: str, num_receivers: int, key: bytes | None, *,
                    timeout_s: float, cancelled: threading.Event) -> None:
    """Sender: wait until ranks ``1..num_receivers`` posted a valid join (with ``key``: tagged over the
    challenge; a bad one is deleted and counted), then admit each with a tag of its own."""
    pending = set(range(1, num_receivers + 1))
    admitted: dict[int, str] = {}
    refused = 0
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            claim_key = f"{_JOINING}/{session}/{r}"
            if not store.check([claim_key]):
                continue
            claim = json_or_none(store.get(claim_key))
            claim = claim if isinstance(claim, dict) else {}
            if key is None or check_tag(key, claim.get("tag"), "join", session, r, nonce, claim.get("nonce")):
                admitted[r] = str(claim.get("nonce", ""))
                pending.discard(r)
                continue
            refused += 1
            store.delete_key(claim_key)
            log.log(logging.WARNING if refused == 1 else logging.DEBUG,
                    "sync session %s: a join as receiver %d failed authentication (no or a wrong sync secret)",
                    session, r)
        if not pending:
            break
        if cancelled.is_set():
            raise SyncError("broadcast sync cancelled (the sender was told its receivers are gone)")
        if time.monotonic() >= deadline:
            why = f" ({refused} join(s) failed authentication: a wrong sync secret?)" if refused else ""
            raise SyncError(f"broadcast sync: {num_receivers} receiver(s) did not join within {timeout_s}s{why}")
        time.sleep(_POLL_S)
    for r, theirs in admitted.items():
        store.set(f"{_ADMIT}/{session}/{r}", tag(key, "admit", session, r, nonce, theirs) if key else "1")


def join(store: dist.Store, session: str, rank: int, key: bytes | None, *, timeout_s: float,
         poll: Callable[[list[str]], bool | None]) -> bool:
    """Receiver: post this rank's join (with ``key``: tagged over the session's challenge) and wait until
    the sender admits it (with ``key``: only an admission tagged with it counts). ``poll(keys)`` says
    whether keys exist (None: stop waiting); returns False then."""
    nonce = secrets.token_hex(16)
    challenge = store.get(f"{_CHALLENGE}/{session}").decode() if key else ""
    claim = json.dumps({"nonce": nonce, "tag": tag(key, "join", session, rank, challenge, nonce) if key else ""})
    claim_key, admit_key = f"{_JOINING}/{session}/{rank}", f"{_ADMIT}/{session}/{rank}"
    deadline = time.monotonic() + timeout_s
    while True:
        found = poll([admit_key])
        if found is None:
            return False
        if found and (key is None or check_tag(key, store.get(admit_key).decode(), "admit", session, rank, challenge,
                                               nonce)):
            return True
        if not store.check([claim_key]):  # the first attempt, or a refused (deleted) one: post it (again)
            store.set(claim_key, claim)
        if time.monotonic() >= deadline:
            why = " (its admission failed authentication: a wrong sync secret?)" if found else ""
            raise SyncError(f"sync session {session}: the sender did not admit receiver {rank} within {timeout_s}s{why}")
        time.sleep(_POLL_S)


def _bound_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def listening_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A master `TCPStore` that listens on ``host:port`` only (port 0: a free one); ``store.port`` is real."""
    sock = _bound_socket(host, port)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], world_size=None, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store


def local_address(host: str) -> str:
    """The address of this machine's interface that reaches ``host`` (``host`` itself for a loopback one)."""
    family = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 1))  # no packet is sent: this only picks the route
        return s.getsockname()[0]
