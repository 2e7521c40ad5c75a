"""Worker functions of the multi-process tests (spawned by `helpers.run_workers`, gloo, world size 2).

Each writes what the parent compares into ``out_dir/<name>_rank<r>.pt``. Several checks share one
spawn because starting the processes costs more than the checks.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tandem.core.batch import TrainBatch
from tandem.engines.training.common import split_for_data_parallel
from tandem.engines.training.fsdp import (
    CriticConfig,
    FSDPConfig,
    FSDPEngine,
    LoRAConfig,
    OptimizerConfig,
    ParallelConfig,
    RefConfig,
)
from tandem.engines.training.fsdp.vocab_parallel import VocabParallelEmbedding
from tandem.models import ModelConfig

from .helpers import (
    GROUPED,
    TINY,
    NaNOnCall,
    engine_grads,
    make_batch,
    sync_weights,
    token_mean_pg,
    value_mse,
)

OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)  # eps: see test_fsdp_engine
UNEVEN = [[0, 1, 2, 3, 4, 5], [6, 7]]  # rank 0 has more micro-batches: rank 1 runs stand-ins

# name -> (config overrides, row split or None for the balanced one)
CASES: dict[str, tuple[dict, list[list[int]] | None]] = {
    "packed-one-micro-batch": ({"micro_batch_tokens": 256}, None),
    "packed-micro-batches": ({"micro_batch_tokens": 20}, UNEVEN),
    "padded-micro-batches": ({"micro_batch_tokens": 20, "packing": False}, UNEVEN),
    "hsdp-replicate-2": ({"micro_batch_tokens": 20, "parallel": ParallelConfig(replicate=2)}, None),
    "activation-checkpointing": (
        {"micro_batch_tokens": 20, "parallel": ParallelConfig(activation_checkpointing=True)},
        None,
    ),
    "lora": ({"micro_batch_tokens": 20, "lora": LoRAConfig(rank=4, target_modules=("q_proj", "up_proj"))}, None),
    # a frozen reference model for KL, built (and read as it is sharded) beside the policy
    "reference": ({"micro_batch_tokens": 20, "ref": RefConfig()}, None),
    # the whole model loaded, then sharded (every other native case reads its weights as it shards them)
    "whole-load": ({"micro_batch_tokens": 20, "parallel": ParallelConfig(sharded_load=False)}, None),
    # GRPO-like batches whose groups share prompts, split as the engine splits them (groups kept on one rank)
    "shared-prompts": ({"micro_batch_tokens": 24}, "shared"),
}


def deferred_bytes(rank: int, shard_world: int, *, vectors: bool) -> int:
    """fp32 bytes of the tiny model's checkpoint a rank reads as it shards it: its rows (FSDP's and the
    vocabulary shard's split of dim 0: chunks of ceil(rows / world)) of every tensor of two or more dimensions,
    and of the vectors too where ``vectors`` (the HF model defers them as well)."""
    from tandem.models import resolve_model
    from tandem.models.safetensors_read import SafetensorsIndex

    index = SafetensorsIndex(sorted(resolve_model(TINY).glob("*.safetensors")))
    total = 0
    for name in index.names():
        shape = index.shape(name)
        if len(shape) >= 2 or vectors:
            chunk = -(-shape[0] // shard_world)
            rows = max(0, min(shape[0], (rank + 1) * chunk) - rank * chunk)
            total += 4 * rows * math.prod(shape[1:])
    return total


def case_batch(case: str, seed: int) -> TrainBatch:
    if case == "shared-prompts":
        return make_batch(GROUPED, seed=seed, shared_prompts=True)
    return make_batch(seed=seed)


def config(**overrides) -> FSDPConfig:
    overrides.setdefault("optimizer", OPT)
    return FSDPConfig(model=ModelConfig(name=TINY), **overrides)


def local_rows(batch: TrainBatch, rank: int, world: int, split: list[list[int]] | str | None) -> list[int]:
    if split == "shared":
        return split_for_data_parallel(batch, world, share_prompts=True)[rank]
    return (split or split_for_data_parallel(batch, world))[rank]


def two_steps(engine: FSDPEngine, rank: int, world: int, split, case: str = "") -> dict:
    """Gradients + metrics of step 1, weights after step 2, log-probs of this rank's rows."""
    first, second = case_batch(case, 0), case_batch(case, 1)
    rows = local_rows(first, rank, world, split)
    stats = engine._accumulate_gradients(first.select(rows), token_mean_pg)
    grads = engine_grads(engine)
    m1 = engine._finish_step(engine.policy, "policy", stats, 0.0)
    m2 = engine.train_step(second.select(local_rows(second, rank, world, split)), token_mean_pg)
    logp = engine.forward_logprobs(first.select(rows)).log_probs
    ref = engine.forward_logprobs(first.select(rows), model="ref").log_probs if engine.ref is not None else None
    embed = engine.policy.module.lm.model.embed_tokens
    return {"grads": grads, "metrics": [m1, m2], "weights": sync_weights(engine), "rows": rows, "logp": logp,
            "vocab_parallel": isinstance(embed, VocabParallelEmbedding), "deferred_bytes": engine.deferred_bytes,
            "ref_logp": ref}


def equivalence(rank: int, world: int, out_dir: str) -> None:
    results = {}
    for name, (overrides, split) in CASES.items():
        results[name] = two_steps(FSDPEngine(config(**overrides)), rank, world, split, name)
    # a NaN loss on rank 1 only: every rank skips, nothing moves
    engine = FSDPEngine(config(micro_batch_tokens=20))
    batch = make_batch()
    local = batch.select(local_rows(batch, rank, world, None))
    engine.train_step(local, token_mean_pg)
    before = sync_weights(engine)
    nan_metrics = engine.train_step(local, NaNOnCall(k=0) if rank == 1 else token_mean_pg)
    results["nan"] = {"before": before, "after": sync_weights(engine), "metrics": nan_metrics}
    # bf16 mixed precision trains (numbers differ from fp32 by design; checked for sanity only)
    engine = FSDPEngine(config(parallel=ParallelConfig(param_dtype="bfloat16", reduce_dtype="float32")))
    results["bf16"] = [engine.train_step(local, token_mean_pg) for _ in range(2)]
    torch.save(results, Path(out_dir) / f"equivalence_rank{rank}.pt")


def _resume_config() -> FSDPConfig:
    return config(micro_batch_tokens=24, critic=CriticConfig(optimizer=OptimizerConfig(lr=1e-3)))


def _steps(engine: FSDPEngine, rank: int, world: int, seeds) -> list[dict]:
    metrics = []
    for seed in seeds:
        batch = make_batch(seed=seed)
        batch.returns = batch.advantages.clone()
        local = batch.select(local_rows(batch, rank, world, None))
        metrics.append(engine.train_step(local, token_mean_pg))
        metrics.append(engine.train_step(local, value_mse, model="critic"))
    return metrics


def _full_optimizer_state(engine: FSDPEngine) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(engine.policy.module, engine.policy.optimizer, options=opts)


def train_save_continue(rank: int, world: int, out_dir: str, ckpt_dir: str) -> None:
    """Train 2 steps, save, train 2 more (policy and critic), recording what the resume must match."""
    engine = FSDPEngine(_resume_config(), lr_lambda=lambda s: 1.0 / (1 + s))
    _steps(engine, rank, world, [0, 1])
    engine.save(ckpt_dir)
    saved = {"weights": sync_weights(engine), "optim": _full_optimizer_state(engine)}
    tail = _steps(engine, rank, world, [2, 3])
    result = {"saved": saved, "tail": tail, "final": sync_weights(engine)}
    torch.save(result, Path(out_dir) / f"straight_rank{rank}.pt")


def load_continue(rank: int, world: int, out_dir: str, ckpt_dir: str) -> None:
    """A fresh process group: load the checkpoint, then train the same 2 steps."""
    engine = FSDPEngine(_resume_config(), lr_lambda=lambda s: 1.0 / (1 + s))
    engine.load(ckpt_dir)
    loaded = {"weights": sync_weights(engine), "optim": _full_optimizer_state(engine), "step": engine.step}
    tail = _steps(engine, rank, world, [2, 3])
    result = {"loaded": loaded, "tail": tail, "final": sync_weights(engine)}
    torch.save(result, Path(out_dir) / f"resumed_rank{rank}.pt")


def first_spawn(rank: int, world: int, out_dir: str, ckpt_dir: str) -> None:
    equivalence(rank, world, out_dir)
    train_save_continue(rank, world, out_dir, ckpt_dir)


def uneven_load(rank: int, world: int, out_dir: str) -> None:
    """World 3: tiny-llama's 32 / 64 / 128 / 512 rows split unevenly (11/11/10, ...), and tiny-deepseek-v3 on the HF
    fallback, whose 8 experts per layer (fused by transformers from per-expert tensors) split 3/3/2. The model read
    row by row as it is sharded against the model loaded whole and then sharded: their weights after loading and
    after one step, and what each rank read."""
    out = {}
    for model, extra in (("tiny-llama", {}), ("tiny-deepseek-v3", {"packing": False})):
        for name, on in (("read", True), ("whole", False)):
            engine = FSDPEngine(FSDPConfig(model=ModelConfig(name=model), optimizer=OPT, micro_batch_tokens=20,
                                           parallel=ParallelConfig(sharded_load=on), **extra))
            before = sync_weights(engine)
            batch = make_batch(seed=0)
            engine.train_step(batch.select(split_for_data_parallel(batch, world)[rank]), token_mean_pg)
            params = sum(p.numel() * p.element_size() for p in engine.policy.module.parameters())
            out[model, name] = {"before": before, "after": sync_weights(engine), "params": params,
                                "deferred_bytes": engine.deferred_bytes}
            engine.close()
    torch.save(out, Path(out_dir) / f"uneven_rank{rank}.pt")
