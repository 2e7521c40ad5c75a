"""Bandwidth of every CPU weight-sync transport on SmolLM2-135M's weights, against its physical limit.

    python bench/sync_bandwidth.py [--rounds R] [--bucket-mb MB] [--only NAME ...] [--skip-ray]

The trainer side holds SmolLM2-135M-Instruct's fp32 weights (538 MB) as separate tensors; each
transport moves them into a real `TorchEngine`. The headline in-process figure (``inprocess``) is the
default engine (``pack_weights=True``: every update packs the linear weights into oneDNN's blocked
layout, into the packed tensors in place where tandem/ops/csrc/pack.c applies; the decoder layers' linear
weights keep no plain copy, ``keep_plain_weights=False``); ``inprocess_both`` is the same engine keeping the
plain copies too (both written in one pass); ``inprocess_reorder`` keeps both and re-packs through oneDNN's
reorder into new tensors (the path before in-place packing, for comparison); ``inprocess_unpacked`` is the
transport alone (``pack_weights=False``). ``engine_weights_mb_*``: the weights each engine holds. Each baseline moves
the same number of bytes in the same run:

* in-process and Ray   vs  memcpy: ``dst.copy_(src)`` of one 538 MB buffer (bytes written per second)
* broadcast (gloo)     vs  raw gloo: a bare ``ProcessGroupGloo`` broadcast of the same buckets'
  bytes between two processes (the sync's own overhead: bucketing, checksums, the two-phase commit,
  the copy into the engine); a loopback TCP socket is printed as well
* disk                 vs  sequential write: one 538 MB file written and fsynced in the same folder

The price of packing is put next to what it buys: ``decode_step_ms`` of 8 sequences on the packed and
the unpacked engine (the same requests), so ``repack_s / saved_per_decode_step`` says how many decode
steps pay for one sync's re-packing.

Measurements run in two groups: those that need no helper process (memcpy, in-process, write, disk),
then those that do (loopback, gloo, Ray, and memcpy again as Ray's baseline), so that idle peers and
a Ray cluster do not load the first group. Within a group every measurement is set up once (peers
started, buffers allocated), then the rounds run them interleaved (one of each per round), so a
baseline and its transport see the same background load on a shared machine. Round 0 is a warm-up;
a figure is the median of the other rounds, in bytes of weights per second. Ratios are transport /
baseline. Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = "smollm2-135m-instruct"
Step = tuple[Callable[[int], None], Callable[[int], None]]  # (prepare(round), timed(round))


ENGINE_MB: dict[str, float] = {}  # arm -> MB of weights the engine holds (plain + packed copies)


def _engine(pack: bool = False, keep_plain: bool = False, arm: str | None = None):
    from tandem.engines.inference.torch import TorchEngine
    from tandem.engines.inference.torch.config import TorchEngineConfig
    from tandem.models import ModelConfig

    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name=MODEL), max_num_seqs=8, max_model_len=64,
                                           pack_weights=pack, keep_plain_weights=keep_plain))
    if arm is not None:
        health = engine.health()
        ENGINE_MB[arm] = (health["plain_weight_bytes"] + health["packed_weight_bytes"]) / 1e6
    return engine


def trainer_weights() -> dict[str, torch.Tensor]:
    """What a trainer holds after a step: the model's weights, changed, as separate tensors."""
    from tandem.models import resolve_model
    from tandem.models.transformer import CausalLM

    model = CausalLM.from_pretrained(resolve_model(MODEL))
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:  # tied weights travel once
            seen.add(t.data_ptr())
            out[name] = t.detach() * 1.0001
    return out


def _buckets(weights: dict[str, torch.Tensor], bucket_bytes: int):
    from tandem.sync import bucketize

    return bucketize(weights.items(), bucket_bytes)


def _nothing(_: int) -> None:
    pass


# -- peer processes (spawned) ---------------------------------------------------------------------------


def _socket_peer(port: int, nbytes: int, rounds: int) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    view = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], min(8 << 20, nbytes - got))
        conn.sendall(b"k")
    conn.close()


def _gloo_raw_peer(port: int, sizes: list[int], rounds: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=300))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(rounds):
        for b in buffers:
            pg.broadcast([b], opts).wait()


def _broadcast_peer(port: int) -> None:
    from tandem.sync import EngineReceiver
    from tandem.sync.broadcast import BroadcastReceiver

    torch.set_num_threads(1)
    rx = BroadcastReceiver(rank=1, num_receivers=1, host="127.0.0.1", port=port, timeout_s=300)
    receiver = EngineReceiver(_engine(), rx)
    while receiver.serve_once() is not None:
        pass


def _spawn(target, *args) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


# -- measurements: each returns (prepare, timed) ------------------------------------------------------------


def memcpy(nbytes: int) -> Step:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    return _nothing, lambda _: dst.copy_(src)


def loopback(nbytes: int, rounds: int) -> Step:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    _spawn(_socket_peer, listener.getsockname()[1], nbytes, rounds)
    conn, _ = listener.accept()
    data = memoryview(bytearray(b"\x01" * nbytes))

    def one(_):
        conn.sendall(data)
        conn.recv(1)

    return _nothing, one


def gloo_raw(weights, bucket_bytes: int, rounds: int) -> Step:
    from tandem.sync.base import flatten_bucket

    flats = [flatten_bucket(b)[0] for b in _buckets(weights, bucket_bytes)]
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=300),
                          wait_for_workers=False)
    _spawn(_gloo_raw_peer, store.port, [f.numel() for f in flats], rounds)
    pg = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=300))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def one(_):
        works = [pg.broadcast([f], opts) for f in flats]
        for w in works:
            w.wait()

    return _nothing, one


def write(directory: Path, nbytes: int) -> Step:
    data = memoryview(bytearray(b"\x01" * nbytes))
    path = directory / "baseline.bin"

    def one(_):
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return (lambda _: path.unlink(missing_ok=True)), one


ENGINES: dict[bool, object] = {}  # pack_weights -> the in-process target engine (for decode_step_ms)


def inprocess(weights, bucket_bytes: int, pack: bool, reorder: bool = False, keep_plain: bool = False,
              arm: str | None = None) -> Step:
    from unittest import mock

    from tandem.sync import InProcessSync

    engine = _engine(pack, keep_plain, arm)
    if not reorder and not keep_plain:
        ENGINES[pack] = engine
    sync = InProcessSync(engine)

    def send(r: int) -> None:
        if reorder:  # every packed copy re-made by oneDNN's reorder, as before in-place packing
            with mock.patch("tandem.ops.linear._write_packed", return_value=False):
                sync.send(_buckets(weights, bucket_bytes), r + 1)
        else:
            sync.send(_buckets(weights, bucket_bytes), r + 1)

    return _nothing, send


def decode_step_ms(engines: dict[bool, object], rounds: int) -> dict[bool, list[float]]:
    """Milliseconds per decode step of 8 sequences (16-token prompts, 32 new tokens, the same seeds), the
    packed and the unpacked engine alternating; from the engines' own step counters (prefill excluded)."""
    from tandem.core.protocols import GenerationRequest, SamplingParams

    requests = [GenerationRequest(prompt_token_ids=list(range(100 + i, 116 + i)),
                                  sampling=SamplingParams(max_new_tokens=32, seed=i))
                for i in range(8)]
    out: dict[bool, list[float]] = {pack: [] for pack in engines}
    for r in range(rounds + 1):
        for pack, engine in engines.items():
            before = engine.health()
            engine.generate(requests)
            after = engine.health()
            steps = after["steps"] - before["steps"] - 1  # the first step is the prompts' prefill
            if r and steps > 0:
                out[pack].append(1e3 * (after["step_seconds"] - before["step_seconds"]) / (steps + 1))
    return out


def gloo(weights, bucket_bytes: int) -> Step:
    from tandem.sync.broadcast import BroadcastSender

    sender = BroadcastSender(num_receivers=1, timeout_s=300)
    _spawn(_broadcast_peer, sender.port)
    return _nothing, lambda r: sender.send(_buckets(weights, bucket_bytes), r + 1)


def disk(weights, bucket_bytes: int, root: Path) -> Step:
    """Full (non-delta) versions; each round's weights are new values, so no blob can be reused."""
    from tandem.sync.disk import DiskSender

    sender = DiskSender(root, keep_versions=1)
    changed: dict[str, dict] = {}

    def prepare(r: int) -> None:
        changed["w"] = {k: t * (1 + 1e-3 * (r + 1)) for k, t in weights.items()}
        # A run trains for seconds between syncs, and the previous version's background pruning (unlinking
        # 538 MB of blobs) ends long before the next send; back-to-back rounds would time it inside the send,
        # as the baseline would its file's unlink (its prepare). Untimed on both sides.
        sender._finish_pruning()

    return prepare, lambda r: sender.send(_buckets(changed.pop("w"), bucket_bytes), r + 1)


def disk_read(root: Path) -> Step:
    """A fresh receiver each time loads the whole newest version (from the page cache) into an engine."""
    from tandem.sync.disk import DiskReceiver

    engine = _engine()
    return _nothing, lambda _: DiskReceiver(root).poll(engine.update_weights)


class _RayEngine:
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.engine = _engine()

    def receive_weights(self, refs, headers, version, verify=False):
        from tandem.sync.ray_store import receive_from_refs

        return receive_from_refs(refs, headers, version, self.engine.update_weights, verify=verify)


def ray_store(weights, bucket_bytes: int) -> Step | None:
    try:
        import ray
    except ImportError:
        return None
    from tandem.sync.ray_store import RaySender

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    sender = RaySender([ray.remote(num_cpus=0)(_RayEngine).remote()])
    return _nothing, lambda r: sender.send(_buckets(weights, bucket_bytes), r + 1)


# -- main ----------------------------------------------------------------------------------------------


def run(steps: dict[str, Step], rounds: int) -> dict[str, list[float]]:
    """Seconds of each step in ``rounds`` interleaved rounds after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds + 1):
        for name, (prepare, timed) in steps.items():
            prepare(r)
            t0 = time.perf_counter()
            timed(r)
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--only", nargs="*", default=None, help="measure only these (and their baselines)")
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    weights = trainer_weights()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    bucket, rounds = args.bucket_mb << 20, args.rounds + 1
    print(f"{MODEL}: {len(weights)} tensors, {nbytes / 1e6:.0f} MB; bucket {args.bucket_mb} MiB; "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}", flush=True)
    tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TANDEM_BENCH_DIR"))
    root = Path(tmp.name)
    builders: dict[str, Callable[[], Step | None]] = {
        "memcpy": lambda: memcpy(nbytes),
        "inprocess": lambda: inprocess(weights, bucket, pack=True, arm="inprocess"),  # the default engine
        # the default engine keeping the plain copy of its packed weights too (keep_plain_weights: true)
        "inprocess_both": lambda: inprocess(weights, bucket, pack=True, keep_plain=True, arm="inprocess_both"),
        "inprocess_reorder": lambda: inprocess(weights, bucket, pack=True, reorder=True, keep_plain=True),
        "inprocess_unpacked": lambda: inprocess(weights, bucket, pack=False),
        "write": lambda: write(root, nbytes),
        "disk": lambda: disk(weights, bucket, root / "sync"),
        "disk_read": lambda: disk_read(root / "sync"),
        # the second group has helper processes (socket and gloo peers, a Ray cluster): they idle in
        # the background of every measurement of their group, so memcpy is measured again with them
        "memcpy_with_peers": lambda: memcpy(nbytes),
        "loopback": lambda: loopback(nbytes, rounds),
        "gloo_raw": lambda: gloo_raw(weights, bucket, rounds),
        "gloo": lambda: gloo(weights, bucket),
        "ray": lambda: None if args.skip_ray else ray_store(weights, bucket),
    }
    groups = [["memcpy", "inprocess", "inprocess_both", "inprocess_reorder", "inprocess_unpacked", "write", "disk",
               "disk_read"],
              ["memcpy_with_peers", "loopback", "gloo_raw", "gloo", "ray"]]
    baselines = {"memcpy", "memcpy_with_peers", "loopback", "write", "gloo_raw"}
    wanted = set(builders) if args.only is None else set(args.only) | baselines
    decode: dict[bool, list[float]] | None = None
    if "disk_read" in wanted:
        wanted.add("disk")
    times: dict[str, list[float]] = {}
    for group in groups:  # built just before they run: the first group runs without helper processes
        steps = {name: step for name in group if name in wanted and (step := builders[name]()) is not None}
        times |= run(steps, args.rounds)
        if len(ENGINES) == 2:
            decode = decode_step_ms(ENGINES, min(args.rounds, 3))
            ENGINES.clear()
    tmp.cleanup()
    rates = {name: nbytes / statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:>24}: {rates[name] / 1e9:6.2f} GB/s (median; {nbytes / max(t) / 1e9:.2f}-"
              f"{nbytes / min(t) / 1e9:.2f} over {len(t)} rounds)")
    pairs = {
        "inprocess_vs_memcpy": ("inprocess", "memcpy"),  # the default engine path
        "gloo_vs_gloo_raw": ("gloo", "gloo_raw"),
        "disk_vs_write": ("disk", "write"),
        "ray_vs_memcpy": ("ray", "memcpy_with_peers"),
        "inprocess_both_vs_memcpy": ("inprocess_both", "memcpy"),
        "inprocess_reorder_vs_memcpy": ("inprocess_reorder", "memcpy"),
        "inprocess_unpacked_vs_memcpy": ("inprocess_unpacked", "memcpy"),
        "gloo_vs_loopback": ("gloo", "loopback"),
        "gloo_raw_vs_loopback": ("gloo_raw", "loopback"),
        "disk_read_vs_memcpy": ("disk_read", "memcpy"),
    }
    result = {key: rates[a] / rates[b] for key, (a, b) in pairs.items() if a in rates and b in rates}
    for key in ("inprocess_vs_memcpy", "gloo_vs_gloo_raw", "disk_vs_write"):
        if key in result:
            print(f"  {key}: {result[key]:.2f}")
    result |= {f"{k}_gbps": v / 1e9 for k, v in rates.items()}
    result |= {f"{k}_spread": (max(t) - min(t)) / statistics.median(t) for k, t in times.items()}
    if "inprocess" in times and "inprocess_unpacked" in times:
        result["repack_s"] = statistics.median(times["inprocess"]) - statistics.median(times["inprocess_unpacked"])
    if decode is not None and decode[True] and decode[False]:
        packed_ms, plain_ms = statistics.median(decode[True]), statistics.median(decode[False])
        result |= {"decode_step_ms_packed": packed_ms, "decode_step_ms_unpacked": plain_ms}
        if "repack_s" in result and plain_ms > packed_ms:
            result["repack_paid_back_in_decode_steps"] = 1e3 * result["repack_s"] / (plain_ms - packed_ms)
        print(f"  decode step of 8 sequences: {packed_ms:.1f} ms packed, {plain_ms:.1f} ms unpacked")
    result |= {f"engine_weights_mb_{arm}": mb for arm, mb in ENGINE_MB.items()}
    result |= {"model_mb": nbytes / 1e6, "rounds": args.rounds, "load_average": os.getloadavg()[0]}
    print("RESULT " + json.dumps({k: round(v, 3) for k, v in result.items()}))

if __name__ == "__main__":
    main()
