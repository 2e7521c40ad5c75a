"""Gloo worker of `test_quantized_pair_dist`: a QAT trainer on 2 ranks, one quantized engine per rank."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.engines.training.fsdp import OptimizerConfig
from tandem.sync import SyncConfig, build_sender
from tests.engines.quantized_helpers import FORMATS, engine, master_weights, rollout, trainer
from tests.engines.training.helpers import token_mean_pg

DIST_FORMATS = ("fp8_block", "int4_sym")
# No clipping: the sharded gradient norm may round differently from one process's, and the clip
# coefficient would then move every weight by an ulp.
OPTIMIZER = OptimizerConfig(lr=1e-2, grad_clip=0.0)


def step_and_sync(cfg, *, sharded: bool) -> dict:
    """Rollout, log-probs, a train step on the whole batch (every rank feeds the same rows, so the
    summed gradient equals one process's), a quantize-on-send sync, a second rollout."""
    inference, train = engine(cfg, deterministic=True), trainer(cfg, deterministic=True, optimizer=OPTIMIZER)
    try:
        assert train.ctx.sharded == sharded
        first = rollout(inference, seed=0)
        out = {"rollout0": first.rollout_log_probs, "train0": train.forward_logprobs(first).log_probs}
        train.train_step(first, token_mean_pg)
        build_sender(SyncConfig(quantize=cfg), engine=inference).send(train.named_parameters_for_sync(1 << 16), 1)
        second = rollout(inference, seed=1)
        out |= {"rollout1": second.rollout_log_probs, "train1": train.forward_logprobs(second).log_probs,
                "masters": master_weights(train), "engine": {k: v.clone() for k, v in inference.named_weights().items()}}
        return out
    finally:
        inference.close()


def pair_on_two_ranks(rank: int, world: int, out_dir: str) -> None:
    results = {fmt: step_and_sync(FORMATS[fmt], sharded=True) for fmt in DIST_FORMATS}
    torch.save(results, Path(out_dir) / f"pair_rank{rank}.pt")
