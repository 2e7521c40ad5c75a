"""Known-good RL layouts from peers' example scripts, and layouts reported to run out of memory.

Each row is what the source sets; fields the source leaves implicit are noted in `note`. Megatron-style
`offload` means the optimizer in host memory during training (slime's --optimizer-cpu-offload); verl's
param/grad/optimizer offload of its Megatron and FSDP workers moves state off the GPU between phases, which
is what the colocated placement assumes anyway, so it is not `offload` here. Prompt lengths the scripts do
not cap (slime's DAPO-math prompts) are taken as 1024 tokens. GPUs are H100-80GB where a script targets
"80GB" or 8xH100/H800 nodes. slime's --max-tokens-per-gpu counts tokens after the context-parallel split, so
the micro-batch here is that x cp.
"""

from __future__ import annotations

V = "https://github.com/volcengine/verl/blob/main/examples/grpo_trainer/"
S = "https://github.com/THUDM/slime/blob/main/scripts/"


def _row(source, model, gpu, gpus, trainer, inference, placement, lens, batch, **kw):
    engine, tp, pp, cp, ep, offload, ckpt, mbt = trainer
    ieng, itp, frac = inference
    return dict(source=source, model=model, gpu=gpu, gpus=gpus, trainer=engine, tp=tp, pp=pp, cp=cp, ep=ep,
                offload=offload, ckpt=ckpt, mbt=mbt, inference=ieng, inference_tp=itp, mem_fraction=frac,
                placement=placement, prompt_len=lens[0], response_len=lens[1], prompts=batch[0], samples=batch[1],
                **kw)


PUBLISHED = [
    _row(V + "run_qwen2-7b.sh", "Qwen/Qwen2-7B-Instruct", "H100", 8, ("fsdp", 1, 1, 1, 1, False, True, 16384),
         ("vllm", 2, 0.6), "colocated", (512, 512), (1024, 5), ref=True),
    _row(V + "run_deepseek7b_llm.sh", "deepseek-ai/deepseek-llm-7b-chat", "H100", 8,
         ("fsdp", 1, 1, 1, 1, False, True, 24576), ("vllm", 2, 0.4), "colocated", (512, 1024), (1024, 5), ref=True,
         note="gradient checkpointing: verl's default (model.enable_gradient_checkpointing); micro-batch 128 / 8 x 1536"),
    _row(V + "run_qwen3moe-30b_megatron.sh", "Qwen/Qwen3-30B-A3B", "H100", 32,
         ("megatron", 4, 2, 1, 4, False, True, 12288), ("vllm", 4, 0.6), "colocated", (1024, 2048), (64, 5), ref=True),
    _row(V + "run_deepseek671b_math_megatron_80gb.sh", "deepseek-ai/DeepSeek-V3", "H100", 256,
         ("megatron", 1, 16, 1, 16, False, True, 6144), ("vllm", 32, 0.6), "colocated", (2048, 4096), (512, 4)),
    _row(V + "run_qwen3-236b_megatron.sh", "Qwen/Qwen3-235B-A22B", "H20", 256,
         ("megatron", 4, 8, 1, 4, False, True, 6144), ("vllm", 8, 0.8), "colocated", (2048, 4096), (256, 4)),
    _row("https://github.com/NVIDIA-NeMo/RL/blob/main/examples/configs/grpo_math_8B.yaml",
         "meta-llama/Llama-3.1-8B-Instruct", "H100", 8, ("fsdp", 1, 1, 1, 1, False, False, 4096), ("vllm", 1, 0.6),
         "colocated", (512, 3584), (64, 32), note="max_total_sequence_length 4096 split as 512 + 3584"),
    _row(S + "run-qwen3-4B.sh", "Qwen/Qwen3-4B", "H100", 8, ("megatron", 2, 1, 1, 1, False, True, 9216),
         ("sglang", 2, 0.7), "colocated", (1024, 8192), (32, 8)),
    _row(S + "run-llama3.1-8B.sh", "meta-llama/Llama-3.1-8B-Instruct", "H100", 4,
         ("megatron", 2, 1, 1, 1, False, True, 9216), ("sglang", 1, 0.8), "colocated", (256, 1792), (64, 8)),
    _row(S + "run-qwen3-32B.sh", "Qwen/Qwen3-32B", "H100", 8, ("megatron", 8, 1, 1, 1, True, True, 20480),
         ("sglang", 8, 0.7), "colocated", (1024, 8192), (32, 8)),
    _row(S + "run-qwen3-30B-A3B.sh", "Qwen/Qwen3-30B-A3B", "H100", 8, ("megatron", 4, 1, 1, 8, True, True, 20480),
         ("sglang", 8, 0.7), "colocated", (1024, 8192), (8, 4)),
    _row(S + "run-qwen3-235B-A22B.sh", "Qwen/Qwen3-235B-A22B", "H100", 128,
         ("megatron", 4, 4, 2, 16, True, True, 32768), ("sglang", 32, 0.7), "disaggregated", (1024, 8192), (8, 8),
         train_gpus=64, precision="fp8", note="FP8 checkpoint served by SGLang; 64 train + 64 rollout GPUs"),
    _row(S + "run-glm4.5-355B-A32B.sh", "zai-org/GLM-4.5", "H100", 64, ("megatron", 8, 4, 2, 16, True, True, 32768),
         ("sglang", 32, 0.7), "colocated", (1024, 32768), (128, 8)),
    _row(S + "run-kimi-k2-Instruct.sh", "moonshotai/Kimi-K2-Instruct", "H200", 256,
         ("megatron", 8, 8, 4, 32, True, True, 65536), ("sglang", 16, 0.7), "colocated", (1024, 32768), (128, 8),
         precision="fp8", note="FP8 checkpoint; the GPU type is not stated: 1/16 of 1.03 TB of FP8 weights (64 GB) "
                               "cannot fit 0.7 x 80 GB, so a 141 GB H200 is assumed"),
    _row(S + "run-deepseek-r1.sh", "deepseek-ai/DeepSeek-R1", "H100", 128,
         ("megatron", 8, 4, 4, 32, True, True, 65536), ("sglang", 64, 0.7), "colocated", (1024, 32768), (128, 8),
         precision="fp8", note="DeepSeek-R1 checkpoint is FP8"),
    _row(S + "run-qwen3-4B.sh (4 GPUs: run-qwen3-4B_4xgpu.sh)", "Qwen/Qwen3-4B", "H100", 4,
         ("megatron", 2, 1, 1, 1, False, True, 9216), ("sglang", 2, 0.7), "colocated", (1024, 8192), (32, 8)),
]

# Reported out of memory; the planner must refuse the layout as reported.
OOM = [
    _row("https://github.com/THUDM/slime/issues/280 (235B on 32 GPUs without CPU Adam: 235 x 18 B / 32 = 132 GiB)",
         "Qwen/Qwen3-235B-A22B", "H100", 32, ("megatron", 4, 4, 1, 8, False, True, 16384), ("sglang", 32, 0.7),
         "colocated", (1024, 8192), (8, 8)),
    _row("https://github.com/tatsu-lab/stanford_alpaca/issues/56 (7B full fine-tuning, one A100-80GB)",
         "meta-llama/Llama-2-7b-hf", "A100", 1, ("fsdp", 1, 1, 1, 1, False, True, 2048), ("vllm", 1, 0.3),
         "colocated", (512, 512), (4, 1)),
    _row("https://github.com/thu-coai/BPO/issues/1 (7B full fine-tuning on a 24 GB GPU)", "meta-llama/Llama-2-7b-hf",
         "RTX4090", 1, ("fsdp", 1, 1, 1, 1, False, True, 2048), ("vllm", 1, 0.3), "colocated", (512, 512), (4, 1)),
    _row("https://github.com/SafeAILab/EAGLE/issues/260 (Qwen2.5-72B on one 80 GB GPU)", "Qwen/Qwen2.5-72B-Instruct",
         "A100", 1, ("fsdp", 1, 1, 1, 1, True, True, 4096), ("vllm", 1, 0.5), "colocated", (1024, 1024), (4, 1)),
    _row("https://github.com/meta-llama/llama-cookbook/issues/100 (7B full fine-tuning on one RTX 3090, 24 GB)",
         "meta-llama/Llama-2-7b-hf", "RTX4090", 1, ("fsdp", 1, 1, 1, 1, False, True, 1024), ("torch", 1, 1.0),
         "colocated", (256, 256), (1, 1)),
]
