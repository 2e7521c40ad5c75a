"""``runtime.placement: ray`` on a simulated two-node cluster (two raylets on this machine).

Node A holds the trainer (resource ``trainer_node``), node B the two inference replicas (``engine_node``):
nothing may assume one process or one node. Tiny-model GRPO runs in every loop mode; replicas are
killed at random points and the run loses no sample; a trainer rank is killed and the run resumes
from its last checkpoint by itself.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tandem.config import load_config  # noqa: E402
from tandem.runtime.config import RunConfig  # noqa: E402
from tandem.runtime.loop import Run  # noqa: E402
from tandem.runtime.tracking import read_metrics  # noqa: E402
from tandem.sync.base import tensor_hashes  # noqa: E402

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
ASYNC = ["algorithm.off_policy.mode=tis", "runtime.max_staleness=1"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer_node": 1}})
    c.add_node(num_cpus=2, resources={"engine_node": 1})
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def _cfg(cluster, *overrides: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", "runtime.placement=ray",
        f"ray.address={cluster.address}", "inference.replicas=2", "ray.trainer_resources={trainer_node: 0.1}",
        "ray.engine_resources={engine_node: 0.1}", "ray.torch_threads=1", *overrides,
    ])


def _nodes(cluster) -> dict[str, str]:
    """Ray node id -> which simulated node it is."""
    return {n["NodeID"]: ("A" if "trainer_node" in n["Resources"] else "B") for n in ray.nodes() if n["Alive"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.ci), "one_step_off", "fully_async"])
def test_grpo_on_a_two_node_cluster(tmp_path, cluster, mode):
    run = Run(_cfg(cluster, f"runtime.mode={mode}", "run.steps=3", *([] if mode == "sync" else ASYNC)), tmp_path)
    nodes = _nodes(cluster)
    assert {nodes[n] for n in run.trainer.nodes()} == {"A"}
    assert {nodes[c.health()["node"]] for c in run.cluster.clients} == {"B"}
    run.train(close=False)
    trainer = tensor_hashes(nt for b in run.trainer.named_parameters_for_sync(1 << 30) for nt in b)
    replicas = [ray.get(c.handle.call.remote("weight_digest")) for c in run.cluster.clients]
    run.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["rollout/samples"] == 2 * 4 and r["train/skipped_step"] == 0
        assert r["sync/replicas"] == 2 if "sync/replicas" in r else mode == "one_step_off"
    # both replicas hold the trainer's final weights, bit for bit (their version: the run's last)
    for digest in replicas:
        assert {k: digest[k] for k in trainer} == trainer
    served = [rows[-1][f"router/replica{i}/served"] for i in range(2)]
    assert all(s > 0 for s in served), served  # both replicas took traffic


@pytest.mark.slow
@pytest.mark.parametrize("kills_wanted, steps", [pytest.param(6, 24, marks=pytest.mark.ci), (20, 80)],
                         ids=["bounded", "full"])
def test_replicas_killed_at_random_lose_no_sample(tmp_path, cluster, kills_wanted, steps):
    """CI runs the bounded case (6 kills over 24 steps, ~1 min); the full one (20 over 80, ~3 min) is slow."""
    run = Run(_cfg(cluster, f"run.steps={steps}", "ray.max_replica_restarts=30",
                   "reward.terms=[{name: 'tests.runtime.rewards:slow_even_tokens'}]"), tmp_path)
    kills: list[str] = []
    stop = threading.Event()

    def killer() -> None:  # any live replica, at random moments: mid-generation, mid-sync, both down at once
        rng = random.Random(0)
        while len(kills) < kills_wanted and not stop.is_set():
            time.sleep(rng.uniform(0.2, 1.2))
            live = [c for c in run.cluster.clients if _alive(c)]
            if live:
                victim = rng.choice(live)
                ray.kill(victim.handle, no_restart=False)
                kills.append(victim.name)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        run.train()
    finally:
        stop.set()
        thread.join(timeout=10)
    rows = read_metrics(tmp_path)
    assert len(kills) == kills_wanted, f"the run ended after {len(kills)} kills"
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:  # every step trained on every prompt's whole group
        assert r["rollout/samples"] == 2 * 4 and r["rollout/groups_kept"] == 2 and r["rollout/failed"] == 0
    last = rows[-1]
    assert last["router/requeued"] > 0  # requests held by killed replicas ran again elsewhere
    # restarts the router saw (a replica killed again before the router probed it back is not seen twice)
    assert last["router/restarts_seen"] >= 1 and last["router/quarantined"] <= 2


@pytest.mark.slow
def test_megatron_trainer_ranks_as_actors(tmp_path, cluster):
    pytest.importorskip("megatron.core")
    run = Run(_cfg(cluster, "trainer.engine=megatron", "run.steps=2"), tmp_path)
    assert run.trainer.info.name == "megatron"
    run.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and all(r["train/skipped_step"] == 0 for r in rows)
    assert all(r["train_rollout_logprob_abs_diff/mean"] < 1e-4 for r in rows)  # fp32: bounded pair, ~1e-6


@pytest.mark.slow
def test_colocated_layout_shares_bundles_and_sleeps_the_replicas(tmp_path, cluster):
    """Replicas in the trainer ranks' bundles (one node here), asleep while the trainer trains."""
    run = Run(_cfg(cluster, "ray.layout=colocated", "run.steps=2", "ray.engine_resources={}",
                   "ray.trainer_cpus=2"), tmp_path)
    assert run.shares_memory and run.engine.info.can_sleep
    nodes = _nodes(cluster)
    assert {nodes[n] for n in run.trainer.nodes()} == {nodes[c.health()["node"]] for c in run.cluster.clients} == {"A"}
    sleeps = []
    sleep = run.engine.sleep
    run.engine.sleep = lambda: (sleeps.append(1), sleep())[1]
    run.train()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1] and len(sleeps) == 2


@pytest.mark.slow
def test_tandem_serve_puts_ray_replicas_behind_the_router(cluster):
    """Every turn of a session goes to one replica; both replicas serve sessions."""
    import httpx2 as httpx

    from tests.serve_helpers import serving

    with serving([str(RECIPE), "runtime.placement=ray", f"ray.address={cluster.address}", "inference.replicas=2",
                  "ray.engine_resources={engine_node: 0.1}", "ray.torch_threads=1"], timeout_s=180) as base:
        for _ in range(4):  # four sessions of two turns each
            sid = httpx.post(f"{base}/sessions").json()["id"]
            messages = [{"role": "user", "content": "What is 1 + 1?"}]
            for _turn in range(2):
                r = httpx.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                               json={"messages": messages, "max_tokens": 3})
                assert r.status_code == 200
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
        served = [row["served"] for row in httpx.get(f"{base}/health").json()["engine"]["replicas"]]
    assert len(served) == 2 and all(n > 0 for n in served) and sum(served) == 8
    # affinity: each session's two turns landed on one replica (served counts move in steps of 2)
    assert all(n % 2 == 0 for n in served)


@pytest.mark.slow
@pytest.mark.ci
def test_tandem_serve_speaks_sglangs_api_from_ray_replicas(cluster):
    """--api sglang with runtime.placement: ray: the SGLang adapter drives both replicas through one server; a
    weight update from disk reaches both (the completions after it carry the new version)."""
    from tandem.core.protocols import GenerationRequest, SamplingParams
    from tests.engines.sglang_helpers import adapter
    from tests.serve_helpers import serving

    with serving([str(RECIPE), "runtime.placement=ray", f"ray.address={cluster.address}", "inference.replicas=2",
                  "ray.engine_resources={engine_node: 0.1}", "ray.torch_threads=1", "--api", "sglang"],
                 timeout_s=180) as base:
        engine = adapter(base, max_model_len=128)  # the recipe's context
        try:
            requests = [GenerationRequest(prompt_token_ids=[3 + i, 7, 9], sampling=SamplingParams(
                n=2, temperature=1.0, max_new_tokens=4, seed=i)) for i in range(6)]
            before = engine.generate(requests)
            assert all(r.error is None and len(r.completions) == 2 for r in before)
            from safetensors.torch import load_file

            from tandem.models import resolve_model

            weights = {}
            for f in sorted(resolve_model("tiny-llama").glob("*.safetensors")):
                weights |= load_file(str(f))
            engine.update_weights(weights.items(), version=5)
            after = engine.generate(requests)
            assert all(c.weight_versions == [5] for r in after for c in r.completions)
            health = engine.health()
            assert health["weight_version"] == 5
        finally:
            engine.close()
        import httpx2 as httpx

        replicas = httpx.get(f"{base}/server_info").json()["internal_states"][0]["replicas"]
    assert len(replicas) == 2 and all(r["served"] > 0 for r in replicas)
    assert all(r["weight_version"] == 5 for r in replicas)


def _alive(client) -> bool:
    try:
        client.health()
        return True
    except Exception:  # noqa: BLE001 - dead or restarting
        return False


@pytest.mark.slow
@pytest.mark.ci
def test_a_killed_trainer_rank_resumes_from_the_last_checkpoint(tmp_path, cluster):
    run = Run(_cfg(cluster, "run.steps=4", "run.save_every=1", "ray.trainer_ranks=2"), tmp_path)
    killed = threading.Event()

    def killer() -> None:
        while len(read_metrics(tmp_path)) < 2:
            time.sleep(0.05)
        run.trainer.kill_rank(1)
        killed.set()

    threading.Thread(target=killer, daemon=True).start()
    run.train()
    assert killed.is_set()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the lost steps were done again, once each
    assert rows[-1]["ray/trainer_restarts"] == 1
