"""``tandem plan MODEL --gpus N --gpu-type H100 ...``: choose the engine pair, parallelism and placement for a
model on a cluster (or judge a given layout with ``--check``), print the memory and step-time estimate, and
write the recipe (``--write``). The model lives in ``tandem/plan/`` (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="hub id of a known architecture (Qwen/Qwen3-8B), a registry name, an HF "
                                            "folder or a config.json (omit with --check --recipe)")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpu-type", "--gpu", dest="gpu_type",
                    help="H100, H200, B200, A100, A100-40GB, H20, L40S, RTX4090, MI300X or cpu (default H100; with "
                         "--recipe, cpu when the recipe runs on the CPU)")
    hw.add_argument("--gpus", type=int, help="devices in all (cpu: trainer processes); default nodes x per node")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpus-per-node", type=int, help="default: the GPU type's (8; cpu 1)")
    hw.add_argument("--gpu-memory-gib", type=float, help="override the GPU type's memory")
    hw.add_argument("--link-gbps", type=float, help="override the intra-node GPU link, GB/s per direction")
    hw.add_argument("--internode-gbps", type=float, help="override the inter-node bandwidth per GPU, GB/s")
    hw.add_argument("--host-memory-gib", type=float, help="override the host memory per node (offload)")
    wl = p.add_argument_group("workload")
    wl.add_argument("--prompt-len", type=int, default=1024, help="max prompt tokens (default 1024)")
    wl.add_argument("--response-len", type=int, default=4096, help="max response tokens (default 4096)")
    wl.add_argument("--prompts", type=int, default=64, help="prompts per step (default 64)")
    wl.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    wl.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA rank (default 0: full fine-tuning)")
    wl.add_argument("--quantize-base", choices=["fp8_block", "mxfp8", "int4_sym", "int4_asym"],
                    help="QLoRA (with --lora): the frozen base's linear weights held in this format")
    wl.add_argument("--mode", choices=["sync", "one_step_off", "fully_async"], default="sync")
    wl.add_argument("--precision", choices=["bf16", "fp8", "int4"], default="bf16", help="rollout weights")
    wl.add_argument("--ref", action="store_true", help="keep a frozen reference model (KL)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument("--write", metavar="RECIPE.yaml", help="write the planned recipe")
    ck = p.add_argument_group("--check: judge a given layout instead of choosing one")
    ck.add_argument("--check", action="store_true")
    ck.add_argument("--recipe", help="take the layout (and workload) from a Tandem recipe")
    ck.add_argument("--trainer", choices=["fsdp", "megatron"], default="fsdp")
    for name in ("tp", "pp", "cp", "ep", "etp"):
        ck.add_argument(f"--{name}", type=int, default=1, help=f"trainer {name} (default 1)")
    ck.add_argument("--offload", action="store_true", help="trainer state (FSDP) / optimizer (Megatron) on the host")
    ck.add_argument("--activation-checkpointing", action="store_true")
    ck.add_argument("--hsdp-replicate", type=int, default=1, help="FSDP: HSDP replicas (default 1: plain FSDP)")
    ck.add_argument("--micro-batch-tokens", type=int, default=0, help="default: max(8192, one sequence)")
    ck.add_argument("--inference", choices=["torch", "vllm", "sglang"], help="default: torch on cpu, else vllm")
    ck.add_argument("--inference-tp", type=int, default=1)
    ck.add_argument("--inference-ep", type=int, default=0, help="default: the inference tp for an MoE")
    ck.add_argument("--replicas", type=int, default=0, help="default: rollout GPUs / inference tp")
    ck.add_argument("--mem-fraction", type=float, default=0.85, help="rollout engine's share of GPU memory")
    ck.add_argument("--placement", choices=["colocated", "disaggregated"], default="colocated")
    ck.add_argument("--train-gpus", type=int, help="disaggregated: GPUs of the trainer (the rest roll out)")


def _user_error(e: Exception):
    from tandem.config import ConfigError

    return ConfigError(str(e))


def _inputs(args):
    from tandem.plan.archs import resolve_arch
    from tandem.plan.hardware import device
    from tandem.plan.memory import Workload

    if args.recipe:
        from tandem.plan.check_recipe import apply_recipe

        apply_recipe(args)
    args.gpu_type = args.gpu_type or "H100"
    if not args.model:
        raise ValueError("name a model (or --check --recipe FILE)")
    for flag in ("prompt_len", "response_len", "prompts", "samples", "nodes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    dev = device(args.gpu_type, args.gpu_memory_gib)
    overrides = {"gpus_per_node": args.gpus_per_node, "link_gbps": args.link_gbps,
                 "internode_gbps": args.internode_gbps, "host_memory_gib": args.host_memory_gib}
    for key, value in overrides.items():
        if value is not None and value <= 0:
            raise ValueError(f"--{key.replace('_', '-')} {value} must be > 0")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        from dataclasses import replace

        dev = replace(dev, **overrides)
    gpus = args.gpus or args.nodes * dev.gpus_per_node
    arch = resolve_arch(args.model)
    wl = Workload(prompt_len=args.prompt_len, response_len=args.response_len, prompts=args.prompts,
                  samples=args.samples, lora_rank=args.lora, mode=args.mode, precision=args.precision, ref=args.ref,
                  quantize_base=args.quantize_base or "", shared_base=getattr(args, "shared_base", True))
    if wl.seq_len > arch.max_position:
        raise ValueError(f"--prompt-len + --response-len = {wl.seq_len} exceeds the model's context "
                         f"({arch.max_position} tokens)")
    return arch, dev, wl, gpus


def _checked(args, arch, dev, wl, gpus):
    from tandem.plan.memory import InferenceLayout, TrainerLayout
    from tandem.plan.planner import check

    engine = args.inference or ("torch" if dev.is_cpu else "vllm")
    tg = gpus if args.placement == "colocated" else (args.train_gpus or gpus - args.inference_tp)
    rg = gpus if args.placement == "colocated" else gpus - tg
    trainer = TrainerLayout(engine=args.trainer, gpus=tg, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                            etp=args.etp, offload=args.offload, activation_checkpointing=args.activation_checkpointing,
                            micro_batch_tokens=args.micro_batch_tokens or max(8192, wl.seq_len),
                            replicate=args.hsdp_replicate,
                            recompute_pointwise=getattr(args, "recompute_pointwise", True),
                            # a recipe's setting, else what Tandem's Megatron engine runs: SP with TP > 1, none with LoRA
                            sequence_parallel=getattr(args, "sequence_parallel", not args.lora))
    ep = args.inference_ep or (args.inference_tp if arch.moe else 1)
    replicas = args.replicas or max(1, rg // args.inference_tp)
    inference = InferenceLayout(engine=engine, tp=args.inference_tp, ep=ep, replicas=replicas,
                                mem_fraction=args.mem_fraction, max_num_seqs=-(-wl.sequences // replicas))
    return check(arch, dev, wl, gpus, trainer, inference, args.placement, tg)


def run(args: argparse.Namespace) -> int:
    from tandem.plan.planner import plan
    from tandem.plan.recipe import RecipeError, recipe_dict
    from tandem.plan.report import table

    try:
        arch, dev, wl, gpus = _inputs(args)
        result = _checked(args, arch, dev, wl, gpus) if args.check else plan(arch, dev, wl, gpus)
        recipe = recipe_dict(result, args.model) if args.write and result.fits else None
    except (ValueError, RecipeError) as e:
        raise _user_error(e) from None
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(table(result))
    if args.write:
        if recipe is None:
            print(f"tandem: not written: {args.write} (the layout does not fit)", file=sys.stderr)
            return 1
        import yaml

        with open(args.write, "w") as f:
            f.write(recipe_header(args, result, gpus))
            yaml.safe_dump(recipe, f, sort_keys=False)
        if not args.json:
            print(f"wrote {args.write}")
    return 0 if result.fits else 1


def command_line(args: argparse.Namespace, gpus: int) -> str:
    """The ``tandem plan`` command that reproduces ``args``: the cluster, lengths and batch always, every other
    flag when it differs from its default (``--write`` last)."""
    import shlex

    parser = argparse.ArgumentParser()
    configure(parser)
    always = {"gpu_type", "gpus", "prompt_len", "response_len", "prompts", "samples"} | ({"trainer"} if args.check else set())
    words = ["tandem", "plan", args.model]
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in ("help", "write", "json", "recipe"):
            continue
        value = gpus if dest == "gpus" else getattr(args, dest, action.default)
        if dest not in always and value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            words += [flag] if value else []
        else:
            words += [flag, str(value)]
    return shlex.join(words + ["--write", args.write])


def recipe_header(args: argparse.Namespace, result, gpus: int) -> str:
    """The comment lines on top of a written recipe: the cluster and workload it was planned for, the command
    that writes it again, and the planner's verdict."""
    dev, wl = result.device, result.workload
    nodes = -(-gpus // dev.gpus_per_node)
    where = f"process{'es' * (gpus > 1)} on this CPU" if dev.is_cpu else f"x {dev.name} ({dev.memory_gib:g} GiB)"
    tuning = f"LoRA rank {wl.lora_rank}" if wl.lora_rank else "full fine-tuning"
    tuning += f" on a {wl.quantize_base} base (QLoRA)" if wl.quantize_base else ""
    return (f"# planned for: {gpus} {where}, {nodes} node{'s' * (nodes > 1)}; prompt {wl.prompt_len} + response "
            f"{wl.response_len} tokens; {wl.prompts} prompts x {wl.samples} samples per step; {tuning}; {wl.mode}; "
            f"{'fp32 (CPU)' if dev.is_cpu else wl.precision} rollouts\n"
            f"# regenerate: {command_line(args, gpus)}\n"
            f"# {result.reason}\n")
