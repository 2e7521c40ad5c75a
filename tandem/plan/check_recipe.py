"""`tandem plan --check --recipe FILE`: read the layout and the workload a Tandem recipe describes."""

from __future__ import annotations

import argparse

__all__ = ["apply_recipe", "runs_on_cpu"]


def runs_on_cpu(cfg) -> bool:
    """Whether the recipe's run uses no GPU: its trainer set to ``device: cpu``, or its rollouts on the embedded
    engine on the CPU (that engine's default) while the trainer follows the machine (``auto``). A GPU trainer
    beside a CPU engine, or a vLLM/SGLang engine, is a GPU run."""
    tr, inf = cfg.trainer.config, cfg.inference.config
    trainer_device = getattr(tr, "device", "auto") if tr is not None else "auto"
    if trainer_device == "cpu":
        return True
    if trainer_device == "cuda" or cfg.inference.entry.name != "torch":
        return False
    return getattr(inf, "device", "cpu") == "cpu"


def apply_recipe(args: argparse.Namespace) -> None:
    """Fill ``args`` (the command's namespace) from the recipe: model, lengths, batch, LoRA, trainer and
    inference layouts, placement. Flags the recipe does not express keep their values."""
    from tandem.config import load_config
    from tandem.runtime.config import RunConfig
    from tandem.runtime.policy import shares_frozen_base

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
            args.shared_base = shares_frozen_base(cfg)  # as the run decides
            quant = tr.lora.quantize_base if tr.lora is not None else None
            args.quantize_base = quant.format if quant is not None else None
            args.hsdp_replicate = tr.parallel.replicate
            args.recompute_pointwise = tr.recompute_pointwise and tr.packing  # the native model's lean saving
        else:
            par = tr.parallel
            args.tp, args.pp, args.ep, args.etp = (par.tensor_parallel, par.pipeline_parallel, par.expert_parallel,
                                                    par.expert_tensor_parallel)
            args.activation_checkpointing = bool(tr.transformer_config.get("recompute_granularity"))
            args.lora = tr.lora.rank if tr.lora is not None else 0
            args.quantize_base = tr.lora.quantize_base.format if tr.lora is not None and tr.lora.quantize_base else None
            args.sequence_parallel = par.sequence_parallel
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
    if args.gpu_type is None and runs_on_cpu(cfg):
        args.gpu_type = "cpu"
    if cfg.runtime.placement == "separate":
        args.placement = "colocated"  # an engine process beside the trainer on the same device: same budget
