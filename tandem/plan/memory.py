"""The memory model: bytes per GPU (or per process on a CPU), itemised, for the trainer and the rollout engine.

Assumptions (docs/plan.md has the derivations and the CPU calibration):

* FSDP2 (Tandem's engine): fp32 master weights, fp32 gradients and AdamW's two fp32 moments, sharded over
  the data-parallel ranks (16 B/param / dp; HSDP: / the shard group); with more than one rank the gathered root group (embeddings)
  and two gathered decoder layers in the compute dtype, and the root group's unsharded gradient; a native model
  on a 1-D mesh (`vocab_parallel`) gathers no embeddings and projects onto its vocabulary slice. LoRA: the
  frozen base in the compute dtype, sharded; adapters at 16 B/param. QLoRA (`Workload.quantize_base`): the
  targeted linear weights of the base held quantized (`BASE_BYTES` per weight, `quantized_base_params`), not
  sharded (FSDP does not shard the buffers that hold them), one layer's weight dequantized at a time. `offload`: FSDP2's CPUOffloadPolicy
  keeps the sharded state on the host.
* Megatron: bf16 weights, fp32 main gradients (6 B/param on the GPU, split by TP x PP, experts by EP x ETP x
  PP) and the fp32 master + Adam moments (12 B/param) sharded over the data-parallel group (distributed
  optimizer) or on the host (`offload`, as slime's --optimizer-cpu-offload). LoRA (dense models; megatron/lora.py):
  the frozen base in bf16 split by TP x PP, no gradients or optimizer state for it; the adapters at 2 + 4 B/param
  plus 12 / DP, sharded as the engine shards them (`megatron_lora_params`).
* Activations of one micro-batch: `Arch.activation_width()` elements per token per layer in the compute
  dtype, divided by TP (sequence parallel) and CP; Megatron without sequence parallelism (LoRA refuses it) keeps
  4 hidden-sized tensors replicated on every TP rank (the norms' inputs and outputs: Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", without the dropout masks RL turns off); with activation checkpointing, the layer inputs plus one
  layer recomputed. Pipeline stages keep `pp` micro-batches in flight (1F1B).
* Log-prob buffers: Tandem projects only response positions, `logprob_chunk` rows at a time (FSDP): chunk x
  vocab fp32 logits, softmax and gradient (3 buffers) plus two vocab x hidden fp32 buffers (the LM head's
  weight-gradient product and the embedding's dense gradient), measured on CPU. Megatron's head is
  vocab-parallel and chunked the same way (megatron/logprobs.py): the chunk's buffers x vocab / TP, plus
  its fp32 weight-gradient product, vocab / TP x hidden.
* Building the model (`load_host_bytes`, host memory per node, its ranks at once; checked against the node's
  host memory with the offloaded state): FSDP on a native model (or an HF one of `HF_ROWS_READ`) reads a rank's
  rows of its weights as it shards them (a rank's shards and nothing more), a native QLoRA base is quantized as
  it is read, other HF models load whole in fp32 on every rank first, Megatron reads its stage's slices.
* Rollout engines (vLLM / SGLang): weights split by TP (experts by EP), a fixed overhead (CUDA graphs,
  activations, communication buffers) and the KV cache in what `mem_fraction` of the GPU leaves.
* The embedded engine: a full copy of the weights in the model dtype (on a CPU: oneDNN-packed copies of the
  linear weights instead, the embedding and vocabulary projection plain too; `pack_weights`,
  `keep_plain_weights`), plus its preallocated KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tandem.plan.archs import Arch
from tandem.plan.hardware import GIB, Device

__all__ = ["BASE_BYTES", "InferenceLayout", "TrainerLayout", "Workload", "host_bytes", "inference_memory",
           "kv_budget", "load_host_bytes", "megatron_lora_params", "megatron_sequence_parallel", "quantized_base_params", "trainer_memory"]

GPU_TRAINER_OVERHEAD = 3.0 * GIB  # CUDA context, NCCL buffers, allocator slack
GPU_ENGINE_OVERHEAD = 4.0 * GIB  # vLLM / SGLang CUDA graphs, activations, communication buffers
GPU_ASLEEP_RESIDUAL = 1.5 * GIB  # what a sleeping side keeps on the GPU (context, small buffers)
CPU_PROCESS_BASE = 0.5 * GIB  # python + torch + transformers + tokenizer before the engines: measured 0.45 GiB in a
# long-used venv and ~0.55 GiB in a fresh one with the same packages (`make test` in a fresh clone; cause not found)
LOGPROB_CHUNK = 256  # FSDPConfig.logprob_chunk and MegatronConfig.logprob_chunk default
# bytes per weight of a QLoRA base (`tandem.kernels` formats, default block/group sizes, on a 1536 x 576 weight):
# FP8 codes + one fp32 scale per 128 x 128 block; MXFP8 + one e8m0 scale per 32; INT4 two per byte + an fp32 scale
# (and a uint8 zero point for asym) per group of 128 of a row
BASE_BYTES = {"fp8_block": 1.0003, "mxfp8": 1.03125, "int4_sym": 0.535, "int4_asym": 0.543}


@dataclass(kw_only=True, slots=True)
class Workload:
    prompt_len: int
    response_len: int
    prompts: int  # prompts per step
    samples: int  # samples per prompt
    lora_rank: int = 0  # 0: full fine-tuning
    mode: str = "sync"  # sync | one_step_off | fully_async
    precision: str = "bf16"  # rollout weights: bf16 | fp8 | int4
    ref: bool = False  # a frozen reference model for KL
    quantize_base: str = ""  # QLoRA: the base's linear weights in this format (BASE_BYTES); "": the compute dtype
    # LoRA in one CPU process: the engine serves the trainer's frozen tensors (colocated, sync.lora_mode adapter,
    # sync.share_frozen_base: what the planner's recipes write); False: it holds its own copy of the base
    shared_base: bool = True

    def __post_init__(self) -> None:
        if self.quantize_base and self.quantize_base not in BASE_BYTES:
            raise ValueError(f"quantize_base={self.quantize_base!r} is not one of {', '.join(BASE_BYTES)}")
        if self.quantize_base and not self.lora_rank:
            raise ValueError(f"quantize_base={self.quantize_base!r} needs a LoRA rank: it quantizes the frozen base of "
                             "a LoRA run (full fine-tuning trains every weight)")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples


@dataclass(kw_only=True, slots=True)
class TrainerLayout:
    engine: str = "fsdp"  # fsdp | megatron
    gpus: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    offload: bool = False
    activation_checkpointing: bool = False
    recompute_pointwise: bool = True  # FSDP: trainer.fsdp.recompute_pointwise (the native model keeps less)
    micro_batch_tokens: int = 8192
    replicate: int = 1  # FSDP: HSDP replicas (the state is sharded over gpus / replicate)
    # Megatron: activations outside attention / MLP split over TP (with TP > 1); LoRA runs without it
    # (`megatron_sequence_parallel`)
    sequence_parallel: bool = True

    @property
    def dp(self) -> int:
        return max(1, self.gpus // (self.tp * self.pp * self.cp))

    @property
    def shard(self) -> int:
        return max(1, self.dp // self.replicate)


@dataclass(kw_only=True, slots=True)
class InferenceLayout:
    engine: str = "vllm"  # torch | vllm | sglang
    tp: int = 1
    ep: int = 1
    replicas: int = 1
    mem_fraction: float = 0.85
    max_num_seqs: int = 0  # embedded engine: slots (0: as many as the workload has)
    extra: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas


def _dtype_bytes(dev: Device) -> int:
    return 4 if dev.is_cpu else 2  # the CPU recipes run fp32; GPU compute is bf16


def lora_params(arch: Arch, rank: int) -> int:
    """Adapter parameters of rank ``rank`` on every linear layer of attention and MLP (all experts not counted)."""
    h, q, kv = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    mlp = arch.intermediate if not arch.moe else arch.shared_intermediate
    per_layer = rank * ((h + q) * 2 + (h + kv) * 2 + (mlp and 3 * (h + mlp)))
    return arch.layers * per_layer


def megatron_lora_params(arch: Arch, rank: int, tp: int, pp: int = 1) -> int:
    """Adapter parameters one Megatron rank holds (megatron/lora.py): on the column-parallel layers (q/k/v, gate/up)
    ``A`` whole and ``B`` split over TP, on the row-parallel ones (o, down) ``A`` split and ``B`` whole; a stage's
    share of the layers. With ``tp = pp = 1`` this is `lora_params`."""
    h, q, kv, m = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.intermediate
    per_layer = rank * (7 * h + (2 * q + 2 * kv + 3 * m) / tp)
    return int(-(-arch.layers // pp) * per_layer)


def megatron_sequence_parallel(wl: Workload, lay: TrainerLayout) -> bool:
    """Whether a Megatron layout splits the activations outside attention and MLP over TP: with TP > 1 as asked,
    except with LoRA, which Tandem's Megatron engine runs without sequence parallelism (it refuses it)."""
    return lay.engine == "megatron" and lay.tp > 1 and lay.sequence_parallel and not wl.lora_rank


def quantized_base_params(arch: Arch) -> int:
    """Weights a QLoRA base holds quantized: the `nn.Linear` layers `tandem.kernels.DEFAULT_TARGETS` names (q, k,
    v, o and the dense and shared MLPs; MLA: o_proj, and q_proj without a q LoRA). Routed experts stay in the
    compute dtype (transformers holds them fused, not as linear layers), as do embeddings, norms and routers."""
    h, mlp_dense = arch.hidden, arch.first_dense if arch.moe else arch.layers
    if arch.mla:
        attn = arch.heads * arch.v_head_dim * h + (0 if arch.q_lora_rank else
                                                   h * arch.heads * (arch.qk_nope_dim + arch.qk_rope_dim))
    else:
        attn = arch.attention_params()
    return arch.layers * attn + mlp_dense * 3 * h * arch.intermediate + arch.moe_layers * 3 * h * arch.shared_intermediate


def _tokens_per_rank(wl: Workload, dp: int) -> int:
    return max(wl.seq_len, -(-wl.sequences * wl.seq_len // dp))


def activation_width(arch: Arch, lay: TrainerLayout) -> int:
    """Elements per token per layer a trainer keeps for backward: Tandem's FSDP engine on its native model with
    the pointwise outputs recomputed keeps `Arch.native_activation_width`; anything else the conservative count."""
    if lay.engine == "fsdp" and arch.native and lay.recompute_pointwise:  # (MoE, MLA: conservative there too)
        return arch.native_activation_width()
    return arch.activation_width()


def _activations(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> tuple[float, float]:
    """(activation bytes, micro-batch tokens) of the micro-batch in flight on one GPU."""
    tokens = min(lay.micro_batch_tokens, _tokens_per_rank(wl, lay.dp)) / lay.cp
    b = _dtype_bytes(dev)
    layers = -(-arch.layers // lay.pp)
    width = activation_width(arch, lay)
    split = lay.tp > 1 and lay.engine == "megatron" and not megatron_sequence_parallel(wl, lay)  # norms' whole
    per_layer = ((4 * arch.hidden + (width - 4 * arch.hidden) / lay.tp) if split else width / lay.tp) * tokens * b
    in_flight = min(lay.pp, max(1, _tokens_per_rank(wl, lay.dp) // max(1, lay.micro_batch_tokens)))
    if lay.activation_checkpointing:  # stored layer inputs per micro-batch in flight + one layer recomputed
        return in_flight * layers * tokens * arch.hidden * b / (1 if split else lay.tp) + per_layer, tokens
    return in_flight * layers * per_layer, tokens


# HF-fallback families whose checkpoints a sharded FSDP load reads by rows as the native model's are
# (fsdp/deferred.py; their MoE experts built from the per-expert tensors: fsdp/converted.py), tested on
# tiny-deepseek-v3 and tiny-glm4-moe. Any other HF model is counted whole per rank: transformers may convert its
# checkpoint in ways that load whole (regex renamings, quantized experts such as gpt-oss's MXFP4).
HF_ROWS_READ = frozenset({"deepseek_v3", "glm4_moe"})


def load_host_bytes(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> float:
    """Host memory one trainer rank takes while it builds its model, before its state is offloaded or trained
    (the recipes' ``model.dtype``: float32). FSDP at dp > 1 on a native model, or on an HF model of
    `HF_ROWS_READ`, reads its rows of each weight as it shards it (fsdp/deferred.py): its shards (the vectors
    read whole are left out: kilobytes); a native QLoRA base is quantized as it is read, in any world; other HF
    models load whole, then shard; Megatron reads its stage's slices tensor by tensor. 0 on a CPU device (its
    memory is the budget the trainer's items already count)."""
    if dev.is_cpu:
        return 0.0
    p = arch.total_params()
    if lay.engine == "megatron":
        return 4 * p / (lay.tp * lay.pp)
    if not arch.native and (wl.quantize_base or arch.family not in HF_ROWS_READ):
        return 4.0 * p
    if wl.quantize_base:  # quantized as read (any world): the base's bytes, the rest in fp32, one weight at a time
        q = quantized_base_params(arch)
        return q * BASE_BYTES[wl.quantize_base] + 4 * ((p - q) / lay.shard + _largest_quantized(arch))
    if lay.shard > 1:
        return 4 * p / lay.shard
    return 4.0 * p


def host_bytes(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> float:
    """Host memory one trainer GPU's offloaded state needs (0 without offload)."""
    if not lay.offload or dev.is_cpu:
        return 0.0
    if lay.engine == "megatron":
        state = _megatron_state(arch, dev, wl, replace(lay, offload=False))
        return state["optimizer"]
    return sum(_fsdp_state(arch, dev, wl, replace(lay, offload=False, gpus=lay.gpus)).get(k, 0.0)
               for k in ("weights", "gradients", "optimizer"))


def vocab_parallel(arch: Arch, dev: Device, lay: TrainerLayout) -> bool:
    """Whether the FSDP engine uses the embedding and LM head shard by shard over the vocabulary, never gathered
    (`parallel.vocab_parallel`, fsdp/vocab_parallel.py): a native model on a 1-D mesh of > 1 ranks, not offloaded."""
    return (lay.engine == "fsdp" and lay.shard > 1 and lay.replicate == 1 and arch.native
            and not (lay.offload and not dev.is_cpu))


def _logprob_buffers(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout, tokens: float) -> float:
    response_rows = tokens * wl.response_len / wl.seq_len
    if lay.engine == "megatron":
        return (min(LOGPROB_CHUNK, response_rows) * 4 * 3 + arch.hidden * 4) * arch.vocab / lay.tp
    if vocab_parallel(arch, dev, lay):  # every rank's rows projected onto this rank's slice of the vocabulary
        rows = min(LOGPROB_CHUNK, response_rows * lay.shard)
        return (rows * 4 * 3 + 2 * arch.hidden * 4) * arch.vocab / lay.shard
    rows = min(LOGPROB_CHUNK, response_rows)
    return rows * arch.vocab * 4 * 3 + 2 * arch.vocab * arch.hidden * 4


def _largest_quantized(arch: Arch) -> int:
    """Elements of the largest quantized linear weight (what one dequantization materialises)."""
    mlp = max(arch.intermediate if (not arch.moe or arch.first_dense) else 0, arch.shared_intermediate)
    return arch.hidden * max(mlp, arch.heads * max(arch.head_dim, arch.v_head_dim))


def _fsdp_state(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> dict[str, float]:
    p, b, dp = arch.total_params(), _dtype_bytes(dev), lay.shard
    items: dict[str, float] = {}
    if wl.lora_rank:
        lp = lora_params(arch, wl.lora_rank)
        q = quantized_base_params(arch) if wl.quantize_base else 0
        items["weights"] = (p - q) * b / dp + lp * 4 / dp
        if q:  # held by every rank, one layer's weight dequantized at a time (forward, and again in backward)
            items["quantized_base"] = q * BASE_BYTES[wl.quantize_base]
            items["dequantized"] = _largest_quantized(arch) * b
        items["gradients"] = lp * 4 / dp
        items["optimizer"] = lp * 8 / dp
    else:
        items["weights"] = p * 4 / dp
        items["gradients"] = p * 4 / dp
        items["optimizer"] = p * 8 / dp
    if lay.offload and not dev.is_cpu:  # a QLoRA base's buffers are not in the offloaded (sharded) state
        items = {k: (v if k in ("quantized_base", "dequantized") else 0.0) for k, v in items.items()}
    if dp > 1:
        layer = (arch.total_params() - arch.embedding_params()) / arch.layers
        root = 0 if vocab_parallel(arch, dev, lay) else arch.embedding_params()  # vocab-parallel: never gathered
        if wl.quantize_base:  # the quantized weights are not sharded, so not gathered
            layer -= quantized_base_params(arch) / arch.layers
        items["gathered"] = (root + 2 * layer) * b + (0 if wl.lora_rank else root * 4)
    if wl.ref and not wl.lora_rank:
        items["reference"] = p * b / dp
    return items


def _megatron_state(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> dict[str, float]:
    """bf16 on GPUs: 2 B weights, 4 B gradients, 12 B master + moments; fp32 on a CPU (Tandem's CPU recipes): 4 B
    weights, 4 B gradients and 8 B of moments (an fp32 parameter is its own master, megatron/optim.py)."""
    b = _dtype_bytes(dev)
    opt_b = 12 if b == 2 else 8
    emb_table = arch.vocab * arch.hidden
    body = (arch.dense_params() - arch.embedding_params()) / (lay.tp * lay.pp)
    dense = body + emb_table / lay.tp  # an end stage holds one table (first: embedding, last: LM head)
    experts = arch.expert_params() / (lay.ep * lay.etp * lay.pp)
    dense_dp = max(1, lay.gpus // (lay.tp * lay.pp))  # distributed optimizer shards over DP x CP
    expert_dp = max(1, lay.gpus // (lay.ep * lay.etp * lay.pp))
    if wl.lora_rank:  # the base frozen (no gradients, no optimizer state); the adapters train (dense models)
        adapters = megatron_lora_params(arch, wl.lora_rank, lay.tp, lay.pp)
        return {"weights": b * (dense + experts + adapters), "gradients": 4 * adapters,
                "optimizer": 0.0 if lay.offload else opt_b * adapters / dense_dp}  # the reference is the base
    opt = 0.0 if lay.offload else opt_b * (dense / dense_dp + experts / expert_dp)
    items = {"weights": b * (dense + experts), "gradients": 4 * (dense + experts), "optimizer": opt}
    if wl.ref:
        items["reference"] = b * (dense + experts)
    return items


def trainer_memory(arch: Arch, dev: Device, wl: Workload, lay: TrainerLayout) -> dict[str, float]:
    """Itemised peak bytes on one trainer GPU (one process on a CPU) during a training step."""
    if lay.engine == "megatron":
        items = _megatron_state(arch, dev, wl, lay)
    else:
        items = _fsdp_state(arch, dev, wl, lay)
    act, tokens = _activations(arch, dev, wl, lay)
    items["activations"] = act
    items["logprob_buffers"] = _logprob_buffers(arch, dev, wl, lay, tokens)
    items["overhead"] = CPU_PROCESS_BASE if dev.is_cpu else GPU_TRAINER_OVERHEAD
    return items


def _weight_bytes(wl: Workload, dev: Device) -> float:
    if dev.is_cpu:
        return 4
    return {"bf16": 2, "fp8": 1, "int4": 0.5}[wl.precision]


def kv_budget(arch: Arch, dev: Device, wl: Workload, inf: InferenceLayout) -> tuple[float, float, int]:
    """(weight bytes per GPU, KV-cache bytes per GPU, concurrent sequences per replica) of a vLLM/SGLang replica."""
    wb = _weight_bytes(wl, dev)
    expert_split = inf.ep if inf.ep > 1 else inf.tp  # without expert parallelism TP splits every expert
    weights = (arch.dense_params() / inf.tp + arch.expert_params() / expert_split) * wb
    kv = inf.mem_fraction * dev.memory_gib * GIB - weights - GPU_ENGINE_OVERHEAD
    per_seq = arch.kv_bytes_per_token(2, inf.tp) * wl.seq_len
    return weights, kv, max(0, int(kv // per_seq)) if kv > 0 else 0


def inference_memory(arch: Arch, dev: Device, wl: Workload, inf: InferenceLayout) -> dict[str, float]:
    """Itemised bytes on one rollout GPU (or, for the embedded engine on a CPU, in the process)."""
    if inf.engine == "torch":
        b = _dtype_bytes(dev)
        weights = arch.total_params() * b
        slots = inf.max_num_seqs or wl.sequences
        slot_len = -(-wl.seq_len // 64) * 64
        kv = slots * slot_len * arch.kv_bytes_per_token(b)
        step = slots * arch.vocab * 4 * 2 + slots * arch.activation_width() * b  # logits + one layer's activations
        items = {"weights": weights, "kv_cache": kv, "activations": step}
        if dev.is_cpu:
            packed = (arch.total_params() - (0 if arch.tied else arch.vocab * arch.hidden)) * b
            items["packed_weights"] = packed
            # the decoder layers' packed weights keep no plain copy (inference.torch.keep_plain_weights: false);
            # the vocabulary projection (and the embedding) stay plain
            items["weights"] = weights - (packed - arch.vocab * arch.hidden * b)
        else:
            items["overhead"] = GPU_ASLEEP_RESIDUAL
        return items
    weights, kv, _ = kv_budget(arch, dev, wl, inf)
    return {"weights": weights, "kv_cache": max(0.0, kv), "overhead": GPU_ENGINE_OVERHEAD}
