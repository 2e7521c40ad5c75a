"""FSDP2 on 2 gloo ranks against one process on the concatenated batch (fp32, tolerance 1e-6).

Two spawns: the first runs every sharded case plus the first half of a checkpointed run; the second,
a fresh process group, loads that checkpoint and finishes the run.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engines.training.fsdp import FSDPEngine, ParallelConfig

from . import fsdp_workers as workers
from .helpers import engine_grads, max_abs_diff, run_workers, sync_weights, token_mean_pg

pytestmark = pytest.mark.dist
TOL = 1e-6


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run_workers(workers.first_spawn, 2, str(out), str(out / "ckpt"))
    return out


def _load(out, name: str) -> list[dict]:
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]


def _single_process(overrides: dict, case: str = "") -> dict:
    """The same two steps as `workers.two_steps`, in one process on the whole batches."""
    overrides = {**overrides, "parallel": ParallelConfig(**{
        **{f: getattr(overrides.get("parallel", ParallelConfig()), f) for f in ("activation_checkpointing",)}
    })}
    engine = FSDPEngine(workers.config(**overrides))
    stats = engine._accumulate_gradients(workers.case_batch(case, 0), token_mean_pg)
    grads = engine_grads(engine)
    m1 = engine._finish_step(engine.policy, "policy", stats, 0.0)
    m2 = engine.train_step(workers.case_batch(case, 1), token_mean_pg)
    first = workers.case_batch(case, 0)
    return {"grads": grads, "metrics": [m1, m2], "weights": sync_weights(engine),
            "logp": engine.forward_logprobs(first).log_probs,
            "ref_logp": engine.forward_logprobs(first, model="ref").log_probs if engine.ref is not None else None}


@pytest.mark.parametrize("case", list(workers.CASES))
def test_sharded_step_equals_single_process(spawned, case):
    ranks = [r[case] for r in _load(spawned, "equivalence")]
    ref = _single_process(workers.CASES[case][0], case)
    for r in ranks:  # every rank gathers the same full gradients and weights
        assert max_abs_diff(r["grads"], ref["grads"]) < TOL
        assert max_abs_diff(r["weights"], ref["weights"]) < TOL
        for got, want in zip(r["metrics"], ref["metrics"], strict=True):
            for key in ("train/loss", "train/grad_norm", "pg/loss", "pg/logp_mean", "pg/logp/min"):
                # scalars of O(10) summed in another order: relative tolerance (the gradient norm sums the squares
                # of every gradient entry in fp32, per rank then across ranks: 1.3e-6 apart in one case)
                tol = 2 * TOL if key == "train/grad_norm" else TOL
                assert abs(got[key] - want[key]) < tol * max(1.0, abs(want[key])), (key, got[key], want[key])
            assert got["train/skipped_step"] == 0.0
        # log-probs of |log p| ~ 10 after two steps on weights that agree to ~1e-7: a few ulps apart
        want = ref["logp"][r["rows"], : r["logp"].shape[1]]
        assert (r["logp"] - want).abs().max() < 1e-5
    if case == "lora":
        assert all(".lora_" in n for n in ranks[0]["grads"])
    if case == "reference":  # the frozen model, read as it was sharded, gives the single process's log-probs
        for r in ranks:
            want = ref["ref_logp"][r["rows"], : r["ref_logp"].shape[1]]
            assert (r["ref_logp"] - want).abs().max() < 1e-5 and not torch.equal(r["ref_logp"], r["logp"])
    if case == "shared-prompts":  # each rank holds whole groups: a prompt is fed once on one rank
        assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == list(range(8))
        assert all(len({i // 2 for i in r["rows"]}) * 2 == len(r["rows"]) for r in ranks)
        fed = [r["metrics"][0]["train/tokens"] for r in ranks]  # summed over the ranks
        per_row = float(workers.case_batch(case, 0).seq_lengths.sub(1).sum())
        assert fed[0] == fed[1] == ref["metrics"][0]["train/tokens"] < per_row
    # the model's matrices are read as each module is sharded (fsdp/deferred.py): a rank reads its rows of every
    # one of them, so the ranks of a shard group read the checkpoint once between them (HSDP's shard groups are one
    # rank each here); the HF model reads its vectors that way too; `sharded_load: false` loads the whole model
    # first on every rank
    shard_world = 1 if case == "hsdp-replicate-2" else 2
    for rank, r in enumerate(ranks):
        want = workers.deferred_bytes(rank % shard_world, shard_world, vectors=case == "padded-micro-batches")
        want *= 0 if case == "whole-load" else 2 if case == "reference" else 1
        assert r["deferred_bytes"] == want, (rank, r["deferred_bytes"], want)
    if case not in ("whole-load", "hsdp-replicate-2"):
        whole = workers.deferred_bytes(0, 1, vectors=case == "padded-micro-batches")
        assert sum(r["deferred_bytes"] for r in ranks) == whole * (2 if case == "reference" else 1)
    # the native model on a 1-D mesh uses the embedding / LM head by vocabulary shard (fsdp/vocab_parallel.py);
    # the HF fallback and HSDP gather them whole
    assert all(r["vocab_parallel"] == (case not in ("padded-micro-batches", "hsdp-replicate-2")) for r in ranks)


def test_nan_on_one_rank_skips_the_step_everywhere(spawned):
    for r in _load(spawned, "equivalence"):
        nan = r["nan"]
        assert nan["metrics"]["train/skipped_step"] == 1.0 and math.isnan(nan["metrics"]["train/loss"])
        assert max_abs_diff(nan["after"], nan["before"]) == 0.0


def test_bf16_mixed_precision_trains(spawned):
    for r in _load(spawned, "equivalence"):
        first, second = r["bf16"]
        assert math.isfinite(first["train/loss"]) and first["train/skipped_step"] == 0.0
        assert second["train/loss"] < first["train/loss"]  # the same batch twice: the loss falls


def test_resume_in_fresh_processes_is_bit_exact(spawned):
    run_workers(workers.load_continue, 2, str(spawned), str(spawned / "ckpt"))
    straights, resumeds = _load(spawned, "straight"), _load(spawned, "resumed")
    assert straights[0]["saved"]["optim"]["state"]  # rank 0 compares Adam's moments
    for straight, resumed in zip(straights, resumeds, strict=True):
        assert resumed["loaded"]["step"] == 2
        assert max_abs_diff(resumed["loaded"]["weights"], straight["saved"]["weights"]) == 0.0
        # the full optimizer state is gathered on rank 0 only (cpu_offload=True)
        for key, want in straight["saved"]["optim"].get("state", {}).items():
            got = resumed["loaded"]["optim"]["state"][key]
            assert all(torch.equal(got[k], want[k]) for k in want), key
        timing = ("tokens_per_s", "step_time_s")
        untimed = [[{k: v for k, v in m.items() if not k.endswith(timing)} for m in run["tail"]] for run in (resumed, straight)]
        assert untimed[0] == untimed[1]  # losses, grad norms, learning rates: bit for bit
        assert max_abs_diff(resumed["final"], straight["final"]) == 0.0


def test_a_world_2_checkpoint_exports_in_one_process(spawned, tmp_path):
    """The vocabulary-sharded embedding is saved as a DTensor like FSDP's shards: one process reads it whole."""
    from safetensors.torch import load_file

    from tandem.engines.training.fsdp.export import export_hf

    out = export_hf(spawned / "ckpt", tmp_path / "hf")
    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(str(f)))
    saved = _load(spawned, "straight")[0]["saved"]["weights"]
    assert "model.embed_tokens.weight" in saved
    assert max_abs_diff({k: exported[k] for k in saved}, saved) == 0.0
