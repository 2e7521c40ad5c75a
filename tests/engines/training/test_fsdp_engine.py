"""FSDPEngine in one process against independent references on tiny models (fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.core.protocols import TrainingEngine
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig, RefConfig
from tandem.models import ModelConfig, load_model

from .helpers import (
    TINY,
    EntropyBonusLoss,
    NaNOnCall,
    engine_grads,
    global_scale,
    hf_response_logprobs,
    make_batch,
    max_abs_diff,
    seq_mean_pg,
    strip,
    sync_weights,
    token_mean_pg,
)

# AdamW's first update is lr * g / (|g| + eps): with the usual eps = 1e-8 a gradient entry of ~1e-9,
# whose last bits differ between two correct summation orders, moves its weight by a different share of
# lr. eps = 1e-4 keeps the update a smooth function of the gradient, so 1e-6 tolerances on the weights
# test the engine's gradients and optimizer, not rounding noise amplified 1e5 times.
OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)


def _engine(name: str = TINY, **kw) -> FSDPEngine:
    kw.setdefault("optimizer", OPT)
    kw.setdefault("micro_batch_tokens", 32)
    return FSDPEngine(FSDPConfig(model=ModelConfig(name=name), **kw))


def _reference_step(name, batch, loss_fn, opt: OptimizerConfig):
    """Full-batch HF forward + backward, clipping and torch AdamW: loss, grads, grad norm, weights."""
    hf = load_model(name).train()
    lp = hf_response_logprobs(hf, batch)
    from tandem.core.protocols import LogProbOutput

    loss, _ = loss_fn(LogProbOutput(log_probs=lp), batch, global_scale(batch))
    loss.backward()
    params = dict(hf.named_parameters())
    grads = {n: p.grad.clone() for n, p in params.items()}
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), opt.grad_clip)
    torch.optim.AdamW(hf.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay).step()
    return float(loss.detach()), grads, float(norm), {n: p.detach().clone() for n, p in params.items()}


def test_satisfies_protocol_and_logprobs_match_hf():
    engine = _engine(micro_batch_tokens=24)
    assert isinstance(engine, TrainingEngine)
    batch = make_batch()
    out = engine.forward_logprobs(batch, with_entropy=True)
    with torch.no_grad():
        hf = load_model(TINY)
        ref = hf_response_logprobs(hf, batch)
    assert out.log_probs.shape == batch.loss_mask.shape
    assert (out.log_probs - ref).abs().max() < 1e-5
    valid = torch.arange(batch.loss_mask.shape[1])[None, :] < batch.response_lengths[:, None]
    assert (out.log_probs[~valid] == 0).all() and (out.entropy[~valid] == 0).all()
    assert (out.entropy[valid] > 0).all()
    # temperature scales the logits like the sampler does
    hot = _engine(temperature=0.7).forward_logprobs(batch)
    with torch.no_grad():
        assert (hot.log_probs - hf_response_logprobs(hf, batch, 0.7)).abs().max() < 1e-5


@pytest.mark.parametrize("loss_fn", [token_mean_pg, seq_mean_pg], ids=["token-mean", "seq-mean"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_micro_batched_step_equals_full_batch_reference(loss_fn, packing):
    batch = make_batch()
    engine = _engine(packing=packing, micro_batch_tokens=20)  # several micro-batches
    stats = engine._accumulate_gradients(batch, loss_fn)
    grads = engine_grads(engine)
    ref_loss, ref_grads, ref_norm, ref_weights = _reference_step(TINY, batch, loss_fn, OPT)
    assert abs(stats.loss - ref_loss) < 1e-6
    assert max_abs_diff(grads, ref_grads) < 1e-6
    metrics = engine._finish_step(engine.policy, "policy", stats, 0.0)
    assert abs(metrics["train/grad_norm"] - ref_norm) < 1e-6
    assert metrics["train/skipped_step"] == 0.0 and metrics["train/lr"] == OPT.lr
    assert abs(metrics["pg/loss"] - ref_loss) < 1e-6  # metric shares sum to the global value
    weights = {strip(n): p.detach() for n, p in engine.policy.module.named_parameters()}
    assert max_abs_diff(weights, ref_weights) < 1e-6


def test_packed_and_padded_give_the_same_step():
    batch = make_batch(seed=3)
    results = []
    for packing in (True, False):
        engine = _engine(packing=packing, micro_batch_tokens=40)
        metrics = [engine.train_step(batch, token_mean_pg) for _ in range(2)]
        results.append((metrics, sync_weights(engine)))
    (m_packed, w_packed), (m_padded, w_padded) = results
    for a, b in zip(m_packed, m_padded, strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-6
        # a norm of ~7 in fp32 (ulp 4.8e-7) summed over differently laid-out tokens: relative tolerance
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-6 * max(1.0, abs(b["train/grad_norm"]))
    assert m_packed[0]["train/tokens"] < m_padded[0]["train/tokens"]  # padding is fed too
    assert max_abs_diff(w_packed, w_padded) < 1e-6


def test_nan_loss_skips_the_step_and_leaves_state_untouched():
    batch = make_batch()
    engine = _engine(micro_batch_tokens=20)
    engine.train_step(batch, token_mean_pg)  # optimizer state exists now
    before = sync_weights(engine)
    adam_before = {k: v.clone() for k, v in engine.policy.optimizer.state_dict()["state"][0].items()}
    metrics = engine.train_step(batch, NaNOnCall(k=1))
    assert metrics["train/skipped_step"] == 1.0
    assert math.isnan(metrics["train/loss"])
    assert max_abs_diff(sync_weights(engine), before) == 0.0
    adam_after = engine.policy.optimizer.state_dict()["state"][0]
    assert all(torch.equal(adam_before[k], adam_after[k]) for k in adam_before)
    assert engine.step == 2
    ok = engine.train_step(batch, token_mean_pg)
    assert ok["train/skipped_step"] == 0.0 and math.isfinite(ok["train/grad_norm"])


def test_metrics_reduce_by_convention_and_entropy_reaches_the_loss():
    batch = make_batch()
    whole = _engine(micro_batch_tokens=200).train_step(batch, token_mean_pg)
    split = _engine(micro_batch_tokens=20).train_step(batch, token_mean_pg)
    assert abs(whole["pg/logp_mean"] - split["pg/logp_mean"]) < 1e-6  # summed shares
    assert abs(whole["pg/logp/min"] - split["pg/logp/min"]) < 1e-6  # a min, not a sum
    with_ent = _engine(micro_batch_tokens=20).train_step(batch, EntropyBonusLoss())
    assert with_ent["entropy"] > 0
    assert with_ent["train/loss"] < whole["train/loss"]  # the bonus lowers the loss


def test_lr_schedule_follows_lr_lambda():
    engine = FSDPEngine(
        FSDPConfig(model=ModelConfig(name=TINY), optimizer=OPT), lr_lambda=lambda step: 1.0 / (step + 1)
    )
    batch = make_batch()
    lrs = [engine.train_step(batch, token_mean_pg)["train/lr"] for _ in range(3)]
    assert lrs == pytest.approx([OPT.lr, OPT.lr / 2, OPT.lr / 3])


def test_reference_model_is_frozen_initial_policy():
    batch = make_batch()
    engine = _engine(ref=RefConfig())
    before = engine.forward_logprobs(batch).log_probs
    assert torch.equal(engine.forward_logprobs(batch, model="ref").log_probs, before)
    for _ in range(2):
        engine.train_step(batch, token_mean_pg)
    assert not torch.allclose(engine.forward_logprobs(batch).log_probs, before)
    assert torch.equal(engine.forward_logprobs(batch, model="ref").log_probs, before)
    with pytest.raises(ValueError, match="no critic"):
        engine.forward_logprobs(batch, model="critic")


def test_sleep_and_wake_up_keep_training_identical():
    batch = make_batch()
    a, b = _engine(), _engine()
    a.train_step(batch, token_mean_pg)
    b.train_step(batch, token_mean_pg)
    b.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        b.forward_logprobs(batch)
    b.wake_up()
    a.train_step(batch, token_mean_pg)
    b.train_step(batch, token_mean_pg)
    assert max_abs_diff(sync_weights(a), sync_weights(b)) == 0.0


def test_bad_input_names_the_value_and_the_limit():
    batch = make_batch()
    engine = _engine(micro_batch_tokens=12)
    with pytest.raises(ValueError, match=r"row 1 has 15 tokens, more than micro_batch_tokens=12"):
        engine.forward_logprobs(batch)
    long = make_batch([(600, 500)])
    with pytest.raises(ValueError, match=r"1100 tokens, more than the model context \(max_position_embeddings=1024\)"):
        _engine(micro_batch_tokens=4096).train_step(long, token_mean_pg)
    with pytest.raises(ValueError, match=r"micro_batch_tokens=0 must be >= 1"):
        FSDPConfig(model=ModelConfig(name=TINY), micro_batch_tokens=0)
    with pytest.raises(ValueError, match="routing_replay=True needs a native MoE model"):
        _engine(routing_replay=True)


def test_config_loads_from_a_recipe_mapping():
    from tandem.config import ConfigError, from_dict

    cfg = from_dict(
        FSDPConfig,
        {
            "model": {"name": TINY},
            "optimizer": {"lr": 1e-5, "betas": [0.9, 0.95]},
            "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
            "parallel": {"replicate": 1, "param_dtype": "bfloat16"},
        },
    )
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.lora.target_modules == ("q_proj", "v_proj")
    with pytest.raises(ConfigError, match=r"lora.rank=0 must be >= 1"):
        from_dict(FSDPConfig, {"lora": {"rank": 0}})
    with pytest.raises(ValueError, match="FSDPConfig.model is not set"):
        FSDPEngine(FSDPConfig())


def test_single_process_mixed_precision_runs_the_forward_in_bf16():
    from tandem.engines.training.fsdp import ParallelConfig

    batch = make_batch()
    fp32 = _engine().forward_logprobs(batch).log_probs
    engine = _engine(parallel=ParallelConfig(param_dtype="bfloat16"))
    bf16 = engine.forward_logprobs(batch).log_probs
    diff = (bf16 - fp32).abs().max()
    assert 0 < diff < 0.5  # bf16 rounding, not a different model
    assert engine.policy.params[0].dtype == torch.float32  # master weights stay fp32
    metrics = engine.train_step(batch, token_mean_pg)
    assert metrics["train/skipped_step"] == 0.0 and math.isfinite(metrics["train/loss"])
