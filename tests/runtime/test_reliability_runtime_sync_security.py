"""Issue 23, security: the broadcast rendezvous listens on ``sync.host`` only and admits only holders of
the run's secret; disk manifests are signed; the secret stays out of saved configs."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tandem.config import load_config, save_config
from tandem.runtime.config import RunConfig
from tandem.sync import EngineReceiver, SyncConfig, SyncError
from tandem.sync.broadcast import BroadcastReceiver, BroadcastSender
from tandem.sync.disk import DiskReceiver, DiskSender
from tests.sync.engine_worker import MODEL, build_engine, engine_digest
from tests.sync.sinks import perturbed_weights, weight_buckets

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"


def _listen_addresses(port: int) -> set[str]:
    """The local addresses a socket listens on for ``port`` (Linux /proc/net/tcp[6], hex, as the kernel writes)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_the_rendezvous_store_listens_on_sync_host_only():
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp")
    plain = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    # torch's own listener takes every interface, whatever host it was given: what the sender avoids
    assert _listen_addresses(plain.port) & {"00000000", "00000000000000000000000000000000"}
    sender = BroadcastSender(num_receivers=1, host="127.0.0.1", timeout_s=5, secret="s")
    try:
        assert _listen_addresses(sender.port) == {"0100007F"}  # 127.0.0.1 only
        with socket.create_connection(("127.0.0.1", sender.port), timeout=5):
            pass
    finally:
        sender.close(wait_s=0)
        del plain


def _receive_in_thread(rx: BroadcastReceiver, out: list) -> threading.Thread:
    def target() -> None:
        try:
            out.append(rx.receive(lambda named, version: None))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("receiver_secret", [None, "not-the-secret"])
def test_a_receiver_without_the_secret_cannot_join(receiver_secret):
    sender = BroadcastSender(num_receivers=1, timeout_s=3, secret="the-run-secret")
    rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=3,
                           secret=receiver_secret)
    out: list = []
    thread = _receive_in_thread(rx, out)
    try:
        start = time.monotonic()
        with pytest.raises(SyncError, match=r"did not join within 3s \(\d+ join\(s\) failed authentication"):
            sender.send(weight_buckets(perturbed_weights(1)), 1)
        assert time.monotonic() - start < 10
        thread.join(10)
        # the intruder was never admitted: it formed no group and received nothing
        assert out and isinstance(out[0], SyncError) and rx._group is None
    finally:
        sender.close(wait_s=0)
        rx.close()


def test_a_sender_without_the_secret_is_not_followed():
    sender = BroadcastSender(num_receivers=1, timeout_s=3)  # no secret: it admits anyone, without a tag
    rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=3,
                           secret="the-run-secret")
    out: list = []
    thread = _receive_in_thread(rx, out)
    try:
        with pytest.raises(SyncError):
            sender.send(weight_buckets(perturbed_weights(1)), 1)
        thread.join(10)
        assert out and isinstance(out[0], SyncError) and "admission failed authentication" in str(out[0])
    finally:
        sender.close(wait_s=0)
        rx.close()


def test_authenticated_updates_arrive_and_a_corrupted_body_is_refused():
    engine = build_engine()
    sender = BroadcastSender(num_receivers=1, timeout_s=20, secret="the-run-secret")
    receiver = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=sender.port,
                                 secret="the-run-secret")
    rx = EngineReceiver(engine, receiver).start()
    try:
        w1, w2 = perturbed_weights(1, MODEL), perturbed_weights(2, MODEL)
        sender.send(weight_buckets(w1), 1)
        assert engine.weight_version == 1
        digest = engine_digest(engine)
        # a body changed in flight: its header's checksum (which the header's tag covers) refuses it, and
        # the update is refused whole (a body HMAC is not computed: only admitted members send, see _check)
        receiver.corrupt_next_bucket = True
        with pytest.raises(SyncError):
            sender.send(weight_buckets(w2), 2)
        assert engine.weight_version == 1 and engine_digest(engine) == digest
        sender.send(weight_buckets(w2), 2)  # the next, intact update goes through
        assert engine.weight_version == 2
    finally:
        sender.close()
        rx.stop()


def test_disk_manifests_are_signed(tmp_path):
    weights = perturbed_weights(1, MODEL)
    engine = build_engine()
    DiskSender(tmp_path / "unsigned").send(weight_buckets(weights), 1)
    with pytest.raises(SyncError, match="v1: the manifest is not signed"):
        DiskReceiver(tmp_path / "unsigned", secret="s").poll(engine.update_weights)
    DiskSender(tmp_path / "other", secret="another secret").send(weight_buckets(weights), 1)
    with pytest.raises(SyncError, match="v1: the manifest's signature does not match"):
        DiskReceiver(tmp_path / "other", secret="s").poll(engine.update_weights)
    signed = tmp_path / "signed"
    DiskSender(signed, secret="s").send(weight_buckets(weights), 1)
    assert (signed.stat().st_mode & 0o777) == 0o700  # a new sync directory is private
    manifest = signed / "manifests" / "v1.json"
    good = manifest.read_text()
    manifest.write_text(good.replace('"hash": ', '"hash": 1', 1))  # point a tensor at other bytes
    with pytest.raises(SyncError, match="signature does not match"):
        DiskReceiver(signed, secret="s").poll(engine.update_weights)
    manifest.write_text(good)
    assert DiskReceiver(signed, secret="s").poll(engine.update_weights) == 1 and engine.weight_version == 1


def test_the_secret_stays_out_of_saved_configs(tmp_path, monkeypatch):
    cfg = load_config(RunConfig, RECIPE, ["sync.secret=hunter2-run-secret"])
    assert cfg.sync.resolved_secret() == "hunter2-run-secret" and "hunter2" not in repr(cfg)
    save_config(cfg, tmp_path / "config.yaml")
    assert "hunter2" not in (tmp_path / "config.yaml").read_text()
    monkeypatch.setenv("TANDEM_SYNC_SECRET", "from-the-environment")
    assert SyncConfig().resolved_secret() == "from-the-environment"
