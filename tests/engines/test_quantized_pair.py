"""A quantized pair: the FSDP engine trains with QAT, the embedded engine serves the same format.

After a train step and a sync (in-process; the trainer's master weights, or quantize-on-send), the
engine's rollout log-probs equal the trainer's ``forward_logprobs`` bit for bit in deterministic mode,
and agree within a measured tolerance otherwise. Then the same pair inside the RL loop.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from tandem.config import from_dict, load_config
from tandem.core.contracts import ContractError, ContractViolation
from tandem.engines.training.fsdp import FSDPConfig, LoRAConfig, RefConfig
from tandem.kernels import QuantConfig, fake_quantize_weight
from tandem.runtime.config import RunConfig
from tandem.runtime.loop import Run
from tandem.runtime.tracking import read_metrics
from tandem.sync import SyncConfig, build_sender
from tests.engines.quantized_helpers import FORMATS, MODEL, engine, master_weights, rollout, trainer
from tests.engines.training.helpers import token_mean_pg

# Normal mode: the largest |train - rollout| log-prob difference measured on these pairs was 4.8e-6
# (fp32; different kernels for decode and the packed forward); 20x margin.
NORMAL_TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is ~10x faster than two on a shared, loaded 2-core machine
    (measured: OpenMP teams stall at their barriers). Both engines run in this process, same count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _targets(train) -> set[str]:
    return {f"{name.removeprefix('lm.')}.weight" for name, m in train.policy.module.named_modules()
            if type(m).__name__ == "QATLinear"}


@pytest.mark.parametrize("send", ["masters", "quantize_on_send"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_deterministic_pair_is_bit_exact_after_a_step_and_a_sync(fmt, send):
    cfg = FORMATS[fmt]
    inference, train = engine(cfg, deterministic=True), trainer(cfg, deterministic=True)
    try:
        batch = rollout(inference, seed=0)  # the engine's start weights: the model files, quantized on load
        quantized_lp = train.forward_logprobs(batch).log_probs
        assert torch.equal(quantized_lp, batch.rollout_log_probs)
        plain_lp = trainer(None, deterministic=True).forward_logprobs(batch).log_probs
        assert not torch.equal(plain_lp, quantized_lp)  # quantization really changes the numbers

        train.train_step(batch, token_mean_pg)
        sync_cfg = SyncConfig(quantize=cfg if send == "quantize_on_send" else None, verify=send != "masters")
        metrics = build_sender(sync_cfg, engine=inference).send(train.named_parameters_for_sync(1 << 16), 1)
        if send == "quantize_on_send":  # fp8/int4 bytes travelled, and verify found the engine exact
            assert metrics["sync/bytes"] < 0.7 * metrics["sync/bytes_unquantized"]
            assert metrics["sync/verified_tensors"] > 0

        masters, held = master_weights(train), inference.named_weights()
        targets = _targets(train)
        assert len(targets) == 14  # q/k/v/o + gate/up/down in 2 layers
        for name, w in masters.items():
            want = fake_quantize_weight(w, cfg) if name in targets else w
            assert torch.equal(held[name], want), name
        assert not torch.equal(held["model.layers.0.mlp.up_proj.weight"], masters["model.layers.0.mlp.up_proj.weight"])

        batch = rollout(inference, seed=1)
        assert torch.equal(train.forward_logprobs(batch).log_probs, batch.rollout_log_probs)
    finally:
        inference.close()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_normal_mode_pair_agrees_within_the_measured_tolerance(fmt):
    cfg = FORMATS[fmt]
    inference, train = engine(cfg, deterministic=False), trainer(cfg, deterministic=False)
    try:
        train.train_step(rollout(inference, seed=0), token_mean_pg)
        build_sender(SyncConfig(quantize=cfg), engine=inference).send(train.named_parameters_for_sync(1 << 16), 1)
        if not cfg.quantize_activations:
            batch = rollout(inference, seed=1)
            diff = (train.forward_logprobs(batch).log_probs - batch.rollout_log_probs).abs()
            assert float(diff.max()) < NORMAL_TOL
            return
        # Activations quantized on both sides: a rounding-level difference before the quantizer can flip one FP8
        # code, and the tokens after it move. Measured over 12 rollouts, with prompts per row and shared: most
        # rollouts agree to ~4e-6, a few reach 5e-4 to 0.11 (up to 10% of their tokens above 1e-4). So: the
        # typical rollout within the tolerance, none beyond a flip's size.
        maxima, means = [], []
        for seed in range(1, 8):
            batch = rollout(inference, seed=seed)
            diff = (train.forward_logprobs(batch).log_probs - batch.rollout_log_probs).abs()[batch.loss_mask > 0]
            maxima.append(float(diff.max()))
            means.append(float(diff.mean()))
        assert statistics.median(maxima) < NORMAL_TOL, maxima
        assert max(maxima) < 0.5 and max(means) < 1e-2, (maxima, means)
    finally:
        inference.close()


def test_reference_model_is_quantized_like_the_policy():
    cfg = FORMATS["int4_sym"]
    train = trainer(cfg, deterministic=True, ref=RefConfig())
    inference = engine(cfg, deterministic=True)
    try:
        batch = rollout(inference, seed=0)
        assert torch.equal(train.forward_logprobs(batch, model="ref").log_probs, batch.rollout_log_probs)
    finally:
        inference.close()


def test_qat_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="qat and lora cannot be combined"):
        FSDPConfig(qat=QuantConfig(), lora=LoRAConfig())
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] matches no linear layer.*layers are: down_proj, gate_proj"):
        trainer(QuantConfig(target_modules=["q_proj", "qkv_proj"]), deterministic=False)
    with pytest.raises(ValueError, match="targets 'lm_head', the output projection"):
        trainer(QuantConfig(target_modules=["lm_head"], exclude_modules=[]), deterministic=False)
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] matches no linear layer"):
        engine(QuantConfig(target_modules=["qkv_proj"]), deterministic=False)
    parsed = from_dict(FSDPConfig, {"qat": {"format": "int4_sym", "group_size": 32}})
    assert parsed.qat == FORMATS["int4_sym"]


RECIPE = Path(__file__).parents[2] / "recipes" / "tiny" / "grpo-sync.yaml"


QUANT = "{format: int4_sym, group_size: 32}"


def _exact_run_config(*overrides: str) -> RunConfig:
    return load_config(RunConfig, RECIPE, [
        "reward.terms=[{name: 'tests.runtime.rewards:even_tokens'}]", "run.steps=2", f"model.name={MODEL.name}",
        "inference.torch.deterministic=true", "trainer.fsdp.deterministic=true", "algorithm.contract.expect=exact",
        f"trainer.fsdp.qat={QUANT}", *overrides,
    ])


@pytest.mark.parametrize("send", ["masters", "quantize_on_send"])
def test_grpo_loop_with_the_quantized_pair_keeps_the_exact_contract(tmp_path, send):
    """Two GRPO steps through `Run`: under the exact contract the loss trains on the rollout log-probs
    and a single differing bit would fail the step (``ContractViolation``)."""
    extra = [f"sync.quantize={QUANT}"] if send == "quantize_on_send" else []
    run = Run(_exact_run_config(f"inference.torch.quantization={QUANT}", *extra), tmp_path)
    assert run.contract.relation == "exact" and run.old_source == "rollout"
    run.train(close=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff/max"] == 0.0 and r["contract/violation/max"] == 0.0
        assert r["sync/version"] == r["step"] + 1
        if send == "quantize_on_send":
            assert r["sync/bytes"] < 0.7 * r["sync/bytes_unquantized"]  # embeddings and head stay fp32
    masters, held = master_weights(run.trainer), run.engine.named_weights()
    cfg = run.trainer.config.qat
    for name in _targets(run.trainer):
        assert torch.equal(held[name], fake_quantize_weight(masters[name], cfg)), name
    run.close()


def test_an_exact_run_with_only_the_trainer_quantized_fails_loudly(tmp_path):
    """The engine serves full-precision weights while the trainer fake-quantizes: the run must not
    train on mismatched log-probs. Today the first step's contract check catches it
    (``ContractViolation``); with the quantization in ``RunSettings`` start-up would (``ContractError``)."""
    with pytest.raises((ContractViolation, ContractError), match="exact contract broken|quantiz"):
        Run(_exact_run_config(), tmp_path).train()
