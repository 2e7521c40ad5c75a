"""A Megatron-core ``GPTModel`` built from an HF folder, with the HF weights loaded into this rank's shards.

The architecture comes from the HF config through Tandem's own reading of it
(`tandem.models.transformer.TransformerArgs`), so Megatron models and the embedded engine agree on
what a checkpoint means. Settings that change numerics are chosen to follow HF: RMSNorm with the HF
epsilon, SwiGLU, softmax in fp32, no dropout, HF's rotary inverse frequencies (whatever the rope
type, as long as it does not rescale attention), and for Qwen3-MoE a softmax router whose top-k
weights are renormalised exactly when ``norm_topk_prob`` asks for it.

Weights are read tensor by tensor from the safetensors files (`HFCheckpoint`), so a rank only reads
what its shards need.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem.engines.training.megatron import convert
from tandem.engines.training.megatron.attention import use_sdpa
from tandem.engines.training.megatron.parallel import MegatronContext
from tandem.models.transformer import RotaryEmbedding, TransformerArgs, UnsupportedModelError

__all__ = ["BuiltModel", "HFCheckpoint", "build_model", "padded_vocab_size"]


class HFCheckpoint:
    """Lazy reader of an HF folder's safetensors (one file or an index of shards)."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        self._handles = {f.name: safe_open(str(f), framework="pt") for f in files}
        self._where = {k: name for name, h in self._handles.items() for k in h.keys()}  # noqa: SIM118

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint")
        return self._handles[self._where[name]].get_tensor(name)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's vocabulary padding: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def read_args(path: str | Path) -> TransformerArgs:
    from tandem.models.hf_config import read_hf_config

    return TransformerArgs.from_hf_config(read_hf_config(path))


def rope_inv_freq(args: TransformerArgs) -> torch.Tensor:
    """HF's rotary inverse frequencies ``[head_dim / 2]`` (float32); rope types that rescale attention are refused."""
    rope = RotaryEmbedding(args)
    if rope.attention_scaling != 1.0:
        raise UnsupportedModelError(
            f"{args.model_type}: a rope type with attention scaling {rope.attention_scaling} (e.g. YaRN) is "
            "not supported by the Megatron adapter"
        )
    return rope.inv_freq.float()


def transformer_config(
    args: TransformerArgs, *, dtype: torch.dtype, parallel: Any, deterministic: bool, extra: dict
):
    """Megatron's ``TransformerConfig`` for ``args`` (``parallel``: the engine's ParallelConfig)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=args.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=args.o_bias,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=False,  # HF weights overwrite every parameter right after
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # pipeline stages exchange micro-batches of varying length (MoE then needs the all-to-all
        # dispatcher, which uses CUDA streams; with one stage the all-gather dispatcher runs on CPU)
        variable_seq_lengths=parallel.pipeline_parallel > 1,
        moe_token_dispatcher_type="alltoall" if parallel.pipeline_parallel > 1 else "allgather",
        deterministic_mode=deterministic,
    )
    if args.moe_layers:
        kw.update(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_intermediate_size,
            moe_router_topk=args.num_experts_per_tok,
            # top-k of the logits then softmax over the k equals HF's renormalised top-k probabilities
            moe_router_pre_softmax=not args.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_layer_freq=[int(i in args.moe_layers) for i in range(args.num_layers)],
            moe_grouped_gemm=False,
        )
    kw.update(extra)
    return TransformerConfig(**kw)


def block_spec(config, *, transformer_engine: bool, attention: str = "sdpa"):
    """This stage's decoder-layer specs: Megatron's local modules or TransformerEngine's fused ones.

    Built per layer from the config, so ``moe_layer_freq`` decides which layers are MoE (a model with
    dense layers among MoE ones, e.g. Qwen3-MoE's ``mlp_only_layers``, gets both kinds). The local spec's
    core attention is `SDPAttention` (attention.py) unless ``attention == "megatron"``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=transformer_engine, normalization="RMSNorm")
    if not transformer_engine and attention == "sdpa":
        use_sdpa(spec)
    return spec


@dataclass(kw_only=True, slots=True)
class BuiltModel:
    """This rank's piece of the model and how its names map to the whole."""

    module: Any  # megatron GPTModel (this pipeline stage)
    args: TransformerArgs
    layout: convert.Layout
    rules: dict[str, convert.Rule]  # global Megatron name -> rule, every parameter of the whole model
    layer_offset: int
    expert_offset: int
    path: str
    full_shapes: dict[str, torch.Size]  # global Megatron name -> shape of the unsharded tensor

    def global_name(self, local: str) -> str:
        return convert.globalize(local, self.layer_offset, self.expert_offset)

    def local_params(self) -> Iterator[tuple[str, convert.Rule, torch.nn.Parameter]]:
        """``(global name, rule, parameter)`` of every parameter this rank holds."""
        for name, p in self.module.named_parameters():
            gname = self.global_name(name)
            if gname == "output_layer.weight" and self.layout.tie_word_embeddings:
                gname = "embedding.word_embeddings.weight"  # the last pipeline stage's copy
            yield gname, self.rules[gname], p


def build_model(
    path: str | Path,
    ctx: MegatronContext,
    *,
    dtype: torch.dtype,
    parallel: Any,
    transformer_engine: bool,
    deterministic: bool,
    vocab_divisible_by: int,
    extra_config: dict | None = None,
    attention: str = "sdpa",
) -> BuiltModel:
    """Build this rank's stage of the Megatron model for HF folder ``path`` and load its weights."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    args = read_args(path)
    if args.moe_layers and parallel.tensor_parallel > 1 and parallel.sequence_parallel is False:
        # Megatron's MoE layer with TP > 1 requires sequence parallelism.
        raise ValueError(
            f"{path}: a MoE model with tensor_parallel={parallel.tensor_parallel} needs sequence_parallel=True"
        )
    if args.moe_layers and args.num_experts % parallel.expert_parallel:
        raise ValueError(
            f"expert_parallel={parallel.expert_parallel} must divide num_experts={args.num_experts}"
        )
    if args.num_kv_heads % parallel.tensor_parallel:
        raise ValueError(
            f"tensor_parallel={parallel.tensor_parallel} must divide the {args.num_kv_heads} KV heads of {path}"
        )
    if args.num_layers % parallel.pipeline_parallel:
        raise ValueError(
            f"pipeline_parallel={parallel.pipeline_parallel} must divide the {args.num_layers} layers of {path}"
        )
    config = transformer_config(
        args, dtype=dtype, parallel=parallel, deterministic=deterministic, extra=dict(extra_config or {})
    )
    padded = padded_vocab_size(args.vocab_size, vocab_divisible_by, parallel.tensor_parallel)
    layout = convert.Layout.from_args(args, padded_vocab_size=padded, fused_norms=transformer_engine)
    module = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, transformer_engine=transformer_engine, attention=attention),
        vocab_size=padded,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ctx.first_stage,
        post_process=ctx.last_stage,
        parallel_output=True,
        # Tied embeddings over several stages: the last stage holds its own copy of the table, kept
        # equal by summing both gradients over Megatron's embedding group (grads.reduce_gradients),
        # which is what Megatron itself does; building it untied skips Megatron's set-up of that copy,
        # which moves it to CUDA.
        share_embeddings_and_output_weights=args.tie_word_embeddings and parallel.pipeline_parallel == 1,
        position_embedding_type="rope",
    )
    # HF's inverse frequencies replace the ones Megatron derived from its own rotary settings: one
    # source of truth for rope_theta and the rope scaling types
    module.rotary_pos_emb.inv_freq = rope_inv_freq(args)
    num_local_experts = args.num_experts // parallel.expert_parallel if args.moe_layers else 0
    ckpt = HFCheckpoint(path)
    built = BuiltModel(
        module=module,
        args=args,
        layout=layout,
        rules={r.megatron: r for r in convert.rules(layout)},
        layer_offset=get_transformer_layer_offset(config),
        expert_offset=ctx.ep_rank * num_local_experts,
        path=str(path),
        full_shapes=_full_shapes(layout, ckpt),
    )
    load_hf_weights(built, ckpt, ctx)
    if ctx.device.type == "cpu":
        from tandem.engines.training.megatron.cpu_shim import apply_cpu_shims

        apply_cpu_shims(module, ctx.device)
    else:
        module.to(ctx.device)
    return built


def _full_shapes(layout: convert.Layout, ckpt: HFCheckpoint) -> dict[str, torch.Size]:
    """Unsharded Megatron shapes, from the HF tensor shapes alone (conversion on meta tensors)."""
    shapes = {}
    for rule in convert.rules(layout):
        meta = {n: torch.empty(ckpt.shape(n), device="meta") for n in rule.hf}
        shapes[rule.megatron] = convert.to_megatron(rule, layout, meta).shape
    return shapes


def _tp_coords(rule: convert.Rule, ctx: MegatronContext) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that shards ``rule``'s parameter."""
    if rule.expert:
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ctx.tp_rank, ctx.tp_size


@torch.no_grad()
def load_hf_weights(built: BuiltModel, ckpt: HFCheckpoint, ctx: MegatronContext) -> None:
    """Copy every parameter of this rank from the HF checkpoint; every HF tensor must be used somewhere."""
    needed = {n for r in built.rules.values() for n in r.hf}
    present = ckpt.names()
    if built.args.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints still store the alias
    missing, unexpected = needed - present, present - needed
    if missing or unexpected:
        raise ValueError(
            f"{ckpt.path}: checkpoint does not match {built.args.model_type}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, rule, param in built.local_params():
        full = convert.to_megatron(rule, built.layout, {n: ckpt.get(n) for n in rule.hf})
        rank, size = _tp_coords(rule, ctx)
        local = convert.shard(rule, full, rank, size)
        if local.shape != param.shape:
            raise ValueError(
                f"{name}: converted shard {tuple(local.shape)} does not fit the parameter {tuple(param.shape)}"
            )
        param.copy_(local.to(param.dtype))


def hf_config_dict(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
