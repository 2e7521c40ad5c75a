"""`tandem plan --check --recipe FILE`: read the layout and the workload a Tandem recipe describes."""

from __future__ import annotations

import argparse

__all__ = ["apply_recipe"]


def apply_recipe(args: argparse.Namespace) -> None:
    """Fill ``args`` (the command's namespace) from the recipe: model, lengths, batch, LoRA, trainer and
    inference layouts, placement. Flags the recipe does not express keep their values."""
    from tandem.config import load_config
    from tandem.runtime.config import RunConfig

    cfg = load_config(RunConfig, args.recipe)
    args.model = args.model or cfg.model.name
    args.prompt_len = cfg.data.max_prompt_tokens
    args.response_len = cfg.rollout.sampling.max_new_tokens
    args.prompts, args.samples, args.mode = cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.runtime.mode
    tr = cfg.trainer.config
    args.trainer = cfg.trainer.entry.name
    if tr is not None:
        args.micro_batch_tokens = tr.micro_batch_tokens
        if args.trainer == "fsdp":
            args.activation_checkpointing = tr.parallel.activation_checkpointing
            args.offload = tr.parallel.cpu_offload
            args.lora = tr.lora.rank if tr.lora is not None else 0
            args.hsdp_replicate = tr.parallel.replicate
        else:
            par = tr.parallel
            args.tp, args.pp, args.ep, args.etp = (par.tensor_parallel, par.pipeline_parallel, par.expert_parallel,
                                                    par.expert_tensor_parallel)
            args.activation_checkpointing = bool(tr.transformer_config.get("recompute_granularity"))
    args.inference = cfg.inference.entry.name
    inf = cfg.inference.config
    if args.inference == "vllm" and inf is not None:
        args.inference_tp = int(inf.engine_kwargs.get("tensor_parallel_size", 1))
        args.mem_fraction = float(inf.engine_kwargs.get("gpu_memory_utilization", args.mem_fraction))
    args.replicas = cfg.inference.replicas
    if cfg.runtime.placement == "ray":
        ranks = cfg.ray.trainer_ranks
        if cfg.ray.layout == "disaggregated":
            args.placement, args.train_gpus = "disaggregated", ranks
            args.gpus = args.gpus or ranks + args.replicas * args.inference_tp
        else:
            args.gpus = args.gpus or ranks
    else:
        args.gpus = args.gpus or 1
    if cfg.runtime.placement == "separate":
        args.placement = "colocated"  # an engine process beside the trainer on the same device: same budget
