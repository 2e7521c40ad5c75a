"""Shared pieces of the quantized trainer/engine pair tests (also imported by the gloo workers)."""

from __future__ import annotations

import torch

from tandem.core.batch import TrainBatch
from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.core.sample import Sample
from tandem.engines.inference.torch import TorchEngine, TorchEngineConfig
from tandem.engines.training.fsdp import FSDPConfig, FSDPEngine, OptimizerConfig
from tandem.kernels import QuantConfig
from tandem.models import ModelConfig

MODEL = ModelConfig(name="tiny-qwen3")  # untied LM head: the head stays full precision on both sides
TEMPERATURE = 0.8
# Blocks and groups smaller than the tiny model's 32/64/128-wide matrices: several per weight.
FORMATS = {
    "fp8_block": QuantConfig(format="fp8_block", block_size=(32, 32)),
    "fp8_w8a8": QuantConfig(format="fp8_block", block_size=(32, 32), group_size=32, quantize_activations=True),
    "int4_sym": QuantConfig(format="int4_sym", group_size=32),
}


def engine(cfg: QuantConfig | None, *, deterministic: bool, model: ModelConfig = MODEL) -> TorchEngine:
    return TorchEngine(
        TorchEngineConfig(model=model, deterministic=deterministic, max_model_len=128, quantization=cfg)
    )


def trainer(cfg: QuantConfig | None, *, deterministic: bool, model: ModelConfig = MODEL, **kw) -> FSDPEngine:
    kw.setdefault("optimizer", OptimizerConfig(lr=1e-2))
    return FSDPEngine(
        FSDPConfig(model=model, deterministic=deterministic, temperature=TEMPERATURE, micro_batch_tokens=40,
                   qat=cfg, **kw)
    )


def rollout(inference: TorchEngine, seed: int) -> TrainBatch:
    """Three prompts x 2 samples of up to 12 tokens, with the engine's log-probs and random advantages."""
    g = torch.Generator().manual_seed(seed)
    requests = [
        GenerationRequest(
            prompt_token_ids=torch.randint(3, 500, (n,), generator=g).tolist(),
            sampling=SamplingParams(n=2, max_new_tokens=12, temperature=TEMPERATURE, seed=seed * 10 + i),
        )
        for i, n in enumerate([5, 9, 3])
    ]
    samples = []
    for result in inference.generate(requests):
        for c in result.completions:
            samples.append(Sample(tokens=result.prompt_token_ids + c.token_ids, response_length=len(c.token_ids),
                                  rollout_log_probs=c.log_probs, index=len(samples)))
    batch = TrainBatch.from_samples(samples)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def master_weights(train: FSDPEngine) -> dict[str, torch.Tensor]:
    """What `named_parameters_for_sync` yields (collective when sharded)."""
    return {n: t.detach().cpu().clone() for b in train.named_parameters_for_sync(1 << 30) for n, t in b}
