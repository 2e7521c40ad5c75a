"""True on-policy: the deterministic trainer reproduces the embedded engine's rollout log-probs exactly."""

from __future__ import annotations

import torch

from tandem.core.batch import TrainBatch
from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.core.sample import Sample
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig
from tandem.models import ModelConfig

from .helpers import token_mean_pg

MODEL = ModelConfig(name="tiny-qwen3")
TEMPERATURE = 0.8


def _rollout(engine: TorchEngine, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    requests = [
        GenerationRequest(
            prompt_token_ids=torch.randint(3, 500, (n,), generator=g).tolist(),
            sampling=SamplingParams(n=2, max_new_tokens=12, temperature=TEMPERATURE, seed=seed * 10 + i),
        )
        for i, n in enumerate([5, 9, 3])
    ]
    samples = []
    for result in engine.generate(requests):
        for c in result.completions:
            samples.append(
                Sample(
                    tokens=result.prompt_token_ids + c.token_ids,
                    response_length=len(c.token_ids),
                    rollout_log_probs=c.log_probs,
                    index=len(samples),
                )
            )
    batch = TrainBatch.from_samples(samples)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def test_deterministic_logprobs_equal_rollout_before_and_after_a_weight_sync():
    inference = TorchEngine(TorchEngineConfig(model=MODEL, deterministic=True, max_model_len=128))
    trainer = FSDPEngine(
        FSDPConfig(
            model=MODEL,
            deterministic=True,
            temperature=TEMPERATURE,
            micro_batch_tokens=40,
            optimizer=OptimizerConfig(lr=1e-2),
        )
    )
    try:
        batch = _rollout(inference, seed=0)
        assert torch.equal(trainer.forward_logprobs(batch).log_probs, batch.rollout_log_probs)
        trainer.train_step(batch, token_mean_pg)
        for bucket in trainer.named_parameters_for_sync(1 << 16):
            inference.update_weights(bucket, version=1)
        batch = _rollout(inference, seed=1)
        logp = trainer.forward_logprobs(batch).log_probs
        assert torch.equal(logp, batch.rollout_log_probs)
        # a row's log-probs do not depend on which rows share its micro-batch
        wide = FSDPEngine(FSDPConfig(model=MODEL, deterministic=True, temperature=TEMPERATURE))
        for bucket in trainer.named_parameters_for_sync(1 << 30):
            wide.policy.module.lm.load_state_dict(dict(bucket), strict=False)
        assert torch.equal(wide.forward_logprobs(batch).log_probs, logp)
    finally:
        inference.close()
