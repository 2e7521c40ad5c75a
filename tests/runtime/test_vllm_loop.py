"""The RL loop with ``inference.engine: vllm`` (real vLLM on CPU): two GRPO steps, FSDP trainer colocated.

vLLM's CPU attention needs a head size of 32 or more, so the runs use the tests' tiny Llama with
``head_dim = 32`` (tests/engines/vllm_helpers.py), named by its folder. Skipped, with the reason, where
vLLM does not import.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.vllm_helpers import KV_CACHE_BYTES, require_vllm, vllm_tiny_model

require_vllm()

from tandem.config import ConfigError, load_config  # noqa: E402
from tandem.core.contracts import CONTRACTS  # noqa: E402
from tandem.runtime.builders import inference_engine_spec  # noqa: E402
from tandem.runtime.config import RunConfig  # noqa: E402
from tandem.runtime.loop import Run  # noqa: E402
from tandem.runtime.tracking import read_metrics  # noqa: E402

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
# fp32 on both sides: measured |vLLM - native forward| <= ~1e-5 on this model (tests/engines/test_vllm_engine.py)
FP32_GAP = 1e-4
def _vllm_bound(dtype: str) -> float:
    """The registered bound for an fp32 trainer with vLLM in ``dtype`` (first matching entry)."""
    return next(e.contract.tolerance for e in CONTRACTS
                if (e.trainer, e.engine) == ("fsdp", "vllm") and e.dtype in (None, dtype))


VLLM_BOUND = _vllm_bound("bfloat16")


def _cfg(dtype: str, *overrides: str) -> RunConfig:
    model = vllm_tiny_model()
    return load_config(RunConfig, RECIPE, [
        f"model.name={model}",
        "run.steps=2",
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]",
        "inference.engine=vllm",
        f"inference.vllm={{model: {{name: '{model}', dtype: {dtype}}}, "
        f"engine_kwargs: {{kv_cache_memory_bytes: {KV_CACHE_BYTES}}}}}",
        *overrides,
    ])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_grpo_steps_with_vllm_rollouts(tmp_path, dtype, request):
    """fp32 vLLM: step 1's rollout log-probs match the trained weights (so the sync reached vLLM);
    bf16 vLLM: the gap is logged, nonzero, within the registered bound, and TIS weights the loss."""
    extra = ["algorithm.off_policy.mode=tis", "algorithm.off_policy.tis_cap=1.02"] if dtype == "bfloat16" else []
    run = Run(_cfg(dtype, *extra), tmp_path)
    request.addfinalizer(run.close)  # a failed check before train() must not leave vLLM open
    assert run.contract.relation == "bounded" and run.contract.tolerance == _vllm_bound(dtype)
    run.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert run.engine.weight_version == 2  # two syncs, each applied before the version moved
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["contract/violation/max"] == 0
        gap = r["train_rollout_logprob_abs_diff/mean"]
        if dtype == "float32":
            # step 1 samples from the weights of step 0's update: any stale weight would show here
            assert 0 <= gap < FP32_GAP
        else:
            assert 0 < gap < VLLM_BOUND
            assert 0 < r["offpolicy/truncated_frac"] < 1 and r["offpolicy/weight_mean"] <= 1.02


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_modes_generate_with_vllm_while_the_trainer_trains(tmp_path, mode):
    """The rollout runs in another thread (in-process vLLM) while weight updates land between its steps."""
    run = Run(_cfg("float32", f"runtime.mode={mode}", "run.steps=3", "algorithm.off_policy.mode=tis",
                   "runtime.max_staleness=1"), tmp_path)
    run.train()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["train/grad_norm"] > 0 for r in rows)
    assert all(r.get("async/staleness_max", 0) <= 1 for r in rows)
    # step 0 trains on the initial weights on both sides: vLLM fp32 matches the trainer there
    assert rows[0]["train_rollout_logprob_abs_diff/mean"] < FP32_GAP


def test_separate_placement_runs_vllm_in_its_own_process(tmp_path):
    """The engine process builds the adapter from the same spec; broadcast updates reach vLLM there."""
    run = Run(_cfg("float32", "runtime.placement=separate", "sync.transport=broadcast"), tmp_path)
    run.train()
    rows = read_metrics(tmp_path)
    assert [r["sync/version"] for r in rows] == [1.0, 2.0]
    assert all(0 <= r["train_rollout_logprob_abs_diff/mean"] < FP32_GAP for r in rows)


@pytest.mark.parametrize("setting, message", [
    ("rollout.recompute_log_probs=true", "the adapter has no prefill score"),
    ("sync.delta=true", "vLLM reloads whole layers"),
    ("sync.verify=true", "vLLM repacks its weights"),
])
def test_settings_vllm_cannot_honour_are_refused_at_build(setting, message):
    with pytest.raises(ConfigError, match=f"{setting.split('=')[0]}: true needs .* which inference.engine: vllm "
                       rf"cannot give \({message}.*\); engines that have it: torch"):
        inference_engine_spec(_cfg("float32", setting))


def test_the_engine_section_gets_the_runs_seed_and_context():
    spec = inference_engine_spec(_cfg("bfloat16", "run.seed=5"))
    assert spec.factory == "tandem.engines.inference.vllm.engine:VLLMEngine"
    # data.max_prompt_tokens 128 + max_new_tokens 12, below the adapter's default 2048
    assert spec.config.seed == 5 and spec.config.max_model_len == 140
    assert spec.config.model.dtype == "bfloat16" and spec.config.lora_alpha is None
    # adapter-only sync: vLLM serves the trainer's adapter with the trainer's scaling and rank
    lora = inference_engine_spec(_cfg("float32", "trainer.fsdp.lora={rank: 32, alpha: 64.0}", "sync.lora_mode=adapter"))
    assert lora.config.lora_alpha == 64.0 and lora.config.lora_max_rank == 32


def test_routing_replay_is_refused_before_anything_is_built():
    # a MoE policy (routing replay on a dense one is refused by the trainer's entry first)
    with pytest.raises(ConfigError, match=r"routing replay in the trainer \(R3\) needs the routed experts .* which "
                                          r"inference.engine: vllm cannot give \(vLLM returns no routed experts\)"):
        inference_engine_spec(_cfg("float32", "trainer.fsdp.routing_replay=true", "model.name=tiny-qwen3-moe"))
