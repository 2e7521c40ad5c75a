"""The modules the engine shards: a policy (log-probs) and a critic (values) around a causal LM.

Each is the FSDP root of its model, so its forward runs inside the root's all-gather: the LM head's
weight is whole when the log-probs are computed. The LM sits under the attribute ``lm``; its own
parameter names are HF checkpoint names, so ``lm.`` + HF name is every parameter's name here.

Two kinds of LM:

* **native** (tandem/models/transformer.py): packed micro-batches, varlen attention, R3 replay.
* **hf**: any ``AutoModelForCausalLM`` (the padded fallback for architectures the native code does
  not cover, or ``packing = False``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tandem.engines.training.common import MicroBatch
from tandem.engines.training.fsdp.deferred import DeferredWeights, deferred_names, hf_on_meta
from tandem.engines.training.fsdp.vocab_parallel import VocabParallelEmbedding, vocab_parallel_logprobs
from tandem.kernels.config import QuantConfig
from tandem.kernels.qat import apply_qat, qat_targets
from tandem.models.attention import MoERouting
from tandem.models.logprobs import TiedGrad, token_logprobs
from tandem.models.registry import ModelConfig, quiet_transformers, resolve_model
from tandem.models.safetensors_read import SafetensorsIndex
from tandem.models.transformer import CausalLM, UnsupportedModelError
from tandem.ops.batch_invariant import packed_attention

log = logging.getLogger(__name__)

__all__ = ["CriticModel", "LoadedLM", "PolicyModel", "apply_quantization", "check_native_needs", "decoder_layers", "load_lm",
           "output_module_name"]


@dataclass(kw_only=True, slots=True)
class LoadedLM:
    lm: nn.Module
    native: bool
    path: str  # the resolved HF folder
    max_context: int | None
    moe_layers: tuple[int, ...] = ()
    # the matrices left on the meta device, read module by module as the model is sharded (fsdp/deferred.py)
    deferred: DeferredWeights | None = None


def load_lm(cfg: ModelConfig, *, packing: bool, deferred: bool = False) -> LoadedLM:
    """Load ``cfg``'s model: the native implementation when ``packing`` and supported, else HF's.
    ``deferred``: the native model's matrices (an HF model's parameters, where its checkpoint names them as
    the model does) stay on the meta device for `DeferredWeights`."""
    path = resolve_model(cfg.name)
    if packing:
        try:
            later = None
            if deferred:
                index = SafetensorsIndex(sorted(path.glob("*.safetensors")))
                lm = CausalLM.from_pretrained(path, dtype=cfg.torch_dtype, unallocated=deferred_names(index))
                later = DeferredWeights(path, index)
            else:
                lm = CausalLM.from_pretrained(path, dtype=cfg.torch_dtype)
            args = lm.args
            return LoadedLM(
                lm=lm, native=True, path=str(path), max_context=args.max_position_embeddings,
                moe_layers=tuple(args.moe_layers), deferred=later,
            )
        except UnsupportedModelError as e:
            log.warning("%s: %s; using the HF model with padded micro-batches", cfg.name, e)
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    built = hf_on_meta(path, cfg.torch_dtype, cfg.attn_implementation) if deferred else None
    if built is not None:
        lm, later = built
    else:
        later = None
        lm = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=cfg.torch_dtype, attn_implementation=cfg.attn_implementation
        )
    head = lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None or getattr(lm.config, "final_logit_softcapping", None):
        raise UnsupportedModelError(
            f"{cfg.name}: an LM head with a bias or logit soft-capping is not supported by the padded path"
        )
    ctx = getattr(lm.config, "max_position_embeddings", None) or getattr(lm.config, "n_positions", None)
    return LoadedLM(lm=lm, native=False, path=str(path), max_context=ctx, deferred=later)


def check_native_needs(cfg, loaded: LoadedLM) -> None:
    """Raise ValueError for an `FSDPConfig` setting that needs the native model ``loaded`` is not."""
    if cfg.routing_replay and not (loaded.native and loaded.moe_layers):
        raise ValueError(
            f"routing_replay=True needs a native MoE model; {cfg.model.name} is "
            f"{'a dense model' if loaded.native else 'served by the HF fallback'}"
        )
    if cfg.deterministic and not loaded.native:
        raise ValueError(
            f"deterministic=True needs the native packed model; {cfg.model.name} runs on the HF "
            "fallback (packing=False or an unsupported architecture)"
        )


def apply_quantization(loaded: LoadedLM, cfg: QuantConfig) -> list[str]:
    """QAT on the LM's targeted linears, in place; call before sharding. Returns their names.

    The output projection cannot be a target: log-probs read its weight directly, not through the
    module's forward. Raises ValueError for it and for a target pattern that matches nothing.
    """
    lm = loaded.lm
    qat_targets(lm, cfg, output_module=output_module_name(loaded))
    return apply_qat(lm, cfg)


def output_module_name(loaded: LoadedLM) -> str | None:
    """The module name of the LM's output projection (never a quantization target)."""
    lm = loaded.lm
    head = lm.lm_head if loaded.native else lm.get_output_embeddings()
    return next((name for name, m in lm.named_modules() if m is head), None)


def decoder_layers(lm: nn.Module, native: bool) -> list[nn.Module]:
    """The per-layer modules to shard (and checkpoint) one by one."""
    if native:
        return list(lm.model.layers)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        raise UnsupportedModelError(f"{type(lm).__name__}: cannot find its decoder layers to shard")
    return layers


def _hidden(lm: nn.Module, native: bool, mb: MicroBatch, routing: MoERouting | None,
            tied_grad: TiedGrad | None = None) -> torch.Tensor:
    """Final-norm hidden states of every fed token, flattened ``[N or b*L, H]``."""
    if native:  # invariant attention inside batch_invariant_mode (deterministic), varlen SDPA outside
        return lm(mb.input_ids, mb.positions, packed_attention(mb.cu_seqlens, mb.layout), routing, tied_grad=tied_grad)
    out = lm.base_model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.positions, use_cache=False
    )
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


class PolicyModel(nn.Module):
    """Root module of a policy or reference model: micro-batch in, response-token log-probs out."""

    def __init__(self, loaded: LoadedLM) -> None:
        super().__init__()
        self.lm = loaded.lm
        self.native = loaded.native
        self.moe_layers = loaded.moe_layers  # R3 replays routing in these layers

    def output_weight(self) -> torch.Tensor:
        return self.lm.lm_head.weight if self.native else self.lm.get_output_embeddings().weight

    def forward(
        self,
        mb: MicroBatch,
        *,
        temperature: float,
        with_entropy: bool,
        chunk: int,
        routing: MoERouting | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs [M], entropy [M] | None)`` float32 at the micro-batch's response tokens.

        Only the ``M`` predicting positions go through the vocabulary projection (prompt positions
        would be wasted work), chunk by chunk with a recomputing backward (models/logprobs.py).
        """
        if self.native and isinstance(self.lm.model.embed_tokens, VocabParallelEmbedding):
            return self._vocab_parallel(mb, temperature, with_entropy, chunk, routing)
        tied = self.lm.tied_grad_slot() if self.native else None  # one dense gradient of a tied embedding
        hidden = _hidden(self.lm, self.native, mb, routing, tied)
        return token_logprobs(
            hidden[mb.select],
            self.output_weight(),
            mb.targets,
            temperature=temperature,
            chunk_size=chunk,
            with_entropy=with_entropy,
            tied_grad=tied,
        )

    def _vocab_parallel(
        self, mb: MicroBatch, temperature: float, with_entropy: bool, chunk: int, routing: MoERouting | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with the embedding and the projection sharded by vocabulary (fsdp/vocab_parallel.py)."""
        embed = self.lm.model.embed_tokens
        head = self.lm.lm_head.weight  # tied: the embedding's parameter (both add into its .grad)
        hidden = _hidden(self.lm, True, mb, routing)
        return vocab_parallel_logprobs(
            hidden[mb.select],
            embed.local_weight(head),
            mb.targets,
            embed.shard,
            temperature=temperature,
            chunk_size=chunk,
            with_entropy=with_entropy,
            grad_into=head,
        )


class CriticModel(nn.Module):
    """Root module of a value model: the LM's hidden states through a linear head ``[H] -> [1]``."""

    def __init__(self, loaded: LoadedLM) -> None:
        super().__init__()
        lm = loaded.lm
        # The vocabulary projection is unused by a critic; dropping it saves its gather and grads.
        if loaded.native:
            lm.lm_head = nn.Identity()
        else:
            lm.set_output_embeddings(nn.Identity())
        self.lm = lm
        self.native = loaded.native
        self.moe_layers = loaded.moe_layers
        hidden = lm.args.hidden_size if loaded.native else lm.config.hidden_size
        dtype = next(lm.parameters()).dtype
        self.value_head = nn.Linear(hidden, 1, dtype=dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb: MicroBatch, *, routing: MoERouting | None = None) -> torch.Tensor:
        """``[M]`` float32: the value of the state before each response token."""
        hidden = _hidden(self.lm, self.native, mb, routing)
        # A fresh tensor, not a view: FSDP2 hooks the root's output for backward, and an in-place op
        # on a view by the caller would bypass that hook.
        return self.value_head(hidden[mb.select]).float().squeeze(-1).clone()
