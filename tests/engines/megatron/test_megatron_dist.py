"""The Megatron engine on 2 gloo ranks against one process on the whole batch (fp32).

One spawn runs tensor parallelism (TP 2, untied Qwen2 and tied Llama), pipeline parallelism (PP 2),
data parallelism (plain and with the ZeRO-sharded optimizer), expert parallelism (EP 2 on the tiny
MoE), LoRA under TP 2 and PP 2, two checkpoint resumes and a NaN on one rank. The parent runs each model
on one rank (TP 1).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'tandem-rl[megatron]')"
)

from tandem.engines.training.megatron import MegatronEngine  # noqa: E402

from ..training.helpers import make_batch, max_abs_diff, run_workers, sync_weights, token_mean_pg  # noqa: E402
from . import workers  # noqa: E402

pytestmark = pytest.mark.dist
KEYS = ("train/loss", "train/grad_norm", "pg/loss", "pg/logp_mean", "pg/logp/min")


@pytest.fixture(scope="module")
def spawn_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-dist")
    run_workers(workers.all_layouts, 2, str(out))
    return out


@pytest.fixture(scope="module")
def spawned(spawn_dir):
    return [torch.load(spawn_dir / f"layouts_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single_process():
    """The same two steps (`workers.two_steps`) on one rank, per model; computed once."""
    cache: dict[str, dict] = {}

    def run(model: str, dtype: str, lora: bool, shared: bool = False) -> dict:
        if (model, dtype, lora, shared) not in cache:
            engine = MegatronEngine(workers.config(model, dtype=dtype, lora=lora))
            try:
                cache[model, dtype, lora, shared] = workers.two_steps(engine, shared)
            finally:
                engine.close()
        return cache[model, dtype, lora, shared]

    return run


@pytest.mark.parametrize("case", list(workers.CASES))
def test_parallel_step_equals_single_process(spawned, single_process, case):
    model, parallel = workers.CASES[case]
    ref = single_process(model, parallel.get("dtype", "float32"), parallel.get("lora", False),
                         parallel.get("shared", False))
    for rank in spawned:
        got = rank[case]
        if case.startswith(("dp2", "ep2")):
            assert got["dp_size"] == 2 and len(got["rows"]) < 8  # each replica trained on half the rows
        else:
            assert got["dp_size"] == 1 and got["rows"] == list(range(8))
        for mine, want in zip(got["metrics"], ref["metrics"], strict=True):
            for key in KEYS:  # O(10) values summed in another order: relative tolerance
                assert abs(mine[key] - want[key]) < 1e-6 * max(1.0, abs(want[key])), (
                    case,
                    key,
                    mine[key],
                    want[key],
                )
            assert mine["train/skipped_step"] == 0.0
        assert max_abs_diff(got["weights"], ref["weights"]) < 1e-6, case
        if parallel.get("lora"):  # the export is the adapters alone, and the steps moved B off its zeros
            assert all(".lora_" in n for n in got["weights"])
            assert min(float(t.abs().max()) for n, t in got["weights"].items() if "lora_B" in n) > 0
        rows = got["rows"]
        width = got["logp"].shape[1]
        assert (got["logp"] - ref["logp"][rows, :width]).abs().max() < 1e-5, case
        assert (got["entropy"] - ref["entropy"][rows, :width]).abs().max() < 1e-5, case


@pytest.mark.parametrize("case", ["tp2-qwen2-lora", "pp2-llama-tied-lora"])
def test_the_planner_counts_the_adapters_each_rank_trains(spawned, case):
    """`tandem plan`'s Megatron LoRA memory model holds the adapter parameters each rank actually has."""
    from tandem.plan.archs import resolve_arch
    from tandem.plan.memory import megatron_lora_params

    model, parallel = workers.CASES[case]
    tp, pp = parallel.get("tensor_parallel", 1), parallel.get("pipeline_parallel", 1)
    planned = megatron_lora_params(resolve_arch(model), workers.LORA.rank, tp, pp)
    for rank in spawned:
        assert rank[case]["trainable"] == planned, (case, rank[case]["trainable"], planned)


def test_every_rank_gets_the_same_full_hf_weights(spawned):
    for case in workers.CASES:
        assert max_abs_diff(spawned[0][case]["weights"], spawned[1][case]["weights"]) == 0.0, case


@pytest.mark.parametrize("case", workers.RESUMED)
def test_resume_is_bit_exact(spawned, case):
    for rank in spawned:
        r = rank[f"resume-{case}"]
        assert r["loaded"]["step"] == 2
        assert max_abs_diff(r["loaded"]["weights"], r["saved"]) == 0.0
        untimed = [
            [{k: v for k, v in m.items() if not k.endswith(("tokens_per_s", "step_time_s"))} for m in tail]
            for tail in (r["resumed_tail"], r["straight_tail"])
        ]
        assert untimed[0] == untimed[1]  # losses, grad norms, learning rates (the schedule resumed)
        assert max_abs_diff(r["resumed_final"], r["straight_final"]) == 0.0


def test_nan_on_one_rank_skips_the_step_everywhere(spawned):
    for rank in spawned:
        nan = rank["nan"]
        assert nan["metrics"]["train/skipped_step"] == 1.0 and math.isnan(nan["metrics"]["train/loss"])
        assert max_abs_diff(nan["after"], nan["before"]) == 0.0


def test_model_parallel_peers_must_get_the_same_rows(spawned):
    for rank in spawned:
        assert "peers were given different batches" in rank["peer_mismatch"]


def test_layouts_the_cpu_cannot_run_say_why(spawned):
    for rank in spawned:
        errors = rank["build_errors"]
        assert "needs the TransformerEngine layer spec" in errors["sequence-parallel-on-cpu"]
        assert (
            "a MoE model with tensor_parallel=2 needs sequence_parallel=True" in errors["moe-tp2-without-sp"]
        )


def test_resume_needs_the_same_model_parallel_layout(spawn_dir, spawned):
    engine = MegatronEngine(workers.config("tiny-qwen2"))
    try:
        with pytest.raises(
            ValueError, match=r"saved with parallel layout \{'tensor_parallel': 2.*this engine runs"
        ):
            engine.load(str(spawn_dir / "ckpt-tp2-qwen2"))
    finally:
        engine.close()


def test_tensor_parallel_moves_weights_like_one_rank(spawned):
    """A sanity check that the comparison above is not vacuous: the steps changed the weights."""
    engine = MegatronEngine(workers.config("tiny-qwen2"))
    try:
        initial = sync_weights(engine)
        engine.train_step(make_batch(seed=0), token_mean_pg)
    finally:
        engine.close()
    assert max_abs_diff(spawned[0]["tp2-qwen2"]["weights"], initial) > 1e-4


@pytest.mark.parametrize("case", ["tp2-qwen2", "tp2-qwen2-lora"])
def test_tandem_export_of_a_tp2_checkpoint_in_one_process(spawn_dir, spawned, case, tmp_path):
    """`tandem export` unshards the TP 2 checkpoint the spawn saved: the weights the engine synced at the save
    (a LoRA checkpoint: its adapters, as a peft folder), bit for bit."""
    from safetensors.torch import load_file

    from tandem.cli import main as cli_main

    lora = case.endswith("lora")
    args = ["export", str(spawn_dir / f"ckpt-{case}"), str(tmp_path / "out")] + (["--adapter-only"] if lora else [])
    assert cli_main(args) == 0
    got = load_file(str(tmp_path / "out" / ("adapter_model.safetensors" if lora else "model.safetensors")))
    assert max_abs_diff(got, spawned[0][f"resume-{case}"]["saved"]) == 0.0
    if not lora:
        assert cli_main([*args, "--adapter-only"]) == 2  # a full checkpoint has no adapters: refused, named


def test_chunked_head_over_two_vocabulary_slices_equals_one_process(spawned):
    """`head_logprobs` under TP 2 (each rank half the padded vocabulary, chunks of 3 of 7 rows): the log-probs,
    entropy and hidden-state gradient of the whole vocabulary on every rank, each rank its rows' weight gradient;
    and the same on hidden states gathered from halves of the rows (sequence parallelism), each rank its half's
    gradient."""
    from .test_megatron_logprobs import head_reference

    hidden, weight, targets, w_logp, w_ent = workers.head_inputs()
    hidden.requires_grad_(), weight.requires_grad_()
    ref_logp, ref_ent = head_reference(hidden, weight, targets, 0.7)
    ((ref_logp * w_logp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    g_rows = torch.cat([hidden.grad, torch.zeros(1, 8)])
    rows = workers.HEAD_PADDED // 2
    for rank, out in enumerate(r["head"] for r in spawned):
        assert (out["tp"]["plain"].double() - ref_logp).abs().max() < 1e-5
        for mode, g_hidden in (("tp", hidden.grad), ("sp", g_rows[rank * 4 : rank * 4 + 4])):
            got = out[mode]
            assert (got["logp"].double() - ref_logp).abs().max() < 1e-5, mode
            assert (got["ent"].double() - ref_ent).abs().max() < 1e-5, mode
            assert (got["g_hidden"] - g_hidden).abs().max() < 1e-5, mode  # summed over the two slices
            assert (got["g_weight"] - weight.grad[rank * rows : (rank + 1) * rows]).abs().max() < 1e-5, mode
    assert not spawned[1]["head"]["tp"]["g_weight"][workers.HEAD_VOCAB - rows :].any()  # padded rows
