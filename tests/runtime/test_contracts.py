"""True-on-policy contracts and MoE routing replay (R3) across the embedded engine and FSDP."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tandem.config import load_config
from tandem.core.batch import TrainBatch
from tandem.core.contracts import (
    Contract,
    ContractCheck,
    ContractConfig,
    ContractError,
    ContractViolation,
    RunSettings,
    resolve_contract,
)
from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.core.sample import Sample
from tandem.engines.inference.torch import TorchEngine
from tandem.engines.inference.torch.config import TorchEngineConfig
from tandem.engines.training.fsdp import FSDPEngine
from tandem.engines.training.fsdp.config import FSDPConfig
from tandem.models import ModelConfig
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"
EVEN = "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]"
DET = ["inference.torch.deterministic=true", "trainer.fsdp.deterministic=true"]


def _settings(**kw) -> RunSettings:
    base = dict(trainer="fsdp", engine="torch", moe=False, trainer_dtype="float32", engine_dtype="float32",
                trainer_deterministic=True, engine_deterministic=True, routing_replay=False, lora=False,
                trainer_temperature=1.0, engine_temperature=1.0)
    return RunSettings(**(base | kw))


def test_registry_resolution_and_startup_errors():
    assert resolve_contract(_settings(), ContractConfig()).relation == "exact"
    bf16 = _settings(trainer_dtype="bfloat16", engine_dtype="bfloat16")
    assert resolve_contract(bf16, ContractConfig()).relation == "exact"
    assert resolve_contract(_settings(engine_dtype="bfloat16"), ContractConfig()).relation == "bounded"
    # missing settings: auto degrades to bounded, exact is a start-up error naming what is missing
    loose = _settings(engine_deterministic=False)
    assert resolve_contract(loose, ContractConfig()).relation == "bounded"
    with pytest.raises(ContractError, match=r"needs: a deterministic \(batch-invariant\) inference engine"):
        resolve_contract(loose, ContractConfig(expect="exact"))
    hinted = _settings(engine_deterministic=False, hints=(("engine_deterministic", "inference.torch.deterministic: true"),))
    with pytest.raises(ContractError, match="needs: inference.torch.deterministic: true"):  # the entry's hint
        resolve_contract(hinted, ContractConfig(expect="exact"))
    with pytest.raises(ContractError, match=r"routing replay \(R3\) in the trainer"):
        resolve_contract(_settings(moe=True), ContractConfig(expect="exact"))
    assert resolve_contract(_settings(moe=True, routing_replay=True), ContractConfig(expect="exact")).relation == "exact"
    with pytest.raises(ContractError, match=r"LoRA adapters served unmerged \(sync.lora_mode: adapter"):
        resolve_contract(_settings(lora=True), ContractConfig(expect="exact"))
    with pytest.raises(ContractError, match="has no exact contract"):
        resolve_contract(_settings(engine="vllm"), ContractConfig(expect="exact"))


def test_bounded_pairs_have_a_tighter_bound_when_both_sides_compute_in_fp32():
    for trainer, engine in [("fsdp", "vllm"), ("megatron", "torch")]:
        fp32 = resolve_contract(_settings(trainer=trainer, engine=engine), ContractConfig())
        bf16 = resolve_contract(_settings(trainer=trainer, engine=engine, trainer_dtype="bfloat16",
                                          engine_dtype="bfloat16"), ContractConfig())
        mixed = resolve_contract(_settings(trainer=trainer, engine=engine, engine_dtype="bfloat16"), ContractConfig())
        assert fp32.relation == bf16.relation == mixed.relation == "bounded"
        assert fp32.tolerance == 1e-3 and bf16.tolerance == mixed.tolerance > 0.05
        # a bf16 trainer (e.g. FSDP's param_dtype) against an fp32 engine: the bf16 bound, not fp32's
        reverse = resolve_contract(_settings(trainer=trainer, engine=engine, trainer_dtype="bfloat16"), ContractConfig())
        assert reverse.relation == "bounded" and reverse.tolerance == mixed.tolerance
    embedded = resolve_contract(_settings(trainer_dtype="bfloat16"), ContractConfig())  # fsdp + torch: exact needs same_dtype
    assert embedded.relation == "bounded" and embedded.tolerance == 0.1 and "same_dtype" in embedded.note


def _batch(rollout: list[list[float]]) -> TrainBatch:
    samples = [Sample(tokens=[1, 2] + [3] * len(r), response_length=len(r), rollout_log_probs=r, index=10 + i)
               for i, r in enumerate(rollout)]
    return TrainBatch.from_samples(samples)


def test_contract_check_names_first_offending_sample_and_position():
    batch = _batch([[-1.0, -2.0], [-0.5, -0.25, -3.0]])
    train = batch.rollout_log_probs.clone()
    exact = ContractCheck(contract=Contract(relation="exact", tolerance=0.0))
    assert exact.check(train, batch) == {"contract/violation": 0.0}
    train[1, 2] = -3.0000002
    with pytest.raises(ContractViolation, match="first at sample 11, response position 2"):
        exact.check(train, batch)
    warn = ContractCheck(contract=Contract(relation="exact", tolerance=0.0), on_violation="warn")
    assert warn.check(train, batch) == {"contract/violation": 1.0} and warn.violations == 1
    # the trainer's log-probs carry autograd in the first update: the message reads them without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn.check(train.clone().requires_grad_(), batch) == {"contract/violation": 1.0}
    # padding (beyond a row's response) never counts
    padded = batch.rollout_log_probs.clone()
    padded[0, 2] = 123.0
    assert exact.check(padded, batch)["contract/violation"] == 0.0


@pytest.mark.parametrize("model, extra", [
    ("tiny-llama", []),
    ("tiny-qwen3-moe", ["trainer.fsdp.routing_replay=true"]),
    ("tiny-llama", ["model.dtype=bfloat16"]),
])
def test_exact_contract_three_grpo_steps_zero_diff(tmp_path, model, extra):
    """Deterministic mode on both sides: trainer log-probs equal rollout log-probs every step, also when
    training packs rows differently than generation batched them (tiny micro-batch budget)."""
    cfg = load_config(RunConfig, RECIPE, [EVEN, f"model.name={model}", *DET, *extra,
                                          "algorithm.contract.expect=exact", "trainer.fsdp.micro_batch_tokens=128"])
    run = Run(cfg, tmp_path)
    assert run.contract.relation == "exact" and run.old_source == "rollout"
    run.train()
    rows = read_metrics(tmp_path)
    assert len(rows) == 3
    for r in rows:
        assert r["train_rollout_logprob_abs_diff/max"] == 0.0, r
        assert r["contract/violation/max"] == 0.0
    if "moe" in model:
        assert all("moe/route_mismatch_frac" in r for r in rows)


def test_exact_contract_without_deterministic_mode_is_a_startup_error(tmp_path):
    cfg = load_config(RunConfig, RECIPE, [EVEN, "algorithm.contract.expect=exact"])
    with pytest.raises(ContractError, match="needs: trainer.fsdp.deterministic: true; inference.torch.deterministic"):
        Run(cfg, tmp_path)


def test_recompute_old_log_probs_and_mini_batches(tmp_path):
    cfg = load_config(RunConfig, RECIPE, [EVEN, "algorithm.mini_batches=2", "rollout.recompute_log_probs=true"])
    run = Run(cfg, tmp_path)
    assert run.contract.relation == "bounded" and run.old_source == "recompute"
    run.train()
    rows = read_metrics(tmp_path)
    assert all(r["time/old_logprob_s"] > 0 and "rollout/recompute_abs_diff_mean" in r for r in rows)
    # prefill and training kernels differ only by rounding here
    assert all(r["train_rollout_logprob_abs_diff/mean"] < 1e-4 for r in rows)


def test_r3_replay_restores_routing_agreement():
    """Rollout in bf16 routes some tokens differently from fp32 training; replaying the rollout's expert
    ids makes the trainer use exactly those experts and brings its log-probs closer to the rollout's."""
    name = "tiny-qwen3-moe"
    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name=name, dtype="bfloat16"), max_model_len=128))
    reqs = [GenerationRequest(prompt_token_ids=list(range(5, 5 + p)),
                              sampling=SamplingParams(max_new_tokens=24, seed=s, n=2, return_routed_experts=True))
            for s, p in enumerate([7, 19, 11, 30])]
    samples = []
    for res in engine.generate(reqs):
        for c in res.completions:
            e = c.routed_experts
            assert e.shape == (len(res.prompt_token_ids) + len(c.token_ids) - 1, 2, 2) and e.dtype.name == "int32"
            samples.append(Sample(tokens=res.prompt_token_ids + c.token_ids, response_length=len(c.token_ids),
                                  rollout_log_probs=c.log_probs, rollout_routed_experts=e, index=len(samples)))
    batch = TrainBatch.from_samples(samples)
    batch.advantages = torch.ones_like(batch.loss_mask)
    mask = batch.loss_mask > 0

    def diff(lp):
        return float(((lp - batch.rollout_log_probs).abs() * mask).sum() / mask.sum())

    plain = FSDPEngine(FSDPConfig(model=ModelConfig(name=name), micro_batch_tokens=96))
    replay = FSDPEngine(FSDPConfig(model=ModelConfig(name=name), micro_batch_tokens=96, routing_replay=True))
    d_plain = diff(plain.forward_logprobs(batch).log_probs)
    d_replay = diff(replay.forward_logprobs(batch).log_probs)
    from tests.runtime.rewards import pg_loss

    metrics = replay.train_step(batch, pg_loss)
    assert metrics["moe/route_mismatch_frac"] > 0, "bf16 rollout should route some tokens differently"
    assert d_replay < d_plain
