"""Transports move whole, checksummed, versioned updates; failures leave the receiver untouched."""

from __future__ import annotations

import json
import os
import queue
import signal

import pytest
import torch
import torch.multiprocessing as mp

from tandem.config import ConfigError, from_dict
from tandem.sync import SyncConfig, SyncError, SyncUnavailableError, bucketize, checksum
from tandem.sync.base import flatten_bucket, unflatten_bucket
from tandem.sync.broadcast import BroadcastReceiver, BroadcastSender
from tandem.sync.disk import DiskReceiver, DiskSender
from tests.sync.sinks import ModuleSink, perturbed_weights


def _buckets(weights, nbytes=64 * 1024):
    return bucketize(weights.items(), nbytes)


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
    sink = ModuleSink()
    w1 = perturbed_weights(1)
    sender = DiskSender(tmp_path, delta=True, keep_versions=2)
    m1 = sender.send(_buckets(w1), 1)
    assert m1["sync/bytes"] == m1["sync/bytes_total"]  # first version: everything
    recv = DiskReceiver(tmp_path)
    assert recv.poll(sink.apply) == 1 and sink.version == 1
    assert sink.digest() == {k: checksum(v) for k, v in w1.items()}
    # change two tensors: only those travel
    w2 = dict(w1)
    changed = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    for k in changed:
        w2[k] = w1[k] + 1
    m2 = sender.send(_buckets(w2), 2)
    assert m2["sync/bytes"] == sum(w2[k].numel() * 4 for k in changed)
    assert recv.poll(sink.apply) == 2
    assert sink.digest() == {k: checksum(v) for k, v in w2.items()}
    assert recv.poll(sink.apply) is None  # nothing newer
    # a fresh receiver (another job) gets the full model from the delta manifests
    fresh = ModuleSink()
    DiskReceiver(tmp_path).poll(fresh.apply)
    assert fresh.digest() == sink.digest()
    # pruning keeps two manifests and only referenced blobs
    sender.send(_buckets(w2), 3)
    assert sorted(p.name for p in (tmp_path / "manifests").iterdir()) == ["v2.json", "v3.json"]
    live = {
        e["blob"]
        for v in (2, 3)
        for e in json.loads((tmp_path / "manifests" / f"v{v}.json").read_text())["tensors"].values()
    }
    assert {p.name for p in (tmp_path / "blobs").iterdir()} == live


def test_disk_corruption_leaves_receiver_untouched(tmp_path):
    sink = ModuleSink()
    before = sink.digest()
    DiskSender(tmp_path).send(_buckets(perturbed_weights(2)), 1)
    blob = next((tmp_path / "blobs").iterdir())
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data
    blob.write_bytes(bytes(data))
    with pytest.raises(SyncError, match="corrupted"):
        DiskReceiver(tmp_path).poll(sink.apply)
    assert sink.digest() == before and sink.version == 0


# -- broadcast (gloo) between processes ---------------------------------------------------------------


def _receiver_main(port, results, corrupt_second, die_after_bucket):
    torch.set_num_threads(1)
    sink = ModuleSink()
    rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=port, timeout_s=30)
    if die_after_bucket:
        import tandem.sync.broadcast as bmod

        real = bmod._bcast
        count = {"n": 0}

        def dying(pg, t):
            count["n"] += 1
            if count["n"] == 4:  # control, header, body of bucket 1, then control of bucket 2
                os.kill(os.getpid(), signal.SIGKILL)
            return real(pg, t)

        bmod._bcast = dying
    for i in range(3):
        rx.corrupt_next_bucket = corrupt_second and i == 1
        try:
            rx.receive(sink.apply)
        except SyncError as e:
            results.put(("error", str(e)))
        results.put((sink.version, sink.digest()))


def _spawn(port, results, corrupt_second=False, die_after_bucket=False):
    p = mp.get_context("spawn").Process(
        target=_receiver_main, args=(port, results, corrupt_second, die_after_bucket)
    )
    p.start()
    return p


@pytest.mark.dist
def test_broadcast_bit_exact_versions_and_corrupted_bucket():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sender = BroadcastSender(num_receivers=1, timeout_s=30)
    proc = _spawn(sender.port, results, corrupt_second=True)
    try:
        w1, w2, w3 = perturbed_weights(1), perturbed_weights(2), perturbed_weights(3)
        sender.send(_buckets(w1), 1)
        assert results.get(timeout=60) == (1, {k: checksum(v) for k, v in w1.items()})
        with pytest.raises(SyncError, match="not applied.*checksum mismatch"):
            sender.send(_buckets(w2), 2)
        assert results.get(timeout=60)[0] == "error"
        assert results.get(timeout=60) == (1, {k: checksum(v) for k, v in w1.items()})  # untouched
        m = sender.send(_buckets(w3), 3)  # the next sync succeeds on the same group
        assert results.get(timeout=60) == (3, {k: checksum(v) for k, v in w3.items()})
        assert m["sync/bytes"] > 0
    finally:
        proc.join(timeout=30)
        proc.kill()


@pytest.mark.dist
def test_broadcast_receiver_killed_mid_transfer_then_recovers():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sender = BroadcastSender(num_receivers=1, timeout_s=20)
    proc = _spawn(sender.port, results, die_after_bucket=True)
    w1 = perturbed_weights(1)
    with pytest.raises(SyncError, match="broadcast sync to version 1 failed"):
        sender.send(_buckets(w1), 1)
    proc.join(timeout=30)
    with pytest.raises(queue.Empty):
        results.get(timeout=0.5)  # it never applied anything
    # a restarted engine process reconnects and the next sync succeeds
    proc2 = _spawn(sender.port, results)
    try:
        sender.send(_buckets(w1), 2)
        assert results.get(timeout=60) == (2, {k: checksum(v) for k, v in w1.items()})
    finally:
        proc2.kill()


def test_gpu_transports_need_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from tandem.sync.cuda import CudaIpcSender, CupyNcclSender

    with pytest.raises(SyncUnavailableError, match="needs a GPU"):
        CudaIpcSender(authkey=b"k")
    with pytest.raises(SyncUnavailableError, match="needs a GPU"):
        CupyNcclSender(num_receivers=1)


# -- Ray object store ----------------------------------------------------------------------------------


@pytest.mark.dist
def test_ray_object_store_transport():
    ray = pytest.importorskip("ray")
    from tandem.sync.ray_store import RaySender, receive_from_refs

    @ray.remote(num_cpus=0)
    class SinkActor:
        def __init__(self):
            torch.set_num_threads(1)
            self.sink = ModuleSink()

        def receive_weights(self, refs, headers, version):
            return receive_from_refs(refs, headers, version, self.sink.apply)

        def state(self):
            return self.sink.version, self.sink.digest()

    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
    )
    try:
        actor = SinkActor.remote()
        w1 = perturbed_weights(4)
        RaySender([actor]).send(_buckets(w1), 1)
        assert ray.get(actor.state.remote()) == (1, {k: checksum(v) for k, v in w1.items()})
        ray.kill(actor)
        with pytest.raises(SyncError, match="ray sync to version 2 failed"):
            RaySender([actor]).send(_buckets(w1), 2)
    finally:
        ray.shutdown()
