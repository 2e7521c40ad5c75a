"""The training-engine contract: protocol-level behaviour every `TrainingEngine` adapter must show.

A test module subclasses `TrainingEngineContract` (pytest collects the inherited tests) and provides a
module-scoped ``case`` fixture returning a `TrainingEngineCase`: how to build the adapter on a tiny
model, the `EngineInfo` fields it must report, and the tolerances measured for it. The oracle is the
HF transformers model of the same folder (same weights, float32). Tests that train build their own
engines (`TrainingEngineCase.new`); ``case.engine`` is one untrained engine shared by the read-only
tests. The fixture calls `TrainingEngineCase.close` at the end of the module (Megatron's parallel state
is process-global).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tandem.core.batch import TrainBatch, response_index
from tandem.core.protocols import EngineAsleepError, EngineClosedError, EngineInfo, TrainingEngine
from tandem.engines.training.common import plan_micro_batches
from tandem.models import load_model
from tests.engines.training.helpers import (
    EntropyBonusLoss,
    NaNOnCall,
    make_batch,
    max_abs_diff,
    sync_weights,
    token_mean_pg,
)

SMALL_MICRO_BATCH = 20  # tokens: several micro-batches for `make_batch()` (91 tokens)
ONE_MICRO_BATCH = 256  # tokens: the whole of `make_batch()` in one micro-batch


@dataclass
class TrainingEngineCase:
    build: Callable[..., Any]  # build(model=None, *, lr_lambda=None, **config overrides) -> a new engine
    model: str  # what build() trains by default: a registry name or HF folder (the HF oracle loads it)
    info: dict[str, Any]  # EngineInfo fields the default engine must report
    logprob_atol: float  # |engine log-prob - HF log-prob| (and entropy), measured per engine
    step_atol: float  # micro-batched vs one-micro-batch step: loss, grad norm (relative) and weights
    moe_model: str | None = "tiny-qwen3-moe"  # a MoE model the adapter can train (None: skip that test)
    _engines: list[Any] = field(default_factory=list)
    _shared: Any = None

    def new(self, model: str | None = None, **kw) -> Any:
        """A fresh engine (closed with the case)."""
        self._engines.append(self.build(model, **kw))
        return self._engines[-1]

    @property
    def engine(self) -> Any:
        """One default engine, never trained: for tests that only read."""
        if self._shared is None:
            self._shared = self.new()
        return self._shared

    def close(self) -> None:
        for e in self._engines:
            e.close()
        self._engines.clear()
        self._shared = None


def hf_response_logprobs_and_entropy(name: str, batch: TrainBatch, temperature: float = 1.0):
    """``[B, R]`` log-probs and entropies of ``log_softmax(logits / T)``: the HF model's padded forward."""
    hf = load_model(name)
    ids = batch.input_ids
    mask = (torch.arange(ids.shape[1])[None, :] < batch.seq_lengths[:, None]).long()
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits.float() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, L-1, V]
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    width = int(batch.loss_mask.shape[1])
    idx = response_index(batch.prompt_lengths, width).clamp(max=logp.shape[1] - 1)
    valid = torch.arange(width)[None, :] < batch.response_lengths[:, None]
    return logp.gather(1, idx) * valid, entropy.gather(1, idx) * valid, valid


def hf_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The HF model's weights by checkpoint name (a tied output head is the embedding, not a tensor)."""
    hf = load_model(name)
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


class TrainingEngineContract:
    """Inherited by one test class per training engine (see the module docstring)."""

    def test_satisfies_the_protocol_and_reports_its_info(self, case):
        engine = case.engine
        assert isinstance(engine, TrainingEngine)
        info = engine.info
        assert isinstance(info, EngineInfo) and engine.info == info  # constant
        reported = {k: getattr(info, k) for k in case.info}
        assert reported == case.info
        assert isinstance(info.version, str) and info.version
        assert engine.step == 0

    def test_info_names_the_moe_layers(self, case):
        if case.moe_model is None:
            pytest.skip("no MoE model for this engine")
        from transformers import AutoConfig

        from tandem.models import resolve_model
        from tandem.models.transformer import TransformerArgs

        args = TransformerArgs.from_hf_config(AutoConfig.from_pretrained(str(resolve_model(case.moe_model))))
        info = case.new(case.moe_model).info
        assert info.moe and info.moe_layers == tuple(args.moe_layers)
        assert not case.engine.info.moe

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_forward_logprobs_match_hf(self, case, temperature):
        engine = case.engine if temperature == 1.0 else case.new(temperature=temperature)
        assert engine.info.temperature == temperature
        batch = make_batch()
        out = engine.forward_logprobs(batch, with_entropy=True)
        logp, entropy, valid = hf_response_logprobs_and_entropy(case.model, batch, temperature)
        assert out.log_probs.shape == batch.loss_mask.shape and out.log_probs.dtype == torch.float32
        torch.testing.assert_close(out.log_probs, logp, rtol=0, atol=case.logprob_atol)
        torch.testing.assert_close(out.entropy, entropy, rtol=0, atol=case.logprob_atol)
        assert (out.log_probs[~valid] == 0).all() and (out.entropy[~valid] == 0).all()
        assert (out.entropy[valid] > 0).all()
        assert torch.equal(engine.forward_logprobs(batch).log_probs, out.log_probs)  # no grad, no state

    @pytest.mark.parametrize("loss_fn", [token_mean_pg, EntropyBonusLoss()], ids=["token-mean", "entropy"])
    def test_micro_batched_step_equals_one_micro_batch(self, case, loss_fn):
        batch = make_batch()
        assert len(plan_micro_batches(batch, SMALL_MICRO_BATCH)) > 2
        assert len(plan_micro_batches(batch, ONE_MICRO_BATCH)) == 1
        split = case.new(micro_batch_tokens=SMALL_MICRO_BATCH)
        whole = case.new(micro_batch_tokens=ONE_MICRO_BATCH)
        initial = sync_weights(whole)
        m_split, m_whole = split.train_step(batch, loss_fn), whole.train_step(batch, loss_fn)
        assert m_split["train/skipped_step"] == m_whole["train/skipped_step"] == 0.0
        assert abs(m_split["train/loss"] - m_whole["train/loss"]) < case.step_atol
        norm = m_whole["train/grad_norm"]
        assert abs(m_split["train/grad_norm"] - norm) < case.step_atol * norm
        # loss metrics reduce by convention: shares of ~80 log-probs of ~-6 are summed, /min is a min
        assert abs(m_split["pg/logp_mean"] - m_whole["pg/logp_mean"]) < 10 * case.step_atol
        assert abs(m_split["pg/logp/min"] - m_whole["pg/logp/min"]) < 10 * case.step_atol
        assert m_split["train/lr"] == m_whole["train/lr"] and m_split["train/tokens"] > 0
        weights = sync_weights(split)
        assert max_abs_diff(weights, sync_weights(whole)) < case.step_atol
        assert max_abs_diff(weights, initial) > 100 * case.step_atol  # the step did move the weights
        assert split.step == whole.step == 1

    def test_a_nan_loss_skips_the_step_and_leaves_the_state_untouched(self, case):
        batches = [make_batch(seed=s) for s in range(2)]
        engine, twin = (case.new(micro_batch_tokens=SMALL_MICRO_BATCH) for _ in range(2))
        for e in (engine, twin):
            e.train_step(batches[0], token_mean_pg)  # optimizer state exists now
        before = sync_weights(engine)
        metrics = engine.train_step(batches[1], NaNOnCall(k=1))  # the second micro-batch's loss is NaN
        assert metrics["train/skipped_step"] == 1.0 and math.isnan(metrics["train/loss"])
        assert max_abs_diff(sync_weights(engine), before) == 0.0
        assert engine.step == 2  # a skipped step still counts (the LR schedule advances on it)
        # the optimizer state is untouched too: the next step equals the twin's, which never saw the NaN
        ok = engine.train_step(batches[1], token_mean_pg)
        ref = twin.train_step(batches[1], token_mean_pg)
        assert ok["train/skipped_step"] == 0.0 and ok["train/loss"] == ref["train/loss"]
        assert max_abs_diff(sync_weights(engine), sync_weights(twin)) == 0.0

    def test_save_and_load_restore_weights_step_and_schedule(self, case, tmp_path):
        batches = [make_batch(seed=s) for s in range(3)]
        schedule = lambda step: 1.0 / (1 + step)  # noqa: E731
        straight = case.new(lr_lambda=schedule)
        for b in batches[:2]:
            straight.train_step(b, token_mean_pg)
        straight.save(str(tmp_path / "ckpt"))
        saved = sync_weights(straight)
        tail = straight.train_step(batches[2], token_mean_pg)
        resumed = case.new(lr_lambda=schedule)
        resumed.load(str(tmp_path / "ckpt"))
        assert resumed.step == 2 and max_abs_diff(sync_weights(resumed), saved) == 0.0
        again = resumed.train_step(batches[2], token_mean_pg)
        assert again["train/lr"] == tail["train/lr"] and again["train/loss"] == tail["train/loss"]
        assert max_abs_diff(sync_weights(resumed), sync_weights(straight)) == 0.0
        with pytest.raises(FileNotFoundError, match="not a complete Tandem checkpoint"):
            resumed.load(str(tmp_path / "nope"))

    def test_named_parameters_for_sync_are_the_hf_checkpoint(self, case):
        reference = hf_state_dict(case.model)
        bucket_bytes = 1 << 14
        buckets = list(case.engine.named_parameters_for_sync(bucket_bytes))
        names = [n for bucket in buckets for n, _ in bucket]
        assert len(names) == len(set(names)) and set(names) == set(reference)
        for bucket in buckets:
            assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= bucket_bytes
            for name, t in bucket:
                assert t.shape == reference[name].shape and t.dtype == reference[name].dtype, name
                assert torch.equal(t.cpu(), reference[name]), name  # untrained: the checkpoint's bits

    def test_sleep_and_wake_up_keep_the_weights(self, case):
        engine = case.engine
        batch = make_batch()
        before = engine.forward_logprobs(batch).log_probs
        engine.sleep()
        with pytest.raises(EngineAsleepError, match="call wake_up"):
            engine.forward_logprobs(batch)
        engine.wake_up()
        assert torch.equal(engine.forward_logprobs(batch).log_probs, before)

    def test_close_is_idempotent_and_final(self, case):
        engine = case.new()
        engine.close()
        engine.close()
        with pytest.raises(EngineClosedError):
            engine.forward_logprobs(make_batch())
        with pytest.raises(EngineClosedError):
            engine.train_step(make_batch(), token_mean_pg)
        with pytest.raises(EngineClosedError):
            next(iter(engine.named_parameters_for_sync(1 << 20)))
        assert case.engine.forward_logprobs(make_batch()).log_probs.abs().sum() > 0  # other engines live on


def info_fields(**fields: Any) -> dict[str, Any]:
    """``fields`` checked against `EngineInfo`'s field names (a typo fails here, not as a silent pass)."""
    known = {f.name for f in dataclasses.fields(EngineInfo)}
    unknown = sorted(set(fields) - known)
    assert not unknown, f"not EngineInfo fields: {unknown}"
    return fields
