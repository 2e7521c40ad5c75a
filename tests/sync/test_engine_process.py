"""A 2-rank FSDP2 trainer -> a real `TorchEngine` in another process, over every CPU transport.

One engine process serves the whole module (spawning costs more than the checks): it receives from
the trainer's rank 0 by broadcast and disk (+ delta), then from the test process itself for the
failure cases. Ray gets its own engine, in an actor started by the trainer's rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch.multiprocessing as mp

from tandem.sync import SyncError
from tandem.sync.broadcast import BroadcastSender
from tests.engines.training.helpers import free_port, free_ports, run_workers
from tests.sync import e2e_workers
from tests.sync.engine_worker import EngineProcess, crashing_sender_main, wait_for_file
from tests.sync.sinks import perturbed_weights, weight_buckets

pytestmark = pytest.mark.dist
HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.fixture(scope="module")
def engine_proc(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine")
    proc = EngineProcess(out)
    proc.out = out
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def trained(engine_proc, tmp_path_factory):
    """Run the trainer ranks against the engine process; return rank 0's records."""
    out, disk = engine_proc.out, tmp_path_factory.mktemp("disk")
    # distinct ports: the engine polls the sync port before the trainer hosts it, and must never reach
    # the trainer's own rendezvous store instead
    port, master_port = free_ports(2)
    assert engine_proc.call("disk", directory=str(disk)) == "ok"
    engine_proc.send("broadcast", rank=1, num_receivers=1, port=port)  # connects once rank 0 hosts the store
    run_workers(e2e_workers.trainer_main, 2, str(out), port, str(disk), HAS_RAY, master_port=master_port)
    assert engine_proc.reply() == "ok"
    records = json.loads((out / "trainer.json").read_text())
    engine_proc.call("stop", name="broadcast")
    engine_proc.call("stop", name="disk")
    return records


def _hashes(digest: dict) -> dict[str, int]:
    return {n: h for n, (h, _) in digest.items()}


def _assert_engine_equals_trainer(record: dict, version: int) -> None:
    trainer, engine = _hashes(record["trainer"]), record["engine"]
    assert engine["weight_version"] == version
    assert {n: engine["digest"][n] for n in trainer} == trainer  # bit for bit, every synced tensor
    assert engine["digest"]["lm_head.weight"] == trainer["model.embed_tokens.weight"]  # tied alias


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_fsdp_trainer_to_engine_process_is_bit_exact(trained, version):
    _assert_engine_equals_trainer(trained[str(version)], version)


def test_broadcast_verify_checks_every_tensor(trained):
    metrics = trained["1"]["metrics"]
    assert metrics["sync/verified_tensors"] == len(trained["1"]["trainer"])
    assert metrics["sync/buckets"] > 1 and metrics["sync/bytes"] >= sum(b for _, b in trained["1"]["trainer"].values())


def test_disk_delta_writes_exactly_the_changed_tensors(trained):
    def changed(a: str, b: str) -> set[str]:
        old, new = _hashes(trained[a]["trainer"]), _hashes(trained[b]["trainer"])
        return {n for n in new if new[n] != old.get(n)}

    sizes = {n: b for n, (_, b) in trained["5"]["trainer"].items()}
    assert trained["2"]["metrics"]["sync/bytes"] == sum(sizes.values())  # first version: everything
    assert trained["3"]["metrics"]["sync/bytes"] == 0  # nothing trained in between
    assert trained["4"]["metrics"]["sync/bytes"] == sum(sizes[n] for n in changed("3", "4")) > 0
    lora_changed = changed("4", "5")
    assert lora_changed and all(".q_proj." in n or ".v_proj." in n for n in lora_changed)
    assert trained["5"]["metrics"]["sync/bytes"] == sum(sizes[n] for n in lora_changed)
    for v in ("2", "3", "4", "5"):
        assert trained[v]["metrics"]["sync/bytes_total"] == sum(sizes.values())


@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed")
def test_ray_actor_engine_is_bit_exact_and_verified(trained):
    ray = trained["ray"]
    assert ray["before"]["weight_version"] == 0 and ray["after"]["weight_version"] == 6
    trainer = _hashes(ray["trainer"])
    assert {n: ray["after"]["digest"][n] for n in trainer} == trainer
    assert ray["before"]["digest"] != ray["after"]["digest"]
    assert ray["metrics"]["sync/verified_tensors"] == len(trainer)
    assert ray["dead_actor_error"].startswith("ray sync to version 7 failed: ActorDiedError")


def test_engine_counted_one_update_per_sync(trained, engine_proc):
    state = engine_proc.call("state")
    assert state["weight_version"] == 5 and state["updates"] == 5 and state["errors"] == []
    assert len(state["greedy"]) == 6  # still serving


# -- failures, with the same engine process surviving them ----------------------------------------------


def _expect(state: dict, weights: dict, version: int) -> None:
    assert state["weight_version"] == version
    from tandem.sync import checksum

    assert {n: state["digest"][n] for n in weights} == {n: checksum(t) for n, t in weights.items()}


def _state_after_error(proc: EngineProcess, timeout: float = 10) -> dict:
    """The engine's state once its receiver has recorded an error (it notices an abort within ~0.1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        state = proc.call("state")
        if state["errors"] or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def test_receiver_killed_mid_transfer_engine_keeps_old_weights_then_next_sync_succeeds(trained, engine_proc):
    w1, w2 = perturbed_weights(11, e2e_workers.MODEL), perturbed_weights(12, e2e_workers.MODEL)
    sender = BroadcastSender(num_receivers=2, timeout_s=30)
    engine_proc.send("broadcast", rank=1, num_receivers=2, port=sender.port)
    # a second engine process that dies in the second sync, after its first bucket: a sync takes
    # 3 broadcasts per bucket (control, header, body) + COMMIT; SIGKILL at the 4th of the second
    per_sync = 3 * len(list(weight_buckets(w1))) + 1
    doomed = EngineProcess(engine_proc.out / "doomed", kill_at=per_sync + 4)
    doomed.send("broadcast", rank=2, num_receivers=2, port=sender.port)
    restarted = None
    try:
        sender.send(weight_buckets(w1), 10)
        assert engine_proc.reply() == "ok" and doomed.reply() == "ok"
        _expect(engine_proc.call("state"), w1, 10)
        with pytest.raises(SyncError, match="broadcast sync to version 11 failed"):
            sender.send(weight_buckets(w2), 11)
        doomed.proc.join(timeout=30)
        assert doomed.proc.exitcode == -9  # SIGKILLed mid-transfer
        state = _state_after_error(engine_proc)
        _expect(state, w1, 10)  # the survivor: old version, old weights, still serving
        assert all("version 11" in e or "aborted" in e for e in state["errors"])  # nothing else went wrong
        assert len(state["greedy"]) == 6
        # a restarted second engine joins a new group; the retried sync reaches both
        restarted = EngineProcess(engine_proc.out / "restarted")
        restarted.send("broadcast", rank=2, num_receivers=2, port=sender.port)
        sender.send(weight_buckets(w2), 11)
        assert restarted.reply() == "ok"
        _expect(engine_proc.call("state"), w2, 11)
        _expect(restarted.call("state"), w2, 11)
        # a corrupted bucket on one receiver: neither engine applies (two-phase commit)
        restarted.call("corrupt")
        with pytest.raises(SyncError, match="receiver 2: .*checksum mismatch"):
            sender.send(weight_buckets(w1), 12)
        _expect(engine_proc.call("state"), w2, 11)
        _expect(restarted.call("state"), w2, 11)
        # an update the engines reject (unknown tensor): named in the sender's error, nothing applied
        bad = [[("model.layers.9.mlp.up_proj.weight", w1["model.norm.weight"])]]
        with pytest.raises(SyncError, match="receiver 1: .*unknown weight 'model.layers.9"):
            sender.send(bad, 12)
        _expect(engine_proc.call("state"), w2, 11)
        sender.send(weight_buckets(w1), 12)
        _expect(engine_proc.call("state"), w1, 12)
    finally:
        sender.close()
        engine_proc.call("stop", name="broadcast")
        for proc in (restarted, doomed):
            if proc is not None:
                proc.close()


def test_engine_idles_longer_than_the_collective_timeout(trained, engine_proc):
    w = perturbed_weights(13, e2e_workers.MODEL)
    sender = BroadcastSender(num_receivers=1, timeout_s=2)
    assert engine_proc.call("broadcast", rank=1, num_receivers=1, port=sender.port) == "ok"
    try:
        sender.send(weight_buckets(w), 20)
        time.sleep(3)  # a gloo op would time out after 2 s; announcements wait in the store
        sender.send(weight_buckets(perturbed_weights(14, e2e_workers.MODEL)), 21)
        wait_for_file(engine_proc.out / "engine_v21.json")
        assert engine_proc.call("state")["weight_version"] == 21
    finally:
        sender.close()
        engine_proc.call("stop", name="broadcast")


def test_engine_reconnects_to_a_restarted_trainer(trained, engine_proc):
    port = free_port()
    crashed = mp.get_context("spawn").Process(target=crashing_sender_main, args=(port, 15, 30))
    crashed.start()
    engine_proc.send("broadcast", rank=1, num_receivers=1, port=port)
    try:
        crashed.join(60)
        assert engine_proc.reply() == "ok" and engine_proc.call("state")["weight_version"] == 30
        sender = BroadcastSender(num_receivers=1, port=port, timeout_s=30)  # the restarted trainer
        w = perturbed_weights(16, e2e_workers.MODEL)
        sender.send(weight_buckets(w), 31)
        _expect(engine_proc.call("state"), w, 31)
        sender.close()
    finally:
        engine_proc.call("stop", name="broadcast")
