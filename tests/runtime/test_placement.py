"""Separate placement: the inference engine in its own process (`RemoteEngine`), weights by broadcast.

The loop runs each mode with the engine in another process, and the engine process ends holding the
trainer's final weights bit for bit; the placement does not change the numbers; resume repeats the
uninterrupted run; a killed engine process fails the run with a clear error within seconds, in every
mode. `RemoteEngine` itself passes the shared inference-engine contract (slow) and the checks below.
Whole runs are `slow` except one per concern (marked `ci`, or unmarked when short).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.config import ConfigError, load_config
from tandem.core.protocols import FinishReason, InferenceEngine
from tandem.engines.inference.torch.config import TorchEngineConfig
from tandem.engines.registry import EngineSpec
from tandem.models import ModelConfig, resolve_model
from tandem.runtime.config import RunConfig
from tandem.runtime.engine_wire import decode, encode
from tandem.runtime.loop import Run
from tandem.runtime.remote_engine import EngineProcessError, RemoteEngine
from tandem.runtime.tracking import read_metrics
from tandem.sync import build_sender
from tandem.sync.base import SyncConfig, tensor_hashes
from tests.engines.contract import EngineCase, InferenceEngineContract
from tests.engines.torch_helpers import prompts, requests, wait_until
from tests.runtime.rewards import even_tokens

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-separate.yaml"
EVEN = ["reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"]
TORCH_ENGINE = "tandem.engines.inference.torch:TorchEngine"
# wall-clock figures, which no two runs share
TIME_KEYS = ("time", "rollout/tokens_per_s", "train/tokens_per_s", "train/step_time_s", "sync/seconds", "sync/gbps", "sys/")


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [*EVEN, *overrides])


def _trainer_hashes(run: Run) -> dict[str, int]:
    return tensor_hashes(nt for bucket in run.trainer.named_parameters_for_sync(1 << 30) for nt in bucket)


def _numbers(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in read_metrics(run_dir)]


class _ProbedRun(Run):
    """Records the engine process's weights and health just before `train` closes it."""

    final: dict | None = None

    def _close_engine(self) -> None:
        if self.engine.alive:
            self.final = {"digest": self.engine.weight_digest(), "health": self.engine.health()}
        super()._close_engine()


def _engine_spec(**kw) -> EngineSpec:
    config = TorchEngineConfig(model=ModelConfig(name=kw.pop("model", "tiny-llama")), max_num_seqs=8,
                               max_model_len=256, **kw)
    return EngineSpec(factory=TORCH_ENGINE, config=config)


@pytest.fixture
def one_thread():
    """Torch at one intra-op thread in this process (the machine has two, an engine process's default):
    the engine process must compute with the trainer's count, as a colocated engine does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the loop ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.ci), "one_step_off", "fully_async"])
@pytest.mark.slow
def test_modes_train_and_the_engine_process_ends_on_the_trainer_weights(tmp_path, mode, one_thread):
    extra = [] if mode == "sync" else ["algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]
    run = _ProbedRun(_cfg(f"runtime.mode={mode}", *extra), tmp_path / "separate")
    before = _trainer_hashes(run)
    run.train(close=False)
    after = _trainer_hashes(run)
    run.close()
    assert any(before[k] != after[k] for k in before), "no weight changed"
    rows = read_metrics(tmp_path / "separate")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for i, r in enumerate(rows):
        for key in ("reward/mean", "train/grad_norm", "train_rollout_logprob_abs_diff/mean", "time/train_s"):
            assert key in r, (mode, key)
        if mode != "one_step_off" or i > 0:  # one-step-off syncs step N-1's weights before rollout N+1
            assert r["sync/bytes"] > 0 and r["sync/buckets"] >= 1  # the broadcast transport's metrics
    # the engine process held the trainer's final weights bit for bit, and never imported the trainer
    digest, health = run.final["digest"], run.final["health"]
    assert {k: digest[k] for k in after} == after
    assert health["weight_version"] == run.version == 3
    assert health["sync"]["updates"] == 3 and health["sync"]["errors"] == 0
    assert health["process"]["pid"] == run.engine.pid and not health["process"]["trainer_imported"]
    assert health["process"]["torch_threads"] == 1  # the trainer's, not the engine process's default
    assert not run.engine.alive and run.engine.returncode == 0  # closed cleanly
    if mode == "fully_async":
        assert all(r["async/staleness_max"] <= 1 for r in rows if "async/staleness_max" in r)
    if mode == "sync":  # the placement does not change the numbers
        colocated = tmp_path / "colocated"
        Run(_cfg("runtime.placement=colocated", "sync.transport=inprocess"), colocated).train()
        # transport-specific: the broadcast sender counts buckets, in-process sync does not
        drop = ("sync/buckets",)
        strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]  # noqa: E731
        assert strip(_numbers(tmp_path / "separate")) == strip(_numbers(colocated))


@pytest.mark.slow
def test_resume_with_a_separate_engine_repeats_the_uninterrupted_run(tmp_path):
    Run(_cfg("run.steps=4", "run.save_every=2"), tmp_path / "full").train()
    part = tmp_path / "part"
    Run(_cfg("run.steps=2", "run.save_every=2"), part).train()
    resumed = Run(_cfg("run.steps=4", "run.save_every=2"), part, resume=True)
    # the fresh engine process loaded the model files; the checkpoint's weights were pushed to it
    assert resumed.version == 2 and resumed.engine.weight_version == 2
    assert {k: v for k, v in resumed.engine.weight_digest().items() if k in (h := _trainer_hashes(resumed))} == h
    resumed.train()
    assert _numbers(part) == _numbers(tmp_path / "full")


@pytest.mark.slow
def test_disk_transport_reaches_the_engine_before_the_next_rollout(tmp_path):
    run = _ProbedRun(_cfg("sync.transport=disk", f"sync.directory={tmp_path / 'weights'}", "sync.poll_interval_s=0.2",
                          "run.steps=2", "rollout.dump=true"), tmp_path / "run")
    run.train(close=False)
    after = _trainer_hashes(run)
    run.close()
    assert [r["sync/version"] for r in read_metrics(tmp_path / "run")] == [1.0, 2.0]
    # disk applies in the engine's own time: the loop waited, so step 1 generated with version 1
    dumped = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert dumped and all(row["weight_versions"] == [1] for row in dumped)
    assert {k: run.final["digest"][k] for k in after} == after


_KILL = {"pid": None, "at_call": 9, "calls": 0, "killed_at": None, "lock": threading.Lock()}


def kill_engine_on_the_second_step(sample) -> float:
    """A reward plugin that SIGKILLs the engine process when the second step's first sample is scored
    (2 prompts x 4 samples per step)."""
    with _KILL["lock"]:
        _KILL["calls"] += 1
        if _KILL["calls"] == _KILL["at_call"] and _KILL["pid"]:
            os.kill(_KILL["pid"], signal.SIGKILL)
            _KILL["killed_at"] = time.monotonic()
    return even_tokens(sample)


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow),
                                  pytest.param("one_step_off", marks=pytest.mark.slow), "fully_async"])
def test_a_killed_engine_process_fails_the_run_with_a_clear_error(tmp_path, mode):
    # Whatever the trainer is doing when the engine dies (waiting for rollouts, training, syncing: the
    # async modes race), the run fails within seconds, not after sync.timeout_s.
    extra = [] if mode == "sync" else ["algorithm.off_policy.mode=tis"]
    reward = f"reward.terms=[{{name: '{__name__}:kill_engine_on_the_second_step'}}]"
    cfg = load_config(RunConfig, RECIPE, [reward, f"runtime.mode={mode}", "sync.timeout_s=60", *extra])
    run = Run(cfg, tmp_path)
    _KILL.update(pid=run.engine.pid, calls=0, killed_at=None)
    with pytest.raises(RuntimeError) as raised:
        run.train()
    assert _KILL["killed_at"] is not None, "the engine was not killed: the run ended first"
    assert time.monotonic() - _KILL["killed_at"] < 15  # seconds from the kill to the failed run
    assert re.search(r"inference engine process \(pid \d+\) was killed by signal SIGKILL", str(raised.value))
    assert run.engine.returncode == -signal.SIGKILL
    assert len(read_metrics(tmp_path)) <= 1  # nothing was logged after the engine died


def test_a_sync_to_an_engine_process_that_dies_fails_at_once():
    # The first broadcast forms the group: the sender waits for the engine's receiver to join, up to
    # sync.timeout_s. The engine dies after the liveness check, as the send starts.
    sync = SyncConfig(transport="broadcast", timeout_s=30)
    sender = build_sender(sync)
    engine = RemoteEngine(_engine_spec(), sync=dataclasses.replace(sync, port=sender.port))
    try:
        engine.wait_ready()

        def kill_then_send():
            os.kill(engine.pid, signal.SIGKILL)
            return sender.send([[("w", torch.zeros(4))]], version=1)

        start = time.monotonic()
        with pytest.raises(EngineProcessError, match=r"pid \d+\) was killed by signal SIGKILL"):
            engine.run_while_alive(kill_then_send, what="weight sync")
        assert time.monotonic() - start < 10
        # the send itself still waits for its peer: only the watch on the process ended the wait
        assert any(t.name == "tandem-weight-sync" and t.is_alive() for t in threading.enumerate())
    finally:
        engine.close()


def test_placement_and_transport_must_agree(tmp_path):
    with pytest.raises(ConfigError, match=r"sync.transport='inprocess' does not fit runtime.placement='separate'.*"
                                          r"use sync.transport: broadcast or disk"):
        Run(_cfg("sync.transport=inprocess"), tmp_path / "a")
    with pytest.raises(ConfigError, match=r"sync.transport='broadcast' does not fit runtime.placement='colocated'"
                                          r".*use sync.transport: inprocess, or runtime.placement: separate"):
        Run(_cfg("runtime.placement=colocated"), tmp_path / "b")
    with pytest.raises(ConfigError, match="sync.num_receivers=2: runtime.placement='separate' runs one engine"):
        Run(_cfg("sync.num_receivers=2"), tmp_path / "c")


# -- RemoteEngine --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def case():
    with RemoteEngine(_engine_spec()) as engine:
        # the embedded engine's bound (tests/engines/test_torch_engine_contract.py, measured there): the same
        # engine behind the process boundary; 2e-5 predated the packed-only weights and native kernels, and a
        # sampled token now lands at 3.8e-5 (this class is `slow`: `make test` does not run it)
        yield EngineCase(engine=engine, model_path=resolve_model("tiny-llama"), max_model_len=256, vocab_size=512,
                         logprob_atol=5e-5)


@pytest.mark.slow
class TestRemoteEngineContract(InferenceEngineContract):
    """Every protocol behaviour of the embedded engine holds across the process boundary."""


def test_remote_engine_forwards_the_protocol(case):
    engine = case.engine
    process = engine.health()["process"]
    assert isinstance(engine, InferenceEngine) and process["pid"] == engine.pid != os.getpid()
    assert process["torch_threads"] == torch.get_num_threads()  # the trainer's (see also one_thread)
    assert engine.info.vocab_size == 512 and engine.info.name == "torch"  # the engine's own EngineInfo
    ps = prompts([5, 12, 20, 8], seed=9)

    async def together():
        return await asyncio.gather(*(engine.agenerate(r) for r in requests(ps, temperature=0, max_new_tokens=16)))

    concurrent = asyncio.run(together())
    blocking = engine.generate(requests(ps, temperature=0, max_new_tokens=16))
    assert [r.completions[0].token_ids for r in concurrent] == [r.completions[0].token_ids for r in blocking]
    # score: the teacher-forced log-probs of what was generated
    scored = engine.score([(p + r.completions[0].token_ids, len(p)) for p, r in zip(ps, blocking, strict=True)])
    for lp, r in zip(scored, blocking, strict=True):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(r.completions[0].log_probs), rtol=0, atol=1e-4)


def test_remote_update_weights_is_exact_and_a_bad_one_is_refused(case):
    engine = case.engine
    weights = case.checkpoint()
    noisy = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in weights.items()}
    v = engine.weight_version
    engine.update_weights(noisy.items(), version=v + 1)
    assert engine.weight_version == v + 1
    assert {k: engine.weight_digest()[k] for k in noisy} == tensor_hashes(noisy.items())
    name = next(k for k in weights if k.endswith("mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: shape \(3, 3\) != engine shape"):
        engine.update_weights([(name, torch.zeros(3, 3))], version=v + 2)
    engine.update_weights(weights.items(), version=v + 2)
    assert engine.weight_version == v + 2
    assert {k: engine.weight_digest()[k] for k in weights} == tensor_hashes(weights.items())


def test_only_allowlisted_types_cross_the_connection():
    call_id, _status, payload = decode(encode(7, 0, ("generate", ([{"a": [1.5, "x"]}],), {})))
    assert call_id == 7 and payload == ("generate", ([{"a": [1.5, "x"]}],), {})
    with pytest.raises(Exception, match=r"torch\._utils\._rebuild_tensor_v2 may not cross the engine connection") as e:
        decode(encode(8, 0, ("generate", (torch.ones(2),), {})))
    assert e.value.call_id == 8  # so the engine can answer that call with the error


def test_a_killed_engine_fails_pending_and_later_calls():
    engine = RemoteEngine(_engine_spec())
    try:
        request = requests(prompts([6]), temperature=1.0, max_new_tokens=240, seed=0)
        out: dict = {}
        driver = threading.Thread(target=lambda: out.update(error=_raises(lambda: engine.generate(request))))
        driver.start()
        wait_until(lambda: engine.health()["generated_tokens"] >= 5)
        os.kill(engine.pid, signal.SIGKILL)
        driver.join(timeout=30)
        assert not driver.is_alive(), "a call pending on a dead engine hung"
        assert isinstance(out["error"], EngineProcessError) and "killed by signal SIGKILL" in str(out["error"])
        with pytest.raises(EngineProcessError, match=rf"pid {engine.pid}\) was killed by signal SIGKILL"):
            engine.generate(request)
        assert engine.health()["status"] == "dead"
        engine.abort_all()  # nothing left to abort: no error
    finally:
        engine.close()


def test_remote_engine_aborts_from_another_thread_and_closes_cleanly():
    with RemoteEngine(_engine_spec()) as engine:
        reqs = requests(prompts([5, 6]), temperature=1.0, max_new_tokens=240, seed=0)
        out: dict = {}
        driver = threading.Thread(target=lambda: out.update(results=engine.generate(reqs)))
        driver.start()
        wait_until(lambda: engine.health()["generated_tokens"] >= 5)
        engine.abort_all()
        driver.join(timeout=30)
        assert [r.completions[0].finish_reason for r in out["results"]] == [FinishReason.ABORT] * 2
    assert engine.returncode == 0 and engine.health()["status"] == "closed"
    with pytest.raises(EngineProcessError, match="closed"):
        engine.generate(reqs)


def test_an_engine_that_cannot_start_reports_why():
    engine = RemoteEngine(_engine_spec(model="no-such-model"))
    try:
        with pytest.raises(EngineProcessError, match=r"failed to start: .*no-such-model"):
            engine.wait_ready()
    finally:
        engine.close()
    assert engine.returncode == 1


_TRAINER_SCRIPT = """
import time
from tests.runtime.test_placement import _engine_spec
from tandem.runtime.remote_engine import RemoteEngine
engine = RemoteEngine(_engine_spec())
engine.wait_ready()
print(engine.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_the_engine_process_does_not_outlive_a_killed_trainer():
    root = Path(__file__).parents[2]
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER_SCRIPT], cwd=root, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(root)})
    try:
        engine_pid = int(trainer.stdout.readline())
    finally:
        trainer.kill()  # no chance to close its engine
        trainer.wait()
    wait_until(lambda: not _running(engine_pid), timeout=20)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return e
    return None
