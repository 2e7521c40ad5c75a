"""Reward isolation (`reward.isolation`): a hung reward never keeps the process alive; in worker processes
it is killed, as is a worker that crashes, and the rewards are the same as in threads."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tandem.config import ConfigError, from_dict
from tandem.core.sample import Sample, SampleStatus
from tandem.rewards import RewardConfig, RewardHub, RewardTermConfig

MISBEHAVING = "tests.runtime.rewards:misbehaving"
REPO = Path(__file__).resolve().parents[2]


def _s(response: str, label=None) -> Sample:
    return Sample(tokens=[1, 2, 3, 4], response_length=2, response=response, label=label)


def _hub(isolation: str, *, timeout_s: float = 30.0, num_workers: int = 1) -> RewardHub:
    return RewardHub(RewardConfig(terms=[RewardTermConfig(name=MISBEHAVING)], timeout_s=timeout_s,
                                  num_workers=num_workers, isolation=isolation))


def _alive(pid: int) -> bool:
    """True for a running process, and for a zombie nobody reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_isolation_is_thread_or_process():
    choices = r"isolation='fork' is not a valid choice \(choose one of: thread, process\)"
    with pytest.raises(ValueError, match=choices):
        RewardConfig(isolation="fork")
    with pytest.raises(ConfigError, match="isolation: 'fork' is not a valid choice"):
        from_dict(RewardConfig, {"isolation": "fork"})
    assert RewardConfig().isolation == "thread"


def test_process_isolation_kills_a_hung_reward():
    hub = _hub("process", timeout_s=0.5, num_workers=2)
    try:
        hub.score([_s("ok"), _s("ok")])  # each call waits for a worker to be ready: both are now
        before = hub.worker_pids
        samples = [_s("hang"), _s("ok"), _s("ok"), _s("ok")]
        t0 = time.perf_counter()
        m = hub.score(samples)
        assert time.perf_counter() - t0 < 0.5 + 1.5
        assert samples[0].status == SampleStatus.FAILED and samples[0].reward is None
        assert samples[0].metadata["reward_error"] == f"reward {MISBEHAVING!r} timed out after 0.5s"
        assert [s.reward for s in samples[1:]] == [1.0, 1.0, 1.0]
        assert m["reward/timeout"] == 1 and m["reward/failed"] == 1 and m["reward/mean"] == 1.0
        killed = [pid for pid in before if not _alive(pid)]
        assert len(killed) == 1  # the hung worker: killed and reaped when score() returns
        pids = hub.worker_pids
        assert len(pids) == 2 and killed[0] not in pids  # replaced
        again = [_s("ok")]
        hub.score(again)
        assert again[0].reward == 1.0
    finally:
        hub.close()
    assert hub.worker_pids == [] and not any(_alive(pid) for pid in pids)


def test_process_isolation_replaces_a_worker_that_dies():
    hub = _hub("process")
    try:
        samples = [_s("ok"), _s("exit"), _s("segv"), _s("ok")]
        m = hub.score(samples)
        assert [s.reward for s in samples] == [1.0, None, None, 1.0]
        died = f"reward {MISBEHAVING!r}: its worker process died"
        assert samples[1].metadata["reward_error"] == f"{died} (exit code 3)"
        assert samples[2].metadata["reward_error"] == f"{died} (killed by SIGSEGV, exit code -11)"
        assert m["reward/failed"] == 2 and m["reward/timeout"] == 0
        assert sum(hub.error_counts.values()) == 2
        again = [_s("ok")]
        hub.score(again)  # on the third worker
        assert again[0].reward == 1.0 and again[0].status == SampleStatus.PENDING
        pids = hub.worker_pids
    finally:
        hub.close()
    assert len(pids) == 1 and not _alive(pids[0])


def _varied_samples() -> list[Sample]:
    """Math answers, a NaN and a raising case for `reads_fields`, with metadata and routed experts."""
    out = []
    cases = [("so $\\boxed{\\frac{1}{2}}$", "0.5"), ("it is 4", "4"), ("5", "4"), ("nan", "1"), ("boom", "1"),
             ("$\\boxed{12}$", "12")]
    for i, (response, label) in enumerate(cases):
        s = Sample(tokens=[3, 4, 5, 6 + i], response_length=2, response=response, label=label,
                   metadata={"bonus": i}, rollout_routed_experts=np.full((3, 2, 2), i, dtype=np.int32))
        out.append(s)
    return out


def test_process_isolation_gives_the_same_rewards_as_threads():
    terms = [
        RewardTermConfig(name="math"),
        RewardTermConfig(name="tests.runtime.rewards:reads_fields", weight=0.5),
        RewardTermConfig(name="tests.runtime.rewards:async_even_tokens", weight=2.0),
        RewardTermConfig(name="tests.runtime.rewards:batched_position", batched=True),
    ]
    results = {}
    for isolation in ("thread", "process"):
        hub = RewardHub(RewardConfig(terms=terms, num_workers=2, isolation=isolation))
        samples = _varied_samples()
        metrics = hub.score(samples)
        hub.close()
        metrics.pop("time/reward_s")
        rows = [(s.reward, s.status, s.metadata.get("reward_error")) for s in samples]
        results[isolation] = (rows, metrics, dict(hub.error_counts))
    assert results["process"] == results["thread"]
    rows, metrics, errors = results["process"]
    assert rows[0][0] == {"score": 1.0 + 0.5 * 24 + 2.0 * 0.5 + 0.0, "math": 1.0, "reads_fields": 24.0,
                          "async_even_tokens": 0.5, "batched_position": 0.0}
    assert rows[3][2] == "reward 'tests.runtime.rewards:reads_fields' raised ValueError: reward is nan"
    assert rows[4][2] == "reward 'tests.runtime.rewards:reads_fields' raised RuntimeError: boom"
    assert metrics["reward/failed"] == 2 and sum(errors.values()) == 2
    assert [r[0]["batched_position"] for r in rows if r[0]] == [0.0, 0.25, 0.5, 0.75]  # the 4 left, batched


def test_thread_isolation_warns_that_a_timed_out_thread_keeps_running(caplog):
    hub = _hub("thread", timeout_s=0.2)
    samples = [_s("slow"), _s("ok")]
    with caplog.at_level(logging.WARNING, logger="tandem.rewards.hub"):
        m = hub.score(samples)  # "slow" sleeps 2 s in a thread left behind; a new one scores "ok"
    hub.close()
    assert m["reward/timeout"] == 1 and samples[1].reward == 1.0
    assert "its thread keeps running in the background" in caplog.text
    assert "set reward.isolation: process to make hung rewards killable" in caplog.text
    assert all(t.daemon for t in threading.enumerate() if t.name == "tandem-reward")


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    from tandem.core.sample import Sample
    from tandem.rewards import RewardConfig, RewardHub, RewardTermConfig

    cfg = RewardConfig(terms=[RewardTermConfig(name="tests.runtime.rewards:misbehaving")], timeout_s=0.5,
                       num_workers=1, isolation=sys.argv[1])
    for close in (True, False):  # a hub closed, then one left open
        hub = RewardHub(cfg)
        samples = [Sample(response="ok"), Sample(response="hang")]
        metrics = hub.score(samples)
        assert metrics["reward/timeout"] == 1 and samples[0].reward == 1.0, metrics
        if close:
            hub.close()
    print("scored", flush=True)
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_hung_reward_does_not_keep_the_process_alive(isolation):
    """The regression of issue 23: a ThreadPoolExecutor joined the hung thread at exit, forever."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, isolation], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "scored", done.stderr[-2000:]
    assert time.perf_counter() - t0 < 30
