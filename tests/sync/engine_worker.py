"""An inference-engine process for the sync tests: a real `TorchEngine` that receives weights.

`EngineProcess` spawns `engine_main`, which builds the engine and obeys commands from the test:
attach a broadcast or disk receiver (an `EngineReceiver` thread each), stop one, report its state.
After every applied update the receiving thread writes ``engine_v<version>.json`` (the engine's
version and per-tensor digest) into ``out_dir``, so trainer processes can wait for it too.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MODEL = "tiny-llama"
PROMPT = [5, 17, 42, 7]


def build_engine(model: str = MODEL, device: str = "cpu"):
    from tandem.engines.inference.torch import TorchEngine
    from tandem.engines.inference.torch.config import TorchEngineConfig
    from tandem.models import ModelConfig

    config = TorchEngineConfig(model=ModelConfig(name=model), max_num_seqs=2, max_model_len=64, device=device)
    return TorchEngine(config)


def engine_digest(engine) -> dict[str, int]:
    """xxh3 of every engine weight, by HF name (the tied alias included)."""
    from tandem.sync import checksum

    return {k: checksum(v) for k, v in engine.named_weights().items()}


def greedy(engine, n: int = 6) -> list[int]:
    from tandem.core.protocols import GenerationRequest, SamplingParams

    request = GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(temperature=0, max_new_tokens=n))
    [result] = engine.generate([request])
    return result.completions[0].token_ids


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _kill_after(n_collectives: int) -> None:
    """Fault injection: SIGKILL this process at its ``n``-th broadcast (mid-transfer)."""
    import tandem.sync.broadcast as bmod

    real, count = bmod._bcast, {"n": 0}

    def dying(pg, t):
        count["n"] += 1
        if count["n"] == n_collectives:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(pg, t)

    bmod._bcast = dying


def engine_main(commands, results, out_dir: str, model: str, kill_at: int | None) -> None:
    from tandem.sync import EngineReceiver
    from tandem.sync.broadcast import BroadcastReceiver
    from tandem.sync.disk import DiskReceiver

    torch.set_num_threads(1)
    engine = build_engine(model)
    out = Path(out_dir)
    receivers: dict[str, EngineReceiver] = {}
    stopped: list[EngineReceiver] = []

    def on_update(version: int) -> None:
        state = {"weight_version": engine.weight_version, "digest": engine_digest(engine)}
        _write_json(out / f"engine_v{version}.json", state)

    if kill_at is not None:
        _kill_after(kill_at)
    while True:
        cmd, args = commands.get()
        if cmd == "broadcast":
            rx = BroadcastReceiver(host="127.0.0.1", timeout_s=120, **args)  # rank 0 may start slowly
            receivers[cmd] = EngineReceiver(engine, rx, on_update=on_update).start()
        elif cmd == "disk":
            rx = DiskReceiver(args["directory"])
            receivers[cmd] = EngineReceiver(engine, rx, on_update=on_update, poll_interval_s=0.05).start()
        elif cmd == "corrupt":
            receivers["broadcast"].receiver.corrupt_next_bucket = True
        elif cmd == "stop":
            stopped.append(receivers.pop(args["name"]))
            stopped[-1].stop()
        elif cmd == "state":
            every = [*stopped, *receivers.values()]
            errors = [e for r in every for e in r.errors]
            updates = sum(r.updates for r in every)
            results.put({"weight_version": engine.weight_version, "digest": engine_digest(engine),
                         "errors": errors, "updates": updates, "greedy": greedy(engine)})
            continue
        elif cmd == "quit":
            for r in receivers.values():
                r.stop(timeout_s=5)
            results.put("bye")
            results.close()
            results.join_thread()
            # a gloo group abandoned after a peer died blocks its destructor until its pending
            # collective times out (timeout_s); a test need not wait for that
            os._exit(0)
        results.put("ok")


class EngineProcess:
    """The test's handle on one spawned engine process."""

    def __init__(self, out_dir: Path, *, model: str = MODEL, kill_at: int | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=engine_main, args=(self.commands, self.results, str(out_dir), model, kill_at))
        self.proc.start()

    def call(self, cmd: str, timeout: float = 60, **args):
        self.commands.put((cmd, args))
        return self.results.get(timeout=timeout)

    def send(self, cmd: str, **args) -> None:
        """A command whose reply comes later (e.g. attaching to a sender that starts afterwards)."""
        self.commands.put((cmd, args))

    def reply(self, timeout: float = 60):
        return self.results.get(timeout=timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit", timeout=20)
            except (queue.Empty, OSError):
                pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def wait_for_file(path: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)
    return json.loads(path.read_text())


def gpu_receiver_main(kind: str, results, args: dict) -> None:
    """A GPU engine process for tests/sync/test_gpu.py: receive ``args["syncs"]`` updates, report."""
    from tandem.sync import WeightApplier

    torch.cuda.set_device(args.get("device_index", 0))
    engine = build_engine(device="cuda")
    if kind == "ipc":
        from tandem.sync.cuda import CudaIpcReceiver

        rx = CudaIpcReceiver(address=tuple(args["address"]), authkey=args["authkey"])
    elif kind == "nccl":
        from tandem.sync.broadcast import BroadcastReceiver

        rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=args["port"], device="cuda")
    else:
        from tandem.sync.cuda import CupyNcclReceiver

        rx = CupyNcclReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=args["port"])
    applier = WeightApplier(engine)
    for _ in range(args["syncs"]):
        try:
            rx.receive(applier)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put({"error": f"{type(e).__name__}: {e}"})
        results.put({"weight_version": engine.weight_version, "digest": engine_digest(engine)})


def crashing_sender_main(port: int, seed: int, version: int) -> None:
    """A trainer that sends one update and dies without closing its sender (its store dies with it)."""
    from tandem.sync.broadcast import BroadcastSender
    from tests.sync.sinks import perturbed_weights, weight_buckets

    sender = BroadcastSender(num_receivers=1, port=port, timeout_s=30)
    sender.send(weight_buckets(perturbed_weights(seed, MODEL)), version)
    os._exit(0)
