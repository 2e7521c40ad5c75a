"""Worker functions of the Megatron multi-process tests (spawned by `helpers.run_workers`, gloo, world size 2).

One spawn runs every parallel layout in turn (each engine is closed before the next layout is set up)
and writes what the parent compares into ``out_dir/<name>_rank<r>.pt``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.engines.training.megatron import (
    LoRAConfig,
    MegatronConfig,
    MegatronEngine,
    MegatronParallelConfig,
    OptimizerConfig,
)
from tandem.models import ModelConfig

from ..training.helpers import GROUPED, NaNOnCall, make_batch, sync_weights, token_mean_pg

OPT = OptimizerConfig(lr=1e-3, eps=1e-4, grad_clip=1.0, weight_decay=0.01)  # eps: see test_fsdp_engine
LORA = LoRAConfig(rank=4, alpha=8.0, sync="adapter",
                  target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))

# name -> (model, parallel settings). Data-parallel cases split the rows, model-parallel ones share them.
CASES: dict[str, tuple[str, dict]] = {
    "tp2-qwen2": ("tiny-qwen2", {"tensor_parallel": 2}),
    "tp2-llama-tied": ("tiny-llama", {"tensor_parallel": 2}),
    "pp2-qwen3": ("tiny-qwen3", {"pipeline_parallel": 2}),
    "pp2-llama-tied": ("tiny-llama", {"pipeline_parallel": 2}),
    "pp2-qwen3-bf16": ("tiny-qwen3", {"pipeline_parallel": 2, "dtype": "bfloat16"}),
    "dp2-qwen3": ("tiny-qwen3", {}),
    "dp2-zero-qwen3": ("tiny-qwen3", {"distributed_optimizer": True}),
    "ep2-qwen3-moe": ("tiny-qwen3-moe", {"expert_parallel": 2}),
    # LoRA (megatron/lora.py): adapters sharded like their layers, summed over TP; the export is the adapters
    "tp2-qwen2-lora": ("tiny-qwen2", {"tensor_parallel": 2, "lora": True}),
    "pp2-llama-tied-lora": ("tiny-llama", {"pipeline_parallel": 2, "lora": True}),
    # prompts fed once (pipeline.py: pad_rows): block masks and per-token rotary positions on every layout
    "tp2-qwen2-shared": ("tiny-qwen2", {"tensor_parallel": 2, "shared": True}),
    "pp2-llama-tied-shared": ("tiny-llama", {"pipeline_parallel": 2, "shared": True}),
    "dp2-qwen3-shared": ("tiny-qwen3", {"shared": True}),
}
RESUMED = ("tp2-qwen2", "dp2-zero-qwen3", "tp2-qwen2-lora")


def config(model: str, dtype: str = "float32", lora: bool = False, shared: bool = False, **parallel) -> MegatronConfig:
    return MegatronConfig(
        model=ModelConfig(name=model, dtype=dtype),
        lora=LORA if lora else None,
        parallel=MegatronParallelConfig(**parallel),
        optimizer=OPT,
        micro_batch_tokens=20,  # several micro-batches per step
        vocab_divisible_by=96,  # 512 pads to 576 (TP 1) / 768 (TP 2): padded vocabulary columns exist
    )


def two_steps(engine: MegatronEngine, shared: bool = False) -> dict:
    """Metrics of two steps, the weights after them and the log-probs of this rank's rows. ``shared``: GRPO-like
    batches whose row pairs share a prompt (fed once: pipeline.py, `pad_rows`)."""
    first, second = (make_batch(GROUPED, seed=s, shared_prompts=True) if shared else make_batch(seed=s) for s in (0, 1))
    rows = engine.local_rows(first)
    m1 = engine.train_step(first.select(rows), token_mean_pg)
    m2 = engine.train_step(second.select(engine.local_rows(second)), token_mean_pg)
    logp = engine.forward_logprobs(first.select(rows), with_entropy=True)
    return {
        "metrics": [m1, m2],
        "weights": sync_weights(engine),
        "rows": rows,
        "logp": logp.log_probs,
        "entropy": logp.entropy,
    }


def resume(model: str, parallel: dict, ckpt_dir: Path) -> dict:
    """Save after two steps, train two more; a fresh engine loads the checkpoint and trains the same two."""
    lr_lambda = lambda step: 1.0 / (1 + step)  # noqa: E731
    tail = [make_batch(seed=s) for s in (2, 3)]
    straight = MegatronEngine(config(model, **parallel), lr_lambda=lr_lambda)
    for seed in (0, 1):
        batch = make_batch(seed=seed)
        straight.train_step(batch.select(straight.local_rows(batch)), token_mean_pg)
    straight.save(str(ckpt_dir))
    saved = sync_weights(straight)
    straight_tail = [straight.train_step(b.select(straight.local_rows(b)), token_mean_pg) for b in tail]
    straight_final = sync_weights(straight)
    straight.close()
    resumed = MegatronEngine(config(model, **parallel), lr_lambda=lr_lambda)
    resumed.load(str(ckpt_dir))
    loaded = {"weights": sync_weights(resumed), "step": resumed.step}
    resumed_tail = [resumed.train_step(b.select(resumed.local_rows(b)), token_mean_pg) for b in tail]
    out = {
        "saved": saved,
        "loaded": loaded,
        "straight_tail": straight_tail,
        "resumed_tail": resumed_tail,
        "straight_final": straight_final,
        "resumed_final": sync_weights(resumed),
    }
    resumed.close()
    return out


def nan_on_one_rank(rank: int) -> dict:
    engine = MegatronEngine(config("tiny-qwen3"))
    batch = make_batch()
    local = batch.select(engine.local_rows(batch))
    engine.train_step(local, token_mean_pg)
    before = sync_weights(engine)
    metrics = engine.train_step(local, NaNOnCall(k=0) if rank == 1 else token_mean_pg)
    out = {"before": before, "after": sync_weights(engine), "metrics": metrics}
    engine.close()
    return out


HEAD_VOCAB, HEAD_PADDED = 22, 24  # the real vocabulary and Megatron's padded one (12 rows per TP rank)


def head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [7, 8], weight [24, 8], targets [7], w_logp, w_ent)`` for the log-prob head's TP test; targets
    on both ranks' slices, the padded rows huge (they must not count)."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(7, 8, generator=g), torch.randn(HEAD_PADDED, 8, generator=g)
    weight[HEAD_VOCAB:] = 40.0
    targets = torch.tensor([0, 11, 12, 21, 5, 17, 3])
    return hidden, weight, targets, torch.randn(7, generator=g), torch.randn(7, generator=g)


class _GatherRows(torch.autograd.Function):
    """A sequence-parallel gather on gloo (Megatron's is CUDA-only): all-gather the rows forward; backward, the
    summed gradient's own rows (what its reduce-scatter gives)."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def head_tp(rank: int) -> dict:
    """`head_logprobs` over this rank's half of the vocabulary, chunks of 3 rows: with and without grad, and
    on hidden states gathered from row halves (sequence parallelism: the gather sums their gradient)."""
    import torch.distributed as dist

    from tandem.engines.training.megatron.logprobs import head_logprobs

    hidden, weight, targets, w_logp, w_ent = head_inputs()
    rows = HEAD_PADDED // 2
    kw = {"vocab_start": rank * rows, "vocab_size": HEAD_VOCAB, "temperature": 0.7, "group": dist.group.WORLD,
          "chunk": 3, "with_entropy": True}
    out: dict = {}
    for mode in ("tp", "sp"):
        h = (hidden if mode == "tp" else torch.cat([hidden, torch.zeros(1, 8)])[rank * 4 : rank * 4 + 4])
        h = h.clone().requires_grad_()
        local = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        head_in = h if mode == "tp" else _GatherRows.apply(h)[:7]
        logp, ent = head_logprobs(head_in, local, targets, **kw, sum_hidden_grad=mode == "tp")
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        out[mode] = {"logp": logp.detach(), "ent": ent.detach(), "g_hidden": h.grad, "g_weight": local.grad}
    with torch.no_grad():
        out["tp"]["plain"], _ = head_logprobs(hidden, weight[rank * rows : (rank + 1) * rows], targets,
                                              **{**kw, "with_entropy": False})
    return out


def all_layouts(rank: int, world: int, out_dir: str) -> None:
    torch.manual_seed(0)
    results: dict = {"head": head_tp(rank)}
    for name, (model, parallel) in CASES.items():
        engine = MegatronEngine(config(model, **parallel))
        results[name] = two_steps(engine, parallel.get("shared", False))
        results[name]["dp_size"] = engine.dp_size
        # what this rank trains (with LoRA: its shards of the adapters; the planner's `megatron_lora_params`)
        results[name]["trainable"] = sum(p.numel() for _, _, p in engine.params if p.requires_grad)
        engine.close()
    for name in RESUMED:
        model, parallel = CASES[name]
        results[f"resume-{name}"] = resume(model, parallel, Path(out_dir) / f"ckpt-{name}")
    results["nan"] = nan_on_one_rank(rank)
    engine = MegatronEngine(config("tiny-qwen3", tensor_parallel=2))
    try:  # TP peers must be handed the same rows
        engine.forward_logprobs(make_batch(seed=rank))
        results["peer_mismatch"] = None
    except ValueError as e:
        results["peer_mismatch"] = str(e)
    engine.close()
    results["build_errors"] = {}
    for name, (model, parallel) in {
        "sequence-parallel-on-cpu": ("tiny-qwen3", {"tensor_parallel": 2, "sequence_parallel": True}),
        "moe-tp2-without-sp": ("tiny-qwen3-moe", {"tensor_parallel": 2}),
    }.items():
        try:
            MegatronEngine(config(model, **parallel)).close()
            results["build_errors"][name] = None
        except ValueError as e:
            results["build_errors"][name] = str(e)
    torch.save(results, Path(out_dir) / f"layouts_rank{rank}.pt")
