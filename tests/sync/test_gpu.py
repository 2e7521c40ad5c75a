"""GPU transports between two processes (skipped without CUDA; run by bench/gpu/sync_gpu.py).

CUDA IPC needs one GPU (both processes on it); NCCL (torch.distributed or cupy) needs one GPU per
rank, so those tests need two.
"""

from __future__ import annotations

import secrets

import pytest
import torch
import torch.multiprocessing as mp

from tandem.sync import SyncError, checksum
from tests.sync.engine_worker import MODEL, gpu_receiver_main
from tests.sync.sinks import perturbed_weights, weight_buckets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank (2 GPUs)")


def _cuda(weights):
    return {k: v.cuda() for k, v in weights.items()}


def _spawn(kind: str, **args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=gpu_receiver_main, args=(kind, results, args))
    proc.start()
    return proc, results


def _check(results, weights, version):
    state = results.get(timeout=120)
    assert "error" not in state, state
    assert state["weight_version"] == version
    assert {n: state["digest"][n] for n in weights} == {n: checksum(t) for n, t in weights.items()}


def test_cuda_ipc_round_trip_and_rejection():
    from tandem.sync.cuda import CudaIpcSender

    key = secrets.token_bytes(16)
    sender = CudaIpcSender(authkey=key)
    proc, results = _spawn("ipc", address=list(sender.address), authkey=key, syncs=3)
    try:
        w1, w2 = _cuda(perturbed_weights(1, MODEL)), _cuda(perturbed_weights(2, MODEL))
        metrics = sender.send(weight_buckets(w1), 1)
        _check(results, w1, 1)
        assert metrics["sync/bytes"] >= sum(t.numel() * 4 for t in w1.values())
        bad = {**w2, "model.norm.weight": torch.zeros(7, device="cuda")}
        with pytest.raises(SyncError, match="not applied.*model.norm.weight"):
            sender.send(weight_buckets(bad), 2)
        assert "error" in results.get(timeout=60)
        _check(results, w1, 1)  # untouched
        sender.send(weight_buckets(w2), 2)
        _check(results, w2, 2)
    finally:
        proc.join(timeout=60)
        proc.kill()
        sender.close()


@two_gpus
@pytest.mark.parametrize("kind", ["nccl", "cupy"])
def test_nccl_round_trip(kind):
    if kind == "cupy":
        pytest.importorskip("cupy")
        from tandem.sync.cuda import CupyNcclSender as Sender
    else:
        from tandem.sync.broadcast import BroadcastSender as Sender
    torch.cuda.set_device(0)
    kwargs = {"device": "cuda"} if kind == "nccl" else {}
    sender_holder = {}

    # the receiver (GPU 1) joins the store the sender hosts; NCCL init needs both sides at once
    import threading

    def make():
        sender_holder["s"] = Sender(num_receivers=1, port=port, **kwargs)

    from tests.engines.training.helpers import free_port

    port = free_port()
    thread = threading.Thread(target=make)
    thread.start()
    proc, results = _spawn(kind, port=port, syncs=1, device_index=1)
    try:
        thread.join(120)
        weights = _cuda(perturbed_weights(3, MODEL))
        sender_holder["s"].send(weight_buckets(weights), 1)
        _check(results, weights, 1)
    finally:
        proc.join(timeout=60)
        proc.kill()
