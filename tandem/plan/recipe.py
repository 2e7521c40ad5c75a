"""Turn a `Plan` into a Tandem recipe (a plain dict; `tandem plan --write` dumps it as YAML).

Every key written here is a field of the run config (`tandem/runtime/config.py`) or of an engine's own config
class (`FSDPConfig`, `MegatronConfig`, `TorchEngineConfig`, `VLLMEngineConfig`); `tandem config` validates the
result, and a test does so for every reference plan. What a Tandem engine cannot express is refused here
with the reason instead of being written (SGLang when this Tandem's registry has no SGLang adapter; context
parallelism, which Tandem's Megatron engine lacks; Megatron for an architecture Tandem's native model
does not implement, since that model is what Tandem's Megatron engine builds).
"""

from __future__ import annotations

from typing import Any

from tandem.plan.memory import megatron_sequence_parallel
from tandem.plan.planner import Plan

__all__ = ["RecipeError", "recipe_dict"]


LORA_OPTIMIZER = {"lr": 1.0e-5, "grad_clip": 1.0}  # adapters train at a higher rate than full weights


class RecipeError(ValueError):
    """The plan names something no Tandem engine can run yet."""


def _trainer(p: Plan) -> dict[str, Any]:
    t, wl = p.trainer, p.workload
    opt = {"lr": 1.0e-6, "grad_clip": 1.0}
    if t.engine == "megatron":
        if not p.arch.native:
            raise RecipeError(
                f"Tandem's Megatron engine builds only the architectures of its native model (llama, qwen2, qwen3, "
                f"qwen3_moe), not {p.arch.family}; {p.arch.family} trains on FSDP (the HF model): judge a layout "
                "with --check --trainer fsdp (add --offload --activation-checkpointing for a large model)")
        if t.cp > 1:
            raise RecipeError(f"context parallelism (cp={t.cp}) is not in Tandem's Megatron engine yet "
                              "(docs/megatron.md); plan with a shorter --response-len or more GPUs")
        tc = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
            if t.activation_checkpointing else {}
        megatron: dict[str, Any] = {
            "parallel": {"tensor_parallel": t.tp, "pipeline_parallel": t.pp, "expert_parallel": t.ep,
                         "expert_tensor_parallel": t.etp, "sequence_parallel": megatron_sequence_parallel(wl, t),
                         "distributed_optimizer": True},
            "micro_batch_tokens": t.micro_batch_tokens, "optimizer": opt, "transformer_config": tc}
        if wl.lora_rank:  # megatron/lora.py: the local layer spec (TE's fuses the norm into the adapted layers)
            megatron |= {"lora": _lora(wl), "layer_spec": "local", "optimizer": dict(LORA_OPTIMIZER)}
        return {"engine": "megatron", "megatron": megatron}
    fsdp: dict[str, Any] = {"micro_batch_tokens": t.micro_batch_tokens, "optimizer": opt,
                            "parallel": {"activation_checkpointing": t.activation_checkpointing,
                                         "cpu_offload": t.offload, "replicate": t.replicate}}
    if not p.device.is_cpu:
        fsdp["parallel"] |= {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    if wl.lora_rank:
        fsdp["lora"] = _lora(wl)
        if wl.quantize_base:
            fsdp["lora"]["quantize_base"] = {"format": wl.quantize_base}
        fsdp["optimizer"] = dict(LORA_OPTIMIZER)
    return {"engine": "fsdp", "fsdp": fsdp}


def _lora(wl) -> dict[str, Any]:
    return {"rank": wl.lora_rank, "alpha": float(2 * wl.lora_rank),
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def _inference(p: Plan, model_name: str) -> dict[str, Any]:
    i, wl = p.inference, p.workload
    if i.engine == "sglang":
        return _sglang(p, model_name)
    if i.engine == "torch":
        section = {"max_num_seqs": max(1, i.max_num_seqs), "max_model_len": wl.seq_len}
        return {"engine": "torch", "replicas": i.replicas, "torch": section}
    if wl.precision == "int4":
        raise RecipeError("--precision int4 with vLLM needs an int4 checkpoint (vLLM cannot quantize to int4 on "
                          "load); Tandem's int4 QAT pairs with the embedded engine (inference.engine: torch)")
    kwargs: dict[str, Any] = {"tensor_parallel_size": i.tp, "gpu_memory_utilization": round(i.mem_fraction, 3),
                              "max_num_seqs": max(1, p.concurrency)}
    if i.ep > 1:
        kwargs["enable_expert_parallel"] = True
    if wl.precision == "fp8":
        kwargs["quantization"] = "fp8"
    section = {"model": {"name": model_name, "dtype": "bfloat16"}, "max_model_len": wl.seq_len,
               "engine_kwargs": kwargs}
    return {"engine": "vllm", "replicas": i.replicas, "vllm": section}


def _sglang(p: Plan, model_name: str) -> dict[str, Any]:
    from tandem.engines.registry import registry

    names = registry("inference").names()
    if "sglang" not in names:
        raise RecipeError(f"inference engine sglang is not in this Tandem's engine registry (inference engines: "
                          f"{', '.join(sorted(names))}); plan with --inference vllm")
    i, wl = p.inference, p.workload
    args: dict[str, Any] = {"tp_size": i.tp, "mem_fraction_static": round(i.mem_fraction, 3)}
    if i.ep > 1:
        args["ep_size"] = i.ep
    if wl.precision == "fp8":
        args["quantization"] = "fp8"
    section = {"model": {"name": model_name, "dtype": "bfloat16"}, "max_model_len": wl.seq_len, "server_args": args}
    return {"engine": "sglang", "replicas": i.replicas, "sglang": section}


def recipe_dict(p: Plan, model_name: str, *, steps: int = 100) -> dict[str, Any]:
    """A runnable recipe for plan ``p`` (GRPO on the synthetic arithmetic task: swap ``data`` for yours)."""
    if not p.fits:
        raise RecipeError(f"no recipe for a plan that does not fit ({p.reason})")
    wl, dev = p.workload, p.device
    recipe: dict[str, Any] = {
        "run": {"name": f"plan-{model_name.rsplit('/', 1)[-1].lower()}", "steps": steps, "seed": 0},
        "model": {"name": model_name, "dtype": "float32"},
        "data": {"source": "synthetic:arithmetic", "max_prompt_tokens": wl.prompt_len},
        "rollout": {"prompts_per_step": wl.prompts, "n_samples_per_prompt": wl.samples,
                    "sampling": {"temperature": 1.0, "max_new_tokens": wl.response_len}},
        "reward": {"terms": [{"name": "number"}]},
        "algorithm": {"advantage": {"estimator": "grpo"}},
        "trainer": _trainer(p),
        "inference": _inference(p, model_name),
        "runtime": {"mode": wl.mode, "placement": "colocated"},
    }
    if wl.mode != "sync":
        recipe["algorithm"]["off_policy"] = {"mode": "tis"}
    if wl.ref:  # the planner counted a reference model: a KL term in the loss needs one
        recipe["algorithm"]["kl"] = {"estimator": "k3", "placement": "loss", "coef": 0.001}
    multi = p.gpus > 1 or p.placement == "disaggregated"
    if multi:
        recipe["runtime"]["placement"] = "ray"
        ray: dict[str, Any] = {"trainer_ranks": p.train_gpus,
                               "layout": "colocated" if p.placement == "colocated" else "disaggregated"}
        if not dev.is_cpu and p.placement == "disaggregated":
            ray |= {"trainer_gpus": 1.0, "engine_gpus": float(p.inference.tp)}
        recipe["ray"] = ray
    if wl.lora_rank and p.inference.engine == "torch":
        recipe["sync"] = {"lora_mode": "adapter"}
    return recipe
