"""The step-time model: rollout (prefill FLOP-bound, decode bound by reading weights and KV), training
(FLOP-bound), weight sync (link-bound). Figures come from `hardware.DEVICES`; the efficiencies below are
assumptions (GPU) or calibrations against measured runs (CPU), listed in docs/plan.md.

* Training FLOPs per token: 6 x active matmul parameters (+ 2 more with activation checkpointing, + 2 for
  the old-log-prob forward, + 2 for a reference forward), attention 12 x layers x heads x head_dim x mean
  context, and the LM head only at response positions (Tandem projects nothing else).
* Prefill: 2 x active parameters per prompt token. Decode: per step, the larger of reading the replica's
  weights (experts: only those the batch routes to) and its FLOPs, plus reading the KV cache, plus a fixed
  per-step overhead. Every sample is assumed to run to the maximum response length (RL steps wait for the
  longest sample), in waves of at most the concurrency the KV budget allows.
* Sync: the model in bf16 (fp32 on a CPU) by the transport the written recipe uses (`sync_time`).
* Offload (`offload_time`): FSDP2's CPUOffloadPolicy copies a rank's weight shard to the GPU for each gathering
  pass of each micro-batch (old-log-prob forward, forward, backward) and its gradient shard back, at
  ``host_link`` x the PCIe figure, overlapped with compute like the collectives; the optimizer then steps on the
  host, not overlapped: AdamW reads and writes ~28 B per trainable parameter at an assumed ``host_adam_gbps``
  per GPU. Megatron's optimizer offload moves the gradient and parameter shards once a step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tandem.plan.archs import Arch
from tandem.plan.hardware import Device
from tandem.plan.memory import (
    InferenceLayout,
    TrainerLayout,
    Workload,
    kv_budget,
    quantized_base_params,
    trainer_memory,
    vocab_parallel,
)

__all__ = ["EFFICIENCY", "fsdp_comm_time", "offload_time", "rollout_time", "sync_time", "train_time"]

ADAM_BYTES = 28  # AdamW on the host: reads parameter, gradient and two moments (fp32), writes three

# fraction of the data-sheet figure reached (GPU: assumptions; CPU: calibrated, docs/plan.md)
EFFICIENCY = {
    "gpu": {"train_mfu_dense": 0.35, "train_mfu_moe": 0.2, "prefill_mfu": 0.5, "decode_bw": 0.7,
            "decode_step_overhead_s": 0.004, "host_link": 0.8, "host_adam_gbps": 20.0},
    "cpu": {"train_mfu_dense": 0.6, "train_mfu_moe": 0.3, "prefill_mfu": 0.85, "decode_bw": 1.0,
            "decode_step_overhead_s": 0.010},
}


def _eff(dev: Device) -> dict[str, float]:
    return EFFICIENCY["cpu" if dev.is_cpu else "gpu"]


def _attention_flops_per_token(arch: Arch, context: float) -> float:
    cache_layers = -(-arch.layers // arch.full_attention_every)
    return 4 * cache_layers * arch.heads * arch.head_dim * context  # QK^T and PV, forward


def train_time(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout, gpus: int) -> float:
    """Seconds of one training step (old log-probs + forward/backward + optimizer) on ``gpus`` devices."""
    tokens = wl.sequences * wl.seq_len
    passes = 3 + (1 if lay.activation_checkpointing else 0) + 1 + (1 if wl.ref else 0)  # in forward units
    if wl.lora_rank:
        passes -= 1  # no weight gradients for the frozen base
    body = 2 * arch.matmul_params_per_token() + _attention_flops_per_token(arch, wl.seq_len / 2)
    head = 2 * arch.vocab * arch.hidden * wl.sequences * wl.response_len
    flops = passes * (body * tokens + head)
    mfu = _eff(dev)["train_mfu_moe" if arch.moe else "train_mfu_dense"]
    bubble = 1.0 + (lay.pp - 1) / max(1, 4 * lay.pp)  # 1F1B with ~4 micro-batches per stage
    compute = flops / (gpus * dev.bf16_tflops * 1e12 * mfu) * bubble
    transfers, host_step = offload_time(arch, dev, wl, lay)
    return max(compute, fsdp_comm_time(arch, dev, wl, lay) + transfers) + host_step  # prefetch overlaps transfers


def offload_time(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> tuple[float, float]:
    """(seconds of host <-> GPU copies a step, seconds of the optimizer step on the host) on one rank; (0, 0)
    without offload. The bytes are the memory model's: the state `host_bytes` counts as offloaded."""
    if not lay.offload or dev.is_cpu:
        return 0.0, 0.0
    eff = _eff(dev)
    state = trainer_memory(arch, dev, wl, replace(lay, offload=False))  # the layout's state, as if on the GPU
    link = dev.host_link_gbps * 1e9 * eff["host_link"]
    if lay.engine == "megatron":  # the optimizer's shard: fp32 gradients down, bf16 parameters up, once a step
        shard = state["optimizer"] / 12
        return shard * (4 + 2) / link, shard * ADAM_BYTES / (eff["host_adam_gbps"] * 1e9)
    per_micro = 3 * state["weights"] + state["gradients"]
    trainable = state["optimizer"] / 8
    return _micro_batches(wl, lay) * per_micro / link, trainable * ADAM_BYTES / (eff["host_adam_gbps"] * 1e9)


def _micro_batches(wl: Workload, lay: TrainerLayout) -> int:
    """Micro-batches one rank runs a step (its share of the step's tokens, at least one sequence)."""
    return math.ceil(max(wl.seq_len, wl.sequences * wl.seq_len / lay.dp) / lay.micro_batch_tokens)


def fsdp_comm_time(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> float:
    """Seconds of FSDP collectives per step on one rank: per micro-batch an all-gather of the weights for the
    old-log-prob forward, the forward and the backward (compute dtype) and a reduce-scatter of fp32 gradients
    (none for a frozen LoRA base), over the shard group's link (NVLink within a node, the NIC beyond); HSDP adds
    one cross-node all-reduce of the gradient shard. A QLoRA base's quantized weights are on every rank: not
    gathered."""
    if lay.engine != "fsdp" or lay.shard <= 1 or dev.is_cpu:
        return 0.0
    p = arch.total_params()
    micro = _micro_batches(wl, lay)
    # vocab-parallel: the embedding / LM head are neither gathered nor reduce-scattered (the hidden states and
    # per-token statistics it exchanges instead are tokens x hidden: left out)
    sharded = p - (arch.embedding_params() if vocab_parallel(arch, dev, lay) else 0)
    gathered = sharded - (quantized_base_params(arch) if wl.quantize_base else 0)
    per_micro = gathered * 2 * 3 + (0 if wl.lora_rank else sharded * 4)
    frac = (lay.shard - 1) / lay.shard
    gbps = dev.link_gbps if lay.shard <= dev.gpus_per_node else dev.internode_gbps
    t = micro * per_micro * frac / (gbps * 1e9)
    if lay.replicate > 1 and not wl.lora_rank:
        t += 2 * p * 4 / lay.shard / (dev.internode_gbps * 1e9)
    return t


def _decode_step(arch: Arch, dev: Device, wl: Workload, inf: InferenceLayout, batch: int, context: float) -> float:
    eff = _eff(dev)
    wbytes = 4 if dev.is_cpu else {"bf16": 2, "fp8": 1, "int4": 0.5}[wl.precision]
    touched = min(1.0, batch * arch.top_k / arch.experts) if arch.moe else 1.0
    weight_bytes = (arch.dense_params() + arch.expert_params() * touched) * wbytes / inf.tp
    kv_bytes = batch * context * arch.kv_bytes_per_token(wbytes if dev.is_cpu else 2, inf.tp)
    flops = 2 * batch * (arch.active_params() + _attention_flops_per_token(arch, context) / 2) / inf.tp
    bw = dev.hbm_gbps * 1e9 * eff["decode_bw"]
    compute = flops / (dev.bf16_tflops * 1e12 * eff["prefill_mfu"])
    return max(weight_bytes / bw, compute) + kv_bytes / bw + eff["decode_step_overhead_s"]


def rollout_time(arch: Arch, dev: Device, wl: Workload, inf: InferenceLayout) -> tuple[float, int]:
    """(seconds to generate one step's samples, concurrent sequences per replica)."""
    per_replica = math.ceil(wl.sequences / inf.replicas)
    if inf.engine == "torch":
        concurrency = inf.max_num_seqs or per_replica
    else:
        concurrency = kv_budget(arch, dev, wl, inf)[2]
    concurrency = max(1, min(concurrency, per_replica))
    waves = math.ceil(per_replica / concurrency)
    eff = _eff(dev)
    prefill_flops = 2 * arch.active_params() * wl.prompt_len * concurrency / inf.tp
    prefill = prefill_flops / (dev.bf16_tflops * 1e12 * eff["prefill_mfu"])
    decode = wl.response_len * _decode_step(arch, dev, wl, inf, concurrency, wl.prompt_len + wl.response_len / 2)
    return waves * (prefill + decode), concurrency


HOST_PATH_GBPS = 20.0  # GPU -> host -> object store -> GPU, per node (the Ray transport's path)


def sync_time(arch: Arch, dev: Device, placement: str, train_gpus: int, rollout_gpus: int) -> float:
    """Seconds to move the trainer's weights into the rollout engines once, by the transport the written recipe
    uses: in-process on one device; on a CPU the Ray object store at the measured gloo-class rate; on GPUs the
    Ray object store through host memory (`HOST_PATH_GBPS` within a node, the NIC across nodes)."""
    nbytes = arch.total_params() * (4 if dev.is_cpu else 2)
    one_device = placement == "colocated" and train_gpus == 1
    if dev.is_cpu:
        gbps = dev.link_gbps if one_device else dev.internode_gbps
    elif one_device:
        gbps = dev.hbm_gbps / 2
    else:
        crosses = max(train_gpus, rollout_gpus if placement == "colocated" else train_gpus + rollout_gpus) \
            > dev.gpus_per_node
        gbps = min(dev.internode_gbps, HOST_PATH_GBPS) if crosses else HOST_PATH_GBPS
    return nbytes / (gbps * 1e9)
