"""Model architectures the planner knows without downloading anything.

An `Arch` holds the config fields that size memory and time: layers, hidden size, attention heads, KV
heads, head dim, MLP sizes, experts, vocabulary, tied embeddings, MLA ranks. `resolve_arch(name)`
takes a hub id of the table below (`Qwen/Qwen3-8B`, or just `qwen3-8b`), a Tandem registry name
(`smollm2-135m-instruct`, `tiny-qwen3`: read from the model's own config.json), a local HF folder or
a `config.json` path. Field values come from the models' published `config.json` files (hub ids below)
and, for Qwen3.5, slime's `scripts/models/qwen3.5-35B-A3B.sh`.

Layer kinds the planner approximates: sliding-window layers (Gemma 3, gpt-oss) are counted as full
attention for the KV cache (an over-estimate); Qwen3-Next / Qwen3.5 linear-attention layers hold a
fixed-size state, so only their full-attention layers (`full_attention_every`) hold a KV cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["ARCHS", "Arch", "arch_from_hf_config", "resolve_arch"]


QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")  # RMSNorm on q and k per head before rotary


@dataclass(frozen=True, slots=True)
class Arch:
    """The shape of a decoder-only LM (dense or MoE; GQA or MLA attention)."""

    name: str
    family: str  # HF model_type (llama, qwen2, qwen3, qwen3_moe, deepseek_v3, glm4_moe, gpt_oss, ...)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (dense layers, or the first_dense layers of an MoE)
    vocab: int
    tied: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # total width of the shared expert(s)
    first_dense: int = 0  # leading dense layers of an MoE (DeepSeek's first_k_dense_replace)
    q_lora_rank: int = 0  # MLA (DeepSeek-V3, Kimi-K2): > 0 or kv_lora_rank > 0 means MLA
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    full_attention_every: int = 1  # 4: one layer in four holds a KV cache (linear attention elsewhere)
    max_position: int = 32768
    native: bool = False  # Tandem's own model implementation covers it (packing, exact contracts)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.first_dense if self.moe else 0

    def attention_params(self) -> int:
        h = self.hidden
        if self.mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.heads * qk if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank * self.heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * self.heads * (
                self.qk_nope_dim + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * h
        q_out = self.heads * self.head_dim
        return h * q_out + 2 * h * self.kv_heads * self.head_dim + q_out * h

    def expert_params(self) -> int:
        """Routed-expert parameters of the whole model (what expert parallelism splits)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_intermediate

    def dense_params(self) -> int:
        """Everything but the routed experts: attention, dense and shared MLPs, norms, routers, embeddings."""
        h = self.hidden
        mlp_dense = self.first_dense if self.moe else self.layers
        per_moe = 3 * h * self.shared_intermediate + h * self.experts
        body = self.layers * (self.attention_params() + 2 * h) + mlp_dense * 3 * h * self.intermediate
        return body + self.moe_layers * per_moe + self.embedding_params() + h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def total_params(self) -> int:
        return self.dense_params() + self.expert_params()

    def active_params(self) -> int:
        """Parameters one token passes through (the routed experts it is sent to, not all of them)."""
        routed = self.moe_layers * self.top_k * 3 * self.hidden * self.moe_intermediate
        return self.dense_params() + routed

    def matmul_params_per_token(self) -> int:
        """Active parameters a token multiplies with, without the embedding lookup and the LM head."""
        return self.active_params() - self.embedding_params()

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> float:
        """KV-cache bytes per token on one GPU of a tensor-parallel group (KV heads split, MLA replicated)."""
        cache_layers = -(-self.layers // self.full_attention_every)
        if self.mla:
            return cache_layers * (self.kv_lora_rank + self.qk_rope_dim) * dtype_bytes
        kv_per_gpu = max(1.0, self.kv_heads / tp)
        return cache_layers * 2 * kv_per_gpu * self.head_dim * dtype_bytes

    def activation_width(self) -> int:
        """Elements stored per token per layer for backward (inputs of norms, projections, MLP), for the
        memory model: ~10 hidden-sized tensors + q/k/v + 4 MLP-width tensors (gate, up, act, product)."""
        mlp = self.top_k * self.moe_intermediate + self.shared_intermediate if self.moe else self.intermediate
        kv = 2 * self.kv_heads * self.head_dim if not self.mla else self.kv_lora_rank + self.qk_rope_dim
        return 10 * self.hidden + kv + 4 * mlp + (self.experts if self.moe else 0)

    def native_activation_width(self) -> int:
        """Elements Tandem's FSDP engine keeps per token per layer on its native model with the saved outputs
        recomputed (`trainer.fsdp.recompute_pointwise`, docs/training.md): the two norms' inputs, attention's
        q, k, v and output (plus half of them again for padded and prompt-shared attention calls), the inputs
        of q/k norms where the family has them, and the MLP's gate and up outputs. Measured on SmolLM2
        (2026-12-06): 6,410 on GRPO rows with shared prompts, 5,823 on packed rows, against 6,528 here; tiny
        llama / qwen3 models keep 636 / 738 (fp32) and 647 / 755 (bf16) against 672 / 768. MoE and MLA models
        keep the conservative count (a tiny Qwen3-MoE's expert loop keeps more than this formula)."""
        if self.mla or self.moe:
            return self.activation_width()
        q, kv = self.heads * self.head_dim, 2 * self.kv_heads * self.head_dim
        attention = 2 * q + kv + (2 * q + kv) // 2 + (q + kv // 2 if self.family in QK_NORM_FAMILIES else 0)
        return 2 * self.hidden + attention + 2 * self.intermediate


def _a(name, family, layers, hidden, heads, kv, hd, inter, vocab, tied=False, **kw) -> Arch:
    return Arch(name=name, family=family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv, head_dim=hd,
                intermediate=inter, vocab=vocab, tied=tied, **kw)


_Q25 = dict(max_position=32768)
_DSV3 = dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128, top_k=8,
             moe_intermediate=2048, shared_intermediate=2048, max_position=163840)

# hub id -> architecture (config.json fields of the published checkpoints)
ARCHS: dict[str, Arch] = {a.name: a for a in [
    _a("Qwen/Qwen2.5-0.5B-Instruct", "qwen2", 24, 896, 14, 2, 64, 4864, 151936, True, native=True, **_Q25),
    _a("Qwen/Qwen2.5-1.5B-Instruct", "qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True, native=True, **_Q25),
    _a("Qwen/Qwen2.5-3B-Instruct", "qwen2", 36, 2048, 16, 2, 128, 11008, 151936, True, native=True, **_Q25),
    _a("Qwen/Qwen2.5-7B-Instruct", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, native=True, **_Q25),
    _a("Qwen/Qwen2-7B-Instruct", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, native=True, **_Q25),
    _a("Qwen/Qwen2.5-14B-Instruct", "qwen2", 48, 5120, 40, 8, 128, 13824, 152064, native=True, **_Q25),
    _a("Qwen/Qwen2.5-32B-Instruct", "qwen2", 64, 5120, 40, 8, 128, 27648, 152064, native=True, **_Q25),
    _a("Qwen/Qwen2.5-72B-Instruct", "qwen2", 80, 8192, 64, 8, 128, 29568, 152064, native=True, **_Q25),
    _a("Qwen/Qwen3-0.6B", "qwen3", 28, 1024, 16, 8, 128, 3072, 151936, True, native=True, max_position=40960),
    _a("Qwen/Qwen3-1.7B", "qwen3", 28, 2048, 16, 8, 128, 6144, 151936, True, native=True, max_position=40960),
    _a("Qwen/Qwen3-4B", "qwen3", 36, 2560, 32, 8, 128, 9728, 151936, True, native=True, max_position=40960),
    _a("Qwen/Qwen3-8B", "qwen3", 36, 4096, 32, 8, 128, 12288, 151936, native=True, max_position=40960),
    _a("Qwen/Qwen3-14B", "qwen3", 40, 5120, 40, 8, 128, 17408, 151936, native=True, max_position=40960),
    _a("Qwen/Qwen3-32B", "qwen3", 64, 5120, 64, 8, 128, 25600, 151936, native=True, max_position=40960),
    _a("Qwen/Qwen3-30B-A3B", "qwen3_moe", 48, 2048, 32, 4, 128, 6144, 151936, experts=128, top_k=8,
       moe_intermediate=768, native=True, max_position=40960),
    _a("Qwen/Qwen3-235B-A22B", "qwen3_moe", 94, 4096, 64, 4, 128, 12288, 151936, experts=128, top_k=8,
       moe_intermediate=1536, native=True, max_position=40960),
    _a("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", 48, 2048, 16, 2, 256, 5120, 151936, experts=512,
       top_k=10, moe_intermediate=512, shared_intermediate=512, full_attention_every=4, max_position=262144),
    _a("Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe", 40, 2048, 16, 2, 256, 512, 248320, experts=256, top_k=8,
       moe_intermediate=512, shared_intermediate=512, full_attention_every=4, max_position=262144),
    _a("meta-llama/Llama-2-7b-hf", "llama", 32, 4096, 32, 32, 128, 11008, 32000, native=True, max_position=4096),
    _a("meta-llama/Llama-3.2-1B-Instruct", "llama", 16, 2048, 32, 8, 64, 8192, 128256, True, native=True,
       max_position=131072),
    _a("meta-llama/Llama-3.2-3B-Instruct", "llama", 28, 3072, 24, 8, 128, 8192, 128256, True, native=True,
       max_position=131072),
    _a("meta-llama/Llama-3.1-8B-Instruct", "llama", 32, 4096, 32, 8, 128, 14336, 128256, native=True,
       max_position=131072),
    _a("meta-llama/Llama-3.1-70B-Instruct", "llama", 80, 8192, 64, 8, 128, 28672, 128256, native=True,
       max_position=131072),
    _a("meta-llama/Llama-3.3-70B-Instruct", "llama", 80, 8192, 64, 8, 128, 28672, 128256, native=True,
       max_position=131072),
    _a("meta-llama/Llama-3.1-405B-Instruct", "llama", 126, 16384, 128, 8, 128, 53248, 128256, native=True,
       max_position=131072),
    _a("deepseek-ai/deepseek-llm-7b-chat", "llama", 30, 4096, 32, 32, 128, 11008, 102400, native=True,
       max_position=4096),
    _a("deepseek-ai/DeepSeek-V3", "deepseek_v3", 61, 7168, 128, 128, 128, 18432, 129280, experts=256,
       first_dense=3, **_DSV3),
    _a("deepseek-ai/DeepSeek-R1", "deepseek_v3", 61, 7168, 128, 128, 128, 18432, 129280, experts=256,
       first_dense=3, **_DSV3),
    _a("moonshotai/Kimi-K2-Instruct", "deepseek_v3", 61, 7168, 64, 64, 128, 18432, 163840, experts=384,
       first_dense=1, **_DSV3),
    _a("zai-org/GLM-4.5", "glm4_moe", 92, 5120, 96, 8, 128, 12288, 151552, experts=160, top_k=8,
       moe_intermediate=1536, shared_intermediate=1536, first_dense=3, max_position=131072),
    _a("zai-org/GLM-4.6", "glm4_moe", 92, 5120, 96, 8, 128, 12288, 151552, experts=160, top_k=8,
       moe_intermediate=1536, shared_intermediate=1536, first_dense=3, max_position=202752),
    _a("zai-org/GLM-4.5-Air", "glm4_moe", 46, 4096, 96, 8, 128, 10944, 151552, experts=128, top_k=8,
       moe_intermediate=1408, shared_intermediate=1408, first_dense=1, max_position=131072),
    _a("openai/gpt-oss-20b", "gpt_oss", 24, 2880, 64, 8, 64, 2880, 201088, experts=32, top_k=4,
       moe_intermediate=2880, max_position=131072),
    _a("openai/gpt-oss-120b", "gpt_oss", 36, 2880, 64, 8, 64, 2880, 201088, experts=128, top_k=4,
       moe_intermediate=2880, max_position=131072),
    _a("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", 32, 4096, 32, 8, 128, 14336, 32000, experts=8, top_k=2,
       moe_intermediate=14336, max_position=32768),
    _a("mistralai/Mixtral-8x22B-Instruct-v0.1", "mixtral", 56, 6144, 48, 8, 128, 16384, 32768, experts=8,
       top_k=2, moe_intermediate=16384, max_position=65536),
    _a("google/gemma-3-1b-it", "gemma3_text", 26, 1152, 4, 1, 256, 6912, 262144, True, max_position=32768),
    _a("google/gemma-3-4b-it", "gemma3", 34, 2560, 8, 4, 256, 10240, 262208, True, max_position=131072),
    _a("google/gemma-3-12b-it", "gemma3", 48, 3840, 16, 8, 256, 15360, 262208, True, max_position=131072),
    _a("google/gemma-3-27b-it", "gemma3", 62, 5376, 32, 16, 128, 21504, 262208, True, max_position=131072),
]}


def _key(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower().removesuffix("-instruct").removesuffix("-it").removesuffix("-chat")


_BY_SHORT = {_key(k): v for k, v in ARCHS.items()}


def arch_from_hf_config(cfg: dict, name: str = "config.json") -> Arch:
    """An `Arch` from an HF ``config.json`` mapping (text_config of multimodal configs is used)."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type", "")}
    try:
        hidden, layers, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ValueError(f"{name}: config.json lacks {e.args[0]!r} (not a decoder-only LM config?)") from None
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if experts else 0))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    full_every = int(cfg.get("full_attention_interval") or 1)
    return Arch(
        name=name, family=str(cfg.get("model_type", "")), layers=layers, hidden=hidden, heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg.get("intermediate_size") or 0),
        vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)), experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0, moe_intermediate=moe_inter,
        shared_intermediate=shared, first_dense=int(cfg.get("first_k_dense_replace") or 0) if experts else 0,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0), qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0), full_attention_every=full_every,
        max_position=int(cfg.get("max_position_embeddings") or 32768),
        native=str(cfg.get("model_type", "")) in ("llama", "qwen2", "qwen3", "qwen3_moe"),
    )


def _read_config(path: Path, name: str) -> Arch:
    try:
        return arch_from_hf_config(json.loads(path.read_text()), name)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def resolve_arch(name: str) -> Arch:
    """The architecture of ``name``: a table hub id (or its short name), a Tandem registry model, a local HF
    folder or a config.json file. Raises ValueError naming what was tried."""
    if name in ARCHS:
        return ARCHS[name]
    if _key(name) in _BY_SHORT:
        return _BY_SHORT[_key(name)]
    p = Path(os.path.expanduser(name))
    if p.is_file() and p.name.endswith(".json"):
        return _read_config(p, name)
    if (p / "config.json").is_file():
        return _read_config(p / "config.json", name)
    from tandem.models.registry import list_models, resolve_model

    if name in list_models():
        return replace(_read_config(resolve_model(name) / "config.json", name), name=name)
    known = ", ".join(sorted(_key(k) for k in ARCHS))
    raise ValueError(f"unknown model {name!r}: not in the architecture table ({known}), not a Tandem registry "
                     f"name ({', '.join(list_models())}), not a folder with config.json nor a config.json file")
