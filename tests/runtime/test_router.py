"""The router over real embedded engines (tiny-llama, in-process replicas): spreading, one engine step per
submit, affinity, failures, re-queues, quarantine and probes, version gating, aborts, and the shared
inference-engine contract. Engines run in deterministic (batch-invariant) mode, so a request gives the
same tokens and log-probs whichever replica and batch serve it: results can be compared with one engine.

Faults come from `FlakyReplica`, a real `ReplicaClient` (a `LocalReplica`) that breaks on command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading

import pytest
import torch

from tandem.core.protocols import EngineError, FinishReason, GenerationRequest, SamplingParams
from tandem.models import resolve_model
from tandem.runtime.router import LocalReplica, ReplicaClient, Router, RouterConfig
from tests.engines.contract import EngineCase, InferenceEngineContract
from tests.engines.torch_helpers import make_engine, prompts, requests, wait_until


class ReplicaDied(RuntimeError):
    pass


class FlakyReplica:
    """A `LocalReplica` that records what it is sent and breaks on command: ``fail_next`` requests fail,
    ``die()`` fails what it holds and makes every call raise until ``revive()`` (optionally with a fresh
    engine: a restart with the initial weights)."""

    def __init__(self, engine, name: str) -> None:
        self.inner, self.name = LocalReplica(engine, name=name), name
        self.batches: list[list[str]] = []  # request ids per submit call
        self.served: set[str] = set()  # request ids it returned a result for
        self.aborts: list[list[str]] = []
        self.fail_next, self.dead, self.sick = 0, False, False  # sick: only health() fails
        self.instance = 0  # rises with every fresh engine, as a restarted actor's instance id changes
        self._held: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def submit(self, reqs):
        self._alive()
        self.batches.append([r.request_id for r in reqs])
        with self._lock:
            failing, self.fail_next = min(self.fail_next, len(reqs)), max(0, self.fail_next - len(reqs))
        out = [_failed(ReplicaDied(f"{self.name}: injected failure")) for _ in range(failing)]
        started = zip(reqs[failing:], self.inner.submit(reqs[failing:]), strict=True)
        return out + [self._chain(r.request_id, f) for r, f in started]

    def _chain(self, request_id, inner):
        outer = concurrent.futures.Future()
        with self._lock:
            self._held[request_id] = outer

        def copy(f):
            with self._lock:
                self._held.pop(request_id, None)
                if f.exception() is None and not outer.done():
                    self.served.add(request_id)
            _settle(outer, f)

        inner.add_done_callback(copy)
        return outer

    def die(self) -> None:
        """Fail every request held now (as a dead actor's calls raise); refuse calls until revived."""
        self.dead = True
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for f in held:
            _settle(outer=f, error=ReplicaDied(f"{self.name} died"))
        self.inner.abort_all()

    def revive(self, engine=None) -> None:
        if engine is not None:
            self.inner.close()
            self.inner = LocalReplica(engine, name=self.name)
            self.instance += 1
        self.dead = False

    def _alive(self) -> None:
        if self.dead:
            raise ReplicaDied(f"{self.name} is unreachable")

    def abort(self, request_ids):
        self.aborts.append(list(request_ids))
        self.inner.abort(request_ids)

    def abort_all(self):
        self.inner.abort_all()

    def health(self):
        self._alive()
        if self.sick:
            raise ReplicaDied(f"{self.name} does not answer")
        return self.inner.health() | {"instance": self.instance}

    def weight_version(self):
        self._alive()
        return self.inner.weight_version()

    def update_weights(self, named_tensors, version):
        self._alive()
        self.inner.update_weights(named_tensors, version)

    def sleep(self):
        self.inner.sleep()

    def wake_up(self):
        self.inner.wake_up()

    def close(self):
        self.inner.close()


def _failed(error):
    f = concurrent.futures.Future()
    f.set_exception(error)
    return f


def _settle(outer, source=None, error=None):
    try:
        if error is None:
            error = source.exception()
        outer.set_exception(error) if error is not None else outer.set_result(source.result())
    except concurrent.futures.InvalidStateError:  # die() got there first
        pass


def engine():
    return make_engine("tiny-llama", deterministic=True)


@pytest.fixture
def build():
    """``build(n=2, **config) -> (router, replicas)``; every router is closed after the test."""
    made = []

    def _build(n=2, resync=None, replicas=None, **config):
        replicas = replicas or [FlakyReplica(engine(), f"r{i}") for i in range(n)]
        router = Router(replicas, info=replicas[0].inner.engine.info, config=RouterConfig(**config), resync=resync)
        made.append(router)
        return router, replicas

    yield _build
    for router in made:
        router.close()


@pytest.fixture(scope="module")
def reference():
    with engine() as one:
        yield one


@pytest.fixture(scope="module")
def new_weights():
    """tiny-llama's weights perturbed: what a trainer would send as version 1."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    weights = {}
    for f in sorted(resolve_model("tiny-llama").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return [(k, v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype)) for k, v in weights.items()]


def mixed_requests(seed=0):
    """Greedy and seeded-sampling requests (n=2) of uneven prompt and response lengths."""
    ps = prompts([5, 17, 9, 30, 3, 12, 22, 7], seed=seed)
    out = []
    for i, p in enumerate(ps):
        sampling = (SamplingParams(temperature=0, max_new_tokens=6 + 3 * i) if i % 2 else
                    SamplingParams(temperature=1.0, n=2, seed=100 + i, max_new_tokens=30 - 2 * i))
        out.append(GenerationRequest(prompt_token_ids=p, sampling=sampling))
    return out


def copies(reqs):
    return [GenerationRequest(prompt_token_ids=list(r.prompt_token_ids), sampling=r.sampling) for r in reqs]


def outputs(results):
    return [[(c.token_ids, c.log_probs, c.finish_reason) for c in r.completions] for r in results]


def rows(router):
    return {row["name"]: row for row in router.health()["replicas"]}


def holder(replicas, request_id):
    """The replica that returned the request's result."""
    [replica] = [r for r in replicas if request_id in r.served]
    return replica


# -- spreading, equality with one engine, one step per submit ------------------------------------------------


def test_concurrent_requests_spread_evenly_and_each_replica_gets_one_submit(build):
    router, (a, b) = build()
    results = router.generate(requests(prompts([5, 9, 3, 12, 7, 4, 8, 6]), temperature=0, max_new_tokens=8))
    assert all(len(r.completions[0].token_ids) == 8 for r in results)
    assert [len(x) for x in a.batches] == [4] and [len(x) for x in b.batches] == [4]
    assert {name: row["served"] for name, row in rows(router).items()} == {"r0": 4, "r1": 4}


def test_least_load_sends_new_requests_to_the_replica_that_finished_its_short_ones(build):
    router, replicas = build()
    long_, short, *rest = requests(prompts([6] * 5), temperature=0, max_new_tokens=2)
    long_.sampling = SamplingParams(temperature=0, max_new_tokens=200)

    async def scenario():
        task = asyncio.ensure_future(router.agenerate(long_))
        await asyncio.sleep(0)  # the long request takes a replica
        await router.agenerate(short)  # the other one, and finishes
        await asyncio.gather(*(router.agenerate(r) for r in rest))
        router.abort(long_.request_id)
        return await task

    assert asyncio.run(scenario()).completions[0].finish_reason == FinishReason.ABORT
    busy, idle = holder(replicas, long_.request_id), holder(replicas, short.request_id)
    assert busy is not idle
    # least load: the first of the three goes to the idle replica, then the counts stay within one
    assert [holder(replicas, r.request_id) for r in rest] == [idle, busy, idle]


def test_the_router_serves_several_threads_and_event_loops_at_once(build, reference):
    router, _ = build()
    reqs = mixed_requests(seed=9)
    out = {}

    def producer():  # a long-lived loop in its own thread (fully-async mode)
        async def main():
            return [r for i in (0, 2) for r in await asyncio.gather(*(router.agenerate(x) for x in reqs[i:i + 2]))]

        out["producer"] = asyncio.run(main())

    async def step():  # generate() called from inside a running loop
        return router.generate(reqs[4:])

    thread = threading.Thread(target=producer)
    thread.start()
    out["step"] = asyncio.run(step())
    thread.join(timeout=60)
    assert outputs(out["producer"] + out["step"]) == outputs(reference.generate(copies(reqs)))


def test_results_equal_one_engine_in_order(build, reference):
    router, _ = build()
    reqs = mixed_requests()
    results = router.generate(reqs)
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    assert outputs(results) == outputs(reference.generate(copies(reqs)))


def test_requests_sent_together_run_in_one_engine_step(build, reference):
    router, (a, b) = build()
    reqs = requests(prompts([6] * 8, seed=3), temperature=1.0, seed=1, max_new_tokens=10)
    before = reference.health()["steps"]
    reference.generate(copies(reqs[:4]))
    one_batch = reference.health()["steps"] - before
    router.generate(reqs)
    assert [len(x) for x in a.batches + b.batches] == [4, 4]
    assert a.inner.health()["steps"] == b.inner.health()["steps"] == one_batch == 10


# -- affinity ----------------------------------------------------------------------------------------------


def test_a_session_stays_on_one_replica_and_moves_when_it_is_quarantined(build):
    router, (a, b) = build(failures_to_quarantine=1, probe_interval_s=60)
    sessions = [f"s{i}" for i in range(4)]

    def turn():
        reqs = requests(prompts([5] * 4, seed=len(a.batches) + len(b.batches)), temperature=0, max_new_tokens=3)
        for r, s in zip(reqs, sessions, strict=True):
            r.session_id = s
        results = router.generate(reqs)
        assert all(r.completions[0].finish_reason == FinishReason.LENGTH for r in results)
        return {s: holder([a, b], r.request_id) for s, r in zip(sessions, reqs, strict=True)}

    first = turn()
    assert turn() == turn() == first and sorted(x.name for x in first.values()) == ["r0", "r0", "r1", "r1"]
    a.fail_next = 1  # a's first session fails there: a is quarantined, that session moves to b
    turn()
    assert rows(router)["r0"]["quarantined"] and router.health()["requeued"] == 1
    assert set(turn().values()) == {b} and set(turn().values()) == {b}


# -- failures, quarantine, probes, re-queues ------------------------------------------------------------------


def test_quarantine_after_k_failures_and_return_after_a_probe(build, caplog):
    router, (a, b) = build(failures_to_quarantine=2, probe_interval_s=0.05)
    a.fail_next, a.sick = 2, True  # its two requests fail, and so do its probes until it recovers
    reqs = requests(prompts([5] * 4), temperature=0, max_new_tokens=4)
    assert all(len(r.completions[0].token_ids) == 4 for r in router.generate(reqs))
    row = rows(router)["r0"]
    assert row["quarantined"] and row["failures"] == 2 and row["requeued"] == 2
    assert router.health()["requeued"] == 2
    # the error that quarantined it, logged then (on a slow machine a failed probe may already be the last error)
    assert any(r.getMessage().startswith("replica r0 quarantined: ") and "injected failure" in r.getMessage()
               for r in caplog.records)
    assert "injected failure" in row["last_error"] or row["last_error"].startswith("probe: ")
    router.generate(requests(prompts([5] * 4, seed=1), temperature=0, max_new_tokens=4))
    assert len(a.batches) == 1 and rows(router)["r1"]["served"] == 8  # nothing to a while quarantined
    wait_until(lambda: "probe" in rows(router)["r0"]["last_error"], timeout=10)
    a.sick = False
    wait_until(lambda: not rows(router)["r0"]["quarantined"], timeout=10)
    router.generate(requests(prompts([5] * 4, seed=2), temperature=0, max_new_tokens=4))
    assert [len(x) for x in a.batches] == [2, 2] and rows(router)["r0"]["restarts_seen"] == 0


def test_a_replica_dying_mid_generation_loses_nothing(build, reference):
    router, (a, b) = build(probe_interval_s=60)
    reqs = requests(prompts([7, 11, 5, 9, 13, 6, 8, 10], seed=5), temperature=1.0, seed=7, max_new_tokens=60)

    async def scenario():
        task = asyncio.gather(*(router.agenerate(r) for r in reqs))
        while a.inner.health()["generated_tokens"] < 20:
            await asyncio.sleep(0.001)
        a.die()
        return await task

    results = asyncio.run(scenario())
    assert all(c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 60 for r in results for c in r.completions)
    assert outputs(results) == outputs(reference.generate(copies(reqs)))  # restarted from scratch, same seeds
    health = router.health()
    assert health["requeued"] == 4 and health["in_rotation"] == 1 and health["status"] == "ok"
    assert rows(router)["r0"]["quarantined"] and rows(router)["r1"]["served"] == 8
    metrics = router.metrics()
    assert metrics["router/requeued"] == 4 and metrics["router/quarantined"] == 1
    assert metrics["router/r1/tokens_per_s"] > 0 and metrics["router/r0/failures"] == 4


def test_exhausted_requeues_give_an_error_result_naming_the_replicas(build):
    router, (a, b) = build(max_requeues=1, failures_to_quarantine=100)
    a.fail_next = b.fail_next = 100
    [result] = router.generate(requests(prompts([5]), temperature=0, max_new_tokens=4))
    assert result.completions[0].finish_reason == FinishReason.ERROR
    assert re.search(r"failed on replicas r\d, r\d \(max_requeues=1\)", result.error)
    assert {"r0", "r1"} <= set(re.findall(r"r\d", result.error)) and "injected failure" in result.error


# -- weight versions ---------------------------------------------------------------------------------------------


def test_min_version_gates_a_stale_replica_until_resync_brings_it_up(build, new_weights):
    calls = []

    def resync(client: ReplicaClient, version: int) -> None:
        calls.append((client.name, version))
        client.update_weights(new_weights, version)

    a, b = FlakyReplica(engine(), "r0"), FlakyReplica(engine(), "r1")
    b.update_weights(new_weights, 1)  # b has the trainer's version 1, a still the initial weights
    router, _ = build(resync=resync, replicas=[a, b])
    assert router.weight_version == 0
    router.min_version = 1
    results = router.generate(requests(prompts([6] * 8, seed=4), temperature=0, max_new_tokens=8))
    assert all(c.weight_versions == [1] for r in results for c in r.completions)
    wait_until(lambda: router.weight_version == 1, timeout=10)
    assert calls == [("r0", 1)]
    router.generate(requests(prompts([6] * 4, seed=5), temperature=0, max_new_tokens=8))
    assert a.batches and rows(router)["r0"]["weight_version"] == 1


def test_without_resync_a_stale_replica_is_skipped_and_none_eligible_is_a_clear_error(build, new_weights):
    a, b = FlakyReplica(engine(), "r0"), FlakyReplica(engine(), "r1")
    b.update_weights(new_weights, 3)
    router, _ = build(replicas=[a, b], wait_timeout_s=0.2)
    router.min_version = 3
    router.generate(requests(prompts([6] * 6), temperature=0, max_new_tokens=4))
    assert not a.batches and len(b.batches) == 1
    router.min_version = 4
    with pytest.raises(EngineError, match=r"within wait_timeout_s=0.2: r0 at weight version 0 < min_version 4 "
                                          r"\(no resync callback\); r1 at weight version 3"):
        router.generate(requests(prompts([6]), temperature=0, max_new_tokens=4))


def test_an_update_failing_on_one_replica_quarantines_it_and_outside_syncs_are_noted(build, new_weights):
    router, (a, b) = build(probe_interval_s=60)
    a.dead = True
    router.update_weights(iter(new_weights), version=1)
    assert rows(router)["r0"]["quarantined"] and router.weight_version == 1
    results = router.generate(requests(prompts([6] * 4, seed=3), temperature=0, max_new_tokens=5))
    assert all(c.weight_versions == [1] for r in results for c in r.completions)
    with pytest.raises(ValueError, match="rejected, weights untouched"):  # every replica refuses: raised
        router.update_weights([("no.such.weight", torch.zeros(2))], version=2)
    assert router.health()["in_rotation"] == 1 and router.weight_version == 1
    b.inner.update_weights(new_weights, 2)  # a sync outside the router (the object store)
    router.note_weight_version("r1", 2)
    router.min_version = 2
    results = router.generate(requests(prompts([6] * 2, seed=3), temperature=0, max_new_tokens=5))
    assert all(c.weight_versions == [2] for r in results for c in r.completions)


def test_a_restarted_replica_is_counted_and_resynced_before_it_serves(build, new_weights):
    calls = []

    def resync(client, version):
        calls.append((client.name, version))
        client.update_weights(new_weights, version)

    router, (a, b) = build(resync=resync, failures_to_quarantine=1, probe_interval_s=0.05)
    router.update_weights(iter(new_weights), version=1)
    router.min_version = 1
    # restarted while idle: the router finds out from the weight version of a result, re-queues it
    a.revive(engine())
    results = router.generate(requests(prompts([6] * 4, seed=6), temperature=0, max_new_tokens=5))
    assert all(c.weight_versions == [1] for r in results for c in r.completions)
    wait_until(lambda: not rows(router)["r0"]["quarantined"], timeout=10)
    assert calls == [("r0", 1)] and router.weight_version == 1
    assert rows(router)["r0"]["restarts_seen"] == 1 and router.health()["requeued"] >= 1
    # died and came back: quarantined, then probed; the version went back down: re-synced first
    a.die()
    router.generate(requests(prompts([6] * 4, seed=7), temperature=0, max_new_tokens=5))
    assert rows(router)["r0"]["quarantined"]
    a.revive(engine())
    wait_until(lambda: not rows(router)["r0"]["quarantined"], timeout=10)
    assert calls == [("r0", 1), ("r0", 1)] and rows(router)["r0"]["restarts_seen"] == 2
    results = router.generate(requests(prompts([6] * 4, seed=8), temperature=0, max_new_tokens=5))
    assert all(c.weight_versions == [1] for r in results for c in r.completions)
    assert len(a.batches[-1]) == 2


# -- aborts ---------------------------------------------------------------------------------------------------------


def test_abort_and_cancellation_reach_the_replica_holding_the_request(build):
    router, replicas = build()
    first, second = requests(prompts([6, 8]), temperature=1.0, seed=2, max_new_tokens=200)

    async def scenario():
        kept = asyncio.ensure_future(router.agenerate(first))
        cancelled = asyncio.ensure_future(router.agenerate(second))
        while min(r.inner.health()["generated_tokens"] for r in replicas) < 5:
            await asyncio.sleep(0.001)
        router.abort(first.request_id)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return await kept

    result = asyncio.run(scenario())
    assert result.completions[0].finish_reason == FinishReason.ABORT and 0 < len(result.completions[0].token_ids) < 200
    for request in (first, second):
        [owner] = [r for r in replicas if [request.request_id] in r.batches]
        assert owner.aborts == [[request.request_id]]
    wait_until(lambda: all(r.inner.health()["running"] == 0 for r in replicas), timeout=10)
    assert router.health()["running"] == 0 and all(row["outstanding"] == 0 for row in rows(router).values())


def test_an_abort_before_the_submit_or_while_waiting_for_a_replica_still_ends_the_request(build):
    router, replicas = build(wait_timeout_s=30)
    queued, waiting = requests(prompts([6, 7]), temperature=0, max_new_tokens=50)

    async def abort_queued():  # chosen, not yet submitted (the flush comes later in this loop turn)
        task = asyncio.ensure_future(router.agenerate(queued))
        await asyncio.sleep(0)
        router.abort(queued.request_id)
        return await task

    result = asyncio.run(abort_queued())
    assert result.completions[0].finish_reason == FinishReason.ABORT and len(result.completions[0].token_ids) < 50
    assert [[queued.request_id]] in [r.aborts for r in replicas]  # sent right after its submit
    router.min_version = 9  # no replica is eligible: the request waits

    async def abort_waiting():
        task = asyncio.ensure_future(router.agenerate(waiting))
        await asyncio.sleep(0.05)
        router.abort(waiting.request_id)
        return await task

    assert asyncio.run(abort_waiting()).completions[0].finish_reason == FinishReason.ABORT


# -- configuration ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("failures_to_quarantine", 0), ("failure_window_s", 0), ("probe_interval_s", -1.0), ("max_requeues", -1),
    ("max_requeues", 1.5), ("wait_timeout_s", 0), ("max_sessions", 0), ("affinity", "yes"),
])
def test_bad_config_values_are_refused_naming_the_value(field, value):
    with pytest.raises(ValueError, match=re.escape(f"RouterConfig.{field}={value!r}")):
        RouterConfig(**{field: value})


def test_replicas_need_distinct_names():
    one = LocalReplica(engine(), name="same")
    try:
        with pytest.raises(ValueError, match=r"each with its own name; got \['same', 'same'\]"):
            Router([one, one], info=one.engine.info)
    finally:
        one.close()


# -- the shared inference-engine contract, with the router as the engine ---------------------------------------------


@pytest.fixture(scope="module")
def case():
    replicas = [LocalReplica(engine(), name=f"r{i}") for i in range(2)]
    with Router(replicas, info=replicas[0].engine.info) as router:
        yield EngineCase(engine=router, model_path=resolve_model("tiny-llama"), max_model_len=256, vocab_size=512,
                         logprob_atol=2e-5)


class TestRouterContract(InferenceEngineContract):
    pass
