"""Transports move whole, checksummed, versioned updates; failures leave the receiver untouched.

Single-process tests: disk, and broadcast with the engine's receiving thread in this process (the
group's two ranks in two threads). Cross-process runs are in test_engine_process.py.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tandem.config import ConfigError, from_dict
from tandem.sync import EngineReceiver, SyncConfig, SyncError, SyncUnavailableError, VerifyError, bucketize
from tandem.sync.base import flatten_bucket, unflatten_bucket
from tandem.sync.broadcast import BroadcastReceiver, BroadcastSender
from tandem.sync.disk import DiskReceiver, DiskSender
from tests.sync.engine_worker import MODEL, build_engine, engine_digest
from tests.sync.sinks import ModuleSink, perturbed_weights, weight_buckets


def _digest(weights: dict) -> dict[str, int]:
    from tandem.sync import checksum

    return {k: checksum(v) for k, v in weights.items()}


def _holds(engine, weights: dict) -> bool:
    got = engine_digest(engine)
    return {n: got[n] for n in weights} == _digest(weights)


def test_flatten_round_trip_mixed_dtypes_and_checksum():
    bucket = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).bfloat16()),
        ("c", torch.arange(5)),
        ("d", torch.randn(1, 3).half()),
        ("e", torch.zeros(0)),
    ]
    flat, header = flatten_bucket(bucket)
    assert all(off % 64 == 0 for off in header.offsets)
    out = dict(unflatten_bucket(flat, header))
    for name, t in bucket:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    flat[header.offsets[1]] ^= 1
    with pytest.raises(SyncError, match="checksum mismatch"):
        list(unflatten_bucket(flat, header))


def test_bucketize_bounds_bytes():
    named = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    buckets = list(bucketize(named, 1000))
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert [len(b) for b in bucketize([("big", torch.zeros(1000))], 1000)] == [1]  # too big: alone


def test_sync_config_validation():
    with pytest.raises(ConfigError, match="transport 'disk' needs sync.directory"):
        from_dict(SyncConfig, {"transport": "disk"})
    with pytest.raises(ConfigError, match="transport: 'carrier_pigeon' is not a valid choice"):
        from_dict(SyncConfig, {"transport": "carrier_pigeon"})


def test_disk_full_and_delta(tmp_path):
    engine = build_engine()
    w1 = perturbed_weights(1, MODEL)
    sender = DiskSender(tmp_path, delta=True, keep_versions=2)
    m1 = sender.send(weight_buckets(w1), 1)
    assert m1["sync/bytes"] == m1["sync/bytes_total"]  # first version: everything
    recv = DiskReceiver(tmp_path)
    assert recv.poll(engine.update_weights) == 1 and engine.weight_version == 1 and _holds(engine, w1)
    # change two tensors: only those travel, and only those are loaded
    changed = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    w2 = {**w1, **{k: w1[k] + 1 for k in changed}}
    m2 = sender.send(weight_buckets(w2), 2)
    assert m2["sync/bytes"] == sum(w2[k].numel() * 4 for k in changed)
    loaded = []
    assert recv.poll(lambda named, v: (loaded.extend(n for n, _ in named), engine.update_weights(named, v))) == 2
    assert sorted(loaded) == sorted(changed) and _holds(engine, w2)
    assert recv.poll(engine.update_weights) is None  # nothing newer
    # a fresh receiver (another job) gets the full model from the delta manifests
    fresh = build_engine()
    DiskReceiver(tmp_path).poll(fresh.update_weights, verify=True)
    assert _holds(fresh, w2) and fresh.weight_version == 2
    # pruning keeps two manifests and only referenced blobs
    sender.send(weight_buckets(w2), 3)
    sender.close()  # waits for the background pruning
    assert sorted(p.name for p in (tmp_path / "manifests").iterdir()) == ["v2.json", "v3.json"]
    live = {
        e["blob"]
        for v in (2, 3)
        for e in json.loads((tmp_path / "manifests" / f"v{v}.json").read_text())["tensors"].values()
    }
    assert {p.name for p in (tmp_path / "blobs").iterdir()} == live
    assert not list(tmp_path.glob("**/*.tmp"))  # every temporary file was renamed or removed


def test_disk_corruption_leaves_receiver_untouched(tmp_path):
    engine = build_engine()
    before = engine_digest(engine)
    DiskSender(tmp_path).send(weight_buckets(perturbed_weights(2, MODEL)), 1)
    blob = next((tmp_path / "blobs").iterdir())
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data
    blob.write_bytes(bytes(data))
    with pytest.raises(SyncError, match="corrupted"):
        DiskReceiver(tmp_path).poll(engine.update_weights)
    assert engine_digest(engine) == before and engine.weight_version == 0


def test_disk_version_pruned_under_a_slow_receiver_is_a_sync_error(tmp_path):
    sender = DiskSender(tmp_path, keep_versions=1)
    sender.send(weight_buckets(perturbed_weights(1, MODEL)), 1)
    receiver = DiskReceiver(tmp_path)
    (tmp_path / "manifests" / "v1.json").unlink()  # what a fast sender's pruning does mid-read
    with pytest.raises(SyncError, match="could not read"):
        receiver.poll(build_engine().update_weights)


# -- broadcast (gloo): sender here, the engine's receiving thread here too ---------------------------------


@pytest.fixture
def broadcast_pair():
    engine = build_engine()
    sender = BroadcastSender(num_receivers=1, timeout_s=20, verify=True)
    rx = EngineReceiver(engine, BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=sender.port))
    rx.start()
    yield sender, engine, rx
    sender.close()
    rx.stop()


def _wait_errors(rx: EngineReceiver, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(rx.errors) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_broadcast_producer_failure_cancels_the_update_and_keeps_the_group(broadcast_pair):
    sender, engine, rx = broadcast_pair
    w1, w2 = perturbed_weights(1, MODEL), perturbed_weights(2, MODEL)
    metrics = sender.send(weight_buckets(w1), 1)
    assert engine.weight_version == 1 and _holds(engine, w1)
    assert metrics["sync/verified_tensors"] == len(w1) and metrics["sync/buckets"] == len(list(weight_buckets(w1)))

    def failing():  # the trainer's gather fails after two buckets
        buckets = weight_buckets(w2)
        yield next(buckets)
        yield next(buckets)
        raise RuntimeError("all-gather failed")

    with pytest.raises(SyncError, match="version 2 cancelled, weights unchanged.*RuntimeError: all-gather failed"):
        sender.send(failing(), 2)
    _wait_errors(rx, 1)
    assert "cancelled by the sender" in rx.last_error
    assert engine.weight_version == 1 and _holds(engine, w1)
    sender.send(weight_buckets(w2), 2)  # the same group (no re-forming) carries the next update
    assert sender._generation == 1 and engine.weight_version == 2 and _holds(engine, w2)


def test_broadcast_verify_reports_the_receivers_mismatch(broadcast_pair):
    sender, engine, _ = broadcast_pair
    weights = perturbed_weights(3, MODEL)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] * 2  # an untied head into a tied engine
    with pytest.raises(VerifyError, match="receiver 1: model.embed_tokens.weight: engine weight differs"):
        sender.send(weight_buckets(weights), 1)


def test_broadcast_to_a_plain_function_cannot_be_verified():
    sender = BroadcastSender(num_receivers=1, timeout_s=20, verify=True)
    rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=sender.port)
    sink = ModuleSink()
    seen = []
    import threading

    thread = threading.Thread(target=lambda: seen.append(rx.receive(lambda named, v: sink.apply(named, v))))
    thread.start()
    try:
        with pytest.raises(VerifyError, match="engine weights not checked: the receiver applies through a plain"):
            sender.send(weight_buckets(perturbed_weights(4)), 1)
    finally:
        thread.join(20)
        sender.close(wait_s=0)
        rx.close()
    assert seen == [1] and sink.version == 1  # applied; only the check was impossible


def test_gpu_transports_need_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from tandem.sync.cuda import CudaIpcSender, CupyNcclSender

    with pytest.raises(SyncUnavailableError, match="needs a GPU"):
        CudaIpcSender(authkey=b"k")
    with pytest.raises(SyncUnavailableError, match="needs a GPU"):
        CupyNcclSender(num_receivers=1)
    with pytest.raises(SyncUnavailableError, match="needs a GPU"):
        BroadcastSender(num_receivers=1, device="cuda")


def test_a_send_waiting_for_receivers_that_never_come_can_be_cancelled():
    """The engine process died before joining: the trainer cancels the wait instead of leaving a thread
    stuck in the group's C++ rendezvous for timeout_s (which also aborts the interpreter at exit)."""
    import threading

    sender = BroadcastSender(num_receivers=1, timeout_s=60)
    errors: list[BaseException] = []

    def send():
        try:
            sender.send(weight_buckets(perturbed_weights(1)), 1)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # still waiting for its receiver
    t0 = time.monotonic()
    sender.cancel()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - t0 < 2
    assert len(errors) == 1 and isinstance(errors[0], SyncError) and "cancelled" in str(errors[0])
    with pytest.raises(SyncError, match="cancelled"):
        sender.send(weight_buckets(perturbed_weights(2)), 2)
    sender.close(wait_s=0)
