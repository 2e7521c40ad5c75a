"""Failover: a failed broadcast is sent again, then through disk; the engine ends on the trainer's weights.

Real transports and a real `TorchEngine` throughout. Faults are injected into a real `BroadcastSender`:
`drop_link` makes its link drop mid-update (after the first bucket crossed, the next control word
raises as a reset connection would), so the receiver holds a partial update when the sender abandons
the group; or the receivers never join and the sender times out.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tandem.config import ConfigError, from_dict, load_config
from tandem.runtime.config import RunConfig
from tandem.sync import EngineReceiver, SyncConfig, SyncError, build_receiver, build_sender, checksum
from tandem.sync.base import tensor_hashes
from tandem.sync.broadcast import BroadcastReceiver, BroadcastSender
from tandem.sync.disk import DiskReceiver, DiskSender
from tandem.sync.failover import FailoverReceiver, FailoverSender
from tests.sync.engine_worker import MODEL, build_engine, engine_digest
from tests.sync.sinks import perturbed_weights, weight_buckets

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
FOREVER = 1 << 30


def drop_link(sender: BroadcastSender, drops: dict[int, int], *, after: int = 1) -> list[int]:
    """Fault injection into a real broadcast sender: the first ``drops[v]`` sends of version ``v`` lose
    their link after ``after`` buckets crossed (the next bucket's control word raises
    ``ConnectionResetError`` inside the transfer: the sender abandons the group, the receiver has staged
    part of the update). Returns the versions whose link dropped, in order."""
    real = sender._control
    crossed: Counter = Counter()
    dropped: list[int] = []

    def control(group, version: int, kind: int, n: int) -> None:
        if kind >= 0 and drops.get(version, 0) > 0:  # a bucket's control word (COMMIT / ABORT are < 0)
            key = (group.session, group.seq)
            if crossed[key] >= after:
                drops[version] -= 1
                dropped.append(version)
                raise ConnectionResetError(f"injected: the link dropped after {after} bucket(s) of version {version}")
            crossed[key] += 1
        real(group, version, kind, n)

    sender._control = control
    return dropped


def _holds(engine, weights: dict[str, torch.Tensor]) -> bool:
    got = engine_digest(engine)
    return {n: got[n] for n in weights} == {n: checksum(t) for n, t in weights.items()}


def _wait_version(engine, version: int, timeout_s: float = 20) -> None:
    """What the loop does after a send (disk applies in the engine's own time)."""
    deadline = time.monotonic() + timeout_s
    while engine.weight_version < version:
        assert time.monotonic() < deadline, f"the engine is at version {engine.weight_version}, not {version}"
        time.sleep(0.01)


def _wait_applied(applied: list[int], n: int, timeout_s: float = 10) -> None:
    """``on_update`` runs in the receiving thread just after the engine took the version: wait for it."""
    deadline = time.monotonic() + timeout_s
    while len(applied) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def _pair(tmp_path: Path, *, retries: int = 1, fallback: bool = True, timeout_s: float = 5):
    """A failover sender (broadcast, then disk) and an engine listening on both, as a run builds them."""
    cfg = SyncConfig(transport="broadcast", retries=retries, fallback="disk" if fallback else None,
                     directory=str(tmp_path / "weights"), timeout_s=timeout_s, poll_interval_s=0.02,
                     secret="the-run-secret")
    sender = build_sender(cfg)
    sender.secret = cfg.secret.encode()  # what builders.build_separate does
    engine = build_engine()
    applied: list[int] = []
    rx = EngineReceiver(engine, build_receiver(dataclasses.replace(cfg, port=sender.port)), poll_interval_s=0.02, on_update=applied.append).start()
    return sender, engine, rx, applied


def test_a_dropped_broadcast_changes_nothing_and_is_sent_again_with_the_same_version(tmp_path):
    sender, engine, rx, applied = _pair(tmp_path, fallback=False)
    try:
        assert isinstance(sender, FailoverSender) and isinstance(rx.receiver, BroadcastReceiver)
        w1, w2, w3 = (perturbed_weights(i, MODEL) for i in (1, 2, 3))
        assert len(list(weight_buckets(w2))) > 2  # the drop happens mid-update
        m1 = sender.send(weight_buckets(w1), 1)
        assert "sync/retries" not in m1 and "sync/failovers" not in m1  # no fallback: only a retry is reported
        # v2: the link drops once mid-update; the receiver drops what it staged, the retry carries v2
        dropped = drop_link(sender.primary, {2: 1})
        m2 = sender.send(weight_buckets(w2), 2)
        assert dropped == [2] and m2["sync/retries"] == 1 and m2["sync/buckets"] == len(list(weight_buckets(w2)))
        assert engine.weight_version == 2 and _holds(engine, w2)
        assert rx.errors and "aborted" in rx.errors[0]  # the partial v2 was refused, not applied
        # v3: the link drops twice, retries=1 is spent and there is no fallback: the send fails, and the
        # engine holds v2 whole (the partial v3 applied nothing)
        drop_link(sender.primary, {3: 2})
        with pytest.raises(SyncError, match="broadcast sync to version 3 failed: ConnectionResetError: injected"):
            sender.send(weight_buckets(w3), 3)
        time.sleep(0.3)  # time for the receiver to notice the abort
        assert engine.weight_version == 2 and _holds(engine, w2)
        sender.send(weight_buckets(w3), 3)  # the trainer sends the same version again: a new group carries it
        assert engine.weight_version == 3 and _holds(engine, w3)
        _wait_applied(applied, 3)
        assert applied == [1, 2, 3] and sender.total_retries == 2  # nothing skipped, nothing applied twice
    finally:
        sender.close()
        rx.stop(timeout_s=5)


def test_spent_retries_fall_back_to_disk_for_the_rest_of_the_run(tmp_path):
    # an earlier run left a newer version in the fallback directory: the engine must never load it
    stale = DiskSender(tmp_path / "weights", secret="the-run-secret")
    stale.send(weight_buckets(perturbed_weights(9, MODEL)), 50)
    stale.close()
    sender, engine, rx, applied = _pair(tmp_path)
    try:
        assert isinstance(rx.receiver, FailoverReceiver)
        assert not (tmp_path / "weights" / "LATEST").exists()
        weights = {v: perturbed_weights(v, MODEL) for v in (1, 2, 3, 4)}
        dropped = drop_link(sender.primary, {2: FOREVER, 3: FOREVER, 4: FOREVER})
        metrics = {}
        for v, w in weights.items():
            metrics[v] = sender.send(weight_buckets(w), v)
            _wait_version(engine, v)
            assert _holds(engine, w), v
        # v1 by broadcast; v2: two broken broadcasts (retries=1), then disk; v3, v4: disk at once (sticky)
        assert dropped == [2, 2]
        assert [(m["sync/retries"], m["sync/failovers"], m["sync/transport_fallback"]) for m in metrics.values()] == [
            (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.0, 0.0, 1.0), (0.0, 0.0, 1.0)]
        assert "sync/buckets" in metrics[1] and "sync/bytes_total" in metrics[2]  # broadcast's, then disk's
        _wait_applied(applied, 4)
        assert applied == [1, 2, 3, 4] and engine.weight_version == 4  # no version skipped or repeated
        assert sender.on_fallback and sender.failovers == 1 and sender.total_retries == 1
        health = rx.health()
        assert health["transports"]["broadcast"]["updates"] == 1 and health["transports"]["disk"]["updates"] == 3
        assert health["transports"]["disk"]["errors"] == 0
        # the failed primary was closed: the engine's broadcast thread stopped, the disk thread serves on
        deadline = time.monotonic() + 5
        while [t.is_alive() for t in rx._threads] != [False, True] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [t.is_alive() for t in rx._threads] == [False, True] and rx.running
    finally:
        sender.close()
        rx.stop(timeout_s=5)


def test_a_primary_that_times_out_falls_back(tmp_path):
    # the engine side listens on disk only: the broadcast waits timeout_s for a receiver, twice
    sender = FailoverSender(BroadcastSender(num_receivers=1, timeout_s=1), DiskSender(tmp_path), retries=1)
    engine = build_engine()
    try:
        with EngineReceiver(engine, DiskReceiver(tmp_path), poll_interval_s=0.02) as rx:
            w = perturbed_weights(1, MODEL)
            start = time.monotonic()
            metrics = sender.send(weight_buckets(w), 1)
            assert 2 <= time.monotonic() - start < 10
            assert metrics["sync/retries"] == 1 and metrics["sync/failovers"] == 1
            _wait_version(engine, 1)
            assert _holds(engine, w) and rx.errors == []
    finally:
        sender.close()


def test_what_is_not_retried(tmp_path):
    sender, engine, rx, applied = _pair(tmp_path)
    try:
        w1 = perturbed_weights(1, MODEL)

        def failing():  # the trainer's gather fails after two buckets: the weights are not there to send
            buckets = weight_buckets(w1)
            yield next(buckets)
            yield next(buckets)
            raise RuntimeError("all-gather failed")

        with pytest.raises(SyncError, match="version 1 cancelled, weights unchanged.*all-gather failed"):
            sender.send(failing(), 1)
        assert sender.total_retries == 0 and not sender.on_fallback and engine.weight_version == 0
        # the engine process died: the loop cancels; nothing is retried or sent elsewhere
        sender.cancel()
        with pytest.raises(SyncError, match="cancelled"):
            sender.send(weight_buckets(w1), 1)
        assert sender.total_retries == 0 and not sender.on_fallback and applied == []
    finally:
        sender.close()
        rx.stop(timeout_s=5)


def test_failover_config():
    cfg = from_dict(SyncConfig, {"transport": "broadcast", "fallback": "disk", "directory": "/tmp/w", "retries": 2,
                                 "secret": "s3cret"})
    assert cfg.to_config_dict()["fallback"] == "disk" and cfg.to_config_dict()["retries"] == 2
    assert "secret" not in cfg.to_config_dict()
    assert SyncConfig().retries == 1 and SyncConfig().fallback is None
    refused = [
        ({"transport": "broadcast", "fallback": "disk"}, "fallback='disk' needs sync.directory"),
        ({"transport": "disk", "fallback": "disk", "directory": "w"}, "fallback='disk' is the transport itself"),
        ({"transport": "inprocess", "fallback": "disk", "directory": "w"},
         "fallback='disk' does not work with transport='inprocess'.*colocated"),
        ({"transport": "ray", "fallback": "disk", "directory": "w"}, "fallback='disk' does not work with transport='ray'"),
        ({"transport": "broadcast", "fallback": "broadcast"}, "fallback: 'broadcast' is not a valid choice"),
        ({"retries": -1}, "retries=-1 must be >= 0"),
    ]
    for values, message in refused:
        with pytest.raises(ConfigError, match=message):
            from_dict(SyncConfig, values)
    # the colocated placement resolves sync.transport: auto to inprocess, which has nothing to fall back from
    with pytest.raises(ConfigError, match="fallback='disk' does not work with transport='inprocess'"):
        load_config(RunConfig, RECIPE, ["sync.fallback=disk", "sync.directory=/tmp/w"])
    separate = load_config(RunConfig, RECIPE, ["runtime.placement=separate", "sync.fallback=disk",
                                               "sync.directory=/tmp/w"])
    assert separate.sync.transport == "broadcast" and separate.sync.fallback == "disk"


def test_a_run_whose_broadcast_breaks_at_step_1_completes_on_disk(tmp_path):
    from tandem.runtime.loop import Run
    from tandem.runtime.tracking import read_metrics

    def trainer_hashes() -> dict[str, int]:
        return tensor_hashes(nt for bucket in run.trainer.named_parameters_for_sync(1 << 30) for nt in bucket)

    cfg = load_config(RunConfig, RECIPE, [
        "runtime.placement=separate", "sync.transport=broadcast", "sync.fallback=disk",
        f"sync.directory={tmp_path / 'weights'}", "sync.poll_interval_s=0.05", "sync.timeout_s=20",
        "sync.bucket_bytes=65536",  # several buckets: the link drops mid-update
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]",  # a reward that moves the weights
        "rollout.dump=true"])
    run = Run(cfg, tmp_path / "run")
    try:
        assert isinstance(run.sync, FailoverSender)
        dropped = drop_link(run.sync.primary, {2: FOREVER})  # the sync at the end of step 1 is version 2
        before = trainer_hashes()
        run.train(close=False)
        after = trainer_hashes()
        engine = run.engine.weight_digest()
        deadline = time.monotonic() + 5  # the receiving thread counts an update just after the engine took it
        while (health := run.engine.health()["sync"])["updates"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        run.close()
    assert dropped == [2, 2]
    assert any(before[k] != after[k] for k in before), "no weight changed"
    assert {k: engine[k] for k in after} == after  # the engine process ends on the trainer's weights
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["sync/version"] for r in rows] == [1.0, 2.0, 3.0]
    assert [(r["sync/retries"], r["sync/failovers"], r["sync/transport_fallback"]) for r in rows] == [
        (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.0, 0.0, 1.0)]
    assert health["weight_version"] == 3 and health["updates"] == 3
    assert health["transports"]["broadcast"]["updates"] == 1 and health["transports"]["disk"]["updates"] == 2
    # every rollout after a sync ran on that version: none on the old weights, none skipped
    for step in (1, 2):
        dumped = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / f"step_{step}.jsonl").read_text()
                  .splitlines()]
        assert dumped and all(row["weight_versions"] == [step] for row in dumped)
