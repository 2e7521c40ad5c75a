"""Engine protocols: what the loop needs from an inference engine, a training engine and a weight sync.

Adapters satisfy these structurally (``typing.Protocol``); nobody inherits from them. The request and
result records below are the only data an inference engine exchanges with the loop: token ids in,
token ids + log-probs out, never text.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from tandem.core.batch import TrainBatch

__all__ = [
    "CapabilityError",
    "Completion",
    "EngineAsleepError",
    "EngineClosedError",
    "EngineError",
    "EngineInfo",
    "FinishReason",
    "FrozenBase",
    "FrozenWeights",
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "LoRAEngine",
    "LogProbOutput",
    "LossFn",
    "LossScale",
    "NamedTensors",
    "SamplingParams",
    "ScoringEngine",
    "SharesWeights",
    "TrainingEngine",
    "WeightSync",
    "WeightsView",
]

NamedTensors = Iterable[tuple[str, torch.Tensor]]


# -- engine errors: every adapter raises these, so a caller catches one type whatever the engine ---------


class EngineError(RuntimeError):
    """An engine refused a call in its current state."""


class EngineAsleepError(EngineError):
    """generate() on a sleeping engine, or sleep() with requests in flight."""


class EngineClosedError(EngineError):
    """A call on an engine after close()."""


class CapabilityError(EngineError):
    """A call that the engine's `EngineInfo` says it cannot serve (e.g. sleep() where ``can_sleep`` is
    False). The runtime reads ``info`` and never makes such a call; a direct caller gets this error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineInfo:
    """What an engine is and can do: the record the runtime reads instead of probing attributes.

    Both engine protocols expose one as ``engine.info`` (constant for the engine's life). A field that
    does not apply to one side keeps its default. Capability flags name the optional protocol a
    ``True`` promises: ``can_score`` -> `ScoringEngine`, ``lora_adapters`` (inference) -> `LoRAEngine`,
    ``exposes_weights`` -> `WeightsView`. The shared contract suites check that each flag and its
    methods agree.
    """

    name: str  # the registry name: "torch", "vllm", "fsdp", "megatron" or a plug-in's
    version: str = ""  # the implementation's version (the engine package's, or Tandem's for its own)
    dtype: str  # the policy forward's compute dtype: "float32", "bfloat16", "float16"
    deterministic: bool = False  # batch-invariant numerics (tandem.ops): what an exact contract needs
    moe_layers: tuple[int, ...] = ()  # decoder layers with routed experts (empty: a dense model)
    max_context: int  # inference: prompt + response tokens per sequence; training: the model's context
    vocab_size: int | None = None
    can_sleep: bool = False  # sleep()/wake_up() free memory for a colocated peer
    can_score: bool = False  # inference: score() gives teacher-forced log-probs (rollout.recompute_log_probs)
    routed_experts: bool = False  # inference: returns routed experts on request; training: replays them (R3)
    lora_adapters: bool = False  # inference: load_lora_adapter() (adapter-only sync); training: trains LoRA
    exposes_weights: bool = False  # inference: named_weights() (sync.verify compares them with the trainer's)
    partial_updates: bool = False  # inference: update_weights() takes a subset of the weights (sync.delta)
    temperature: float | None = None  # training: the temperature its log-probs use (None: not applicable)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineInfo.name must be set")
        if self.max_context < 1:
            raise ValueError(f"EngineInfo.max_context={self.max_context} must be >= 1")

    @property
    def moe(self) -> bool:
        return bool(self.moe_layers)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token was generated (it is included in token_ids)
    LENGTH = "length"  # max_new_tokens or the context limit was reached
    ABORT = "abort"  # abort()/abort_all(); token_ids hold the partial response
    ERROR = "error"  # the request was invalid or failed; `error` says why


# The numeric fields an engine receives from untrusted requests (a bool is refused: it is an int).
_SAMPLING_TYPES = {
    "temperature": numbers.Real,
    "top_p": numbers.Real,
    "top_k": numbers.Integral,
    "max_new_tokens": numbers.Integral,
    "n": numbers.Integral,
}


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample one request. ``top_k <= 0`` and ``top_p >= 1`` disable those filters.

    Log-probs are always returned, with the convention every Tandem engine and trainer shares: the
    log-prob of the sampled token under ``log_softmax(logits / temperature)`` over the full vocabulary.
    top-k / top-p only restrict which tokens can be sampled; they do not renormalise the returned
    log-prob (a trainer cannot reproduce per-step filtering cheaply). RL recipes therefore keep
    ``top_p = 1`` and ``top_k = 0`` so that the returned log-prob is exactly the behaviour policy's.
    Greedy is ``temperature == 0``; its log-probs are those of ``log_softmax(logits)``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    return_routed_experts: bool = False

    @classmethod
    def coerce(cls, sampling: SamplingParams | dict[str, Any]) -> SamplingParams:
        """``sampling`` (the dataclass or a dict of its fields) type-checked and validated.

        Raises ValueError naming the bad key or value: an engine turns it into that request's error.
        """
        if isinstance(sampling, dict):
            keys = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(sampling) - set(keys))
            if unknown:
                raise ValueError(f"unknown sampling key {unknown[0]!r} (valid keys: {', '.join(keys)})")
            sampling = cls(**sampling)
        if not isinstance(sampling, cls):
            raise ValueError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
        for name, kind in _SAMPLING_TYPES.items():
            value = getattr(sampling, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{name}={value!r} must be {'a number' if kind is numbers.Real else 'an integer'}")
        if sampling.seed is not None and (isinstance(sampling.seed, bool) or not isinstance(sampling.seed, int)):
            raise ValueError(f"seed={sampling.seed!r} must be an integer or None")
        sampling.validate()
        if not math.isfinite(sampling.temperature):
            raise ValueError(f"temperature={sampling.temperature} must be finite")
        return sampling

    def validate(self) -> SamplingParams:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be > 0")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        return self


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # requests of one conversation share it: a router in front of several replicas sends them to one
    # replica (its prefix stays warm there); an engine ignores it
    session_id: str | None = None
    # the LoRA adapter to generate with (engines with ``info.lora_adapters``): None = the engine's default
    # (the policy adapter a LoRA run syncs, else the base model), "base" = no adapter, else a loaded name
    lora: str | None = None

    def check(
        self, *, vocab_size: int, max_model_len: int, routed_experts: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """The validated prompt (plain ints) and sampling parameters of this request.

        One check for every engine (untrusted requests arrive through the session server): sampling
        types and ranges, stop and prompt token ids inside ``[0, vocab_size)``, a non-empty prompt that
        leaves room for one new token in ``max_model_len``, and ``return_routed_experts`` only where the
        engine can return them (``routed_experts``: its `EngineInfo` flag). Raises ValueError naming the
        value and the limit; an engine turns it into this request's error result.
        """
        sampling = SamplingParams.coerce(self.sampling)
        if self.lora is not None and (not isinstance(self.lora, str) or not 0 < len(self.lora) <= 128):
            raise ValueError(f"lora={self.lora!r} must be an adapter name (a string of 1 to 128 characters) or None")
        bad_stop = [t for t in sampling.stop_token_ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab_size]
        if bad_stop:
            raise ValueError(f"stop token id {bad_stop[0]!r} is outside the vocabulary [0, {vocab_size})")
        if sampling.return_routed_experts and not routed_experts:
            raise ValueError("return_routed_experts=True but this engine returns no routed experts "
                             "(a dense model, or an engine without routing capture)")
        ids = self.prompt_token_ids
        if isinstance(ids, torch.Tensor | np.ndarray):
            ids = ids.tolist()
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int | np.integer) and not isinstance(t, bool)
                                                        for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        if not ids:
            raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
        if len(ids) >= max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={max_model_len} allows at most "
                             f"{max_model_len - 1}")
        for pos, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise ValueError(f"token id {int(t)} at position {pos} is outside the vocabulary [0, {vocab_size})")
        return [int(t) for t in ids], sampling


@dataclass(kw_only=True, slots=True)
class Completion:
    """One sampled response of a request."""

    token_ids: list[int]
    log_probs: list[float]  # one per token in token_ids
    finish_reason: FinishReason
    weight_versions: list[int] = field(default_factory=list)  # distinct versions, in generation order
    routed_experts: np.ndarray | None = None  # [P + len(token_ids) - 1, layers, topk] int32
    error: str | None = None

    @property
    def weight_version(self) -> int:
        """The oldest weight version that produced a token of this completion (-1 if none)."""
        return min(self.weight_versions) if self.weight_versions else -1


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]  # n of them; on a request error, one with finish_reason ERROR
    error: str | None = None


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates from token ids; its weights can be replaced in place between (or during) batches.

    ``info`` says what else it can do (`EngineInfo`); ``sleep``/``wake_up`` are called only where
    ``info.can_sleep`` (elsewhere they raise `CapabilityError`). ``close`` aborts what is in flight and
    releases the engine; it is idempotent.
    """

    @property
    def info(self) -> EngineInfo: ...

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking generation, results in request order. A bad request fails alone."""
        ...

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Asyncio generation of one request; concurrent calls share the running batch."""
        ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy HF-named tensors into the live weights; afterwards ``weight_version == version``."""
        ...

    def sleep(self) -> None:
        """Free the KV cache (and what else the engine can) for a colocated trainer."""
        ...

    def wake_up(self) -> None: ...

    def health(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class ScoringEngine(Protocol):
    """An inference engine with ``info.can_score``: teacher-forced log-probs of given sequences."""

    def score(
        self, sequences: Sequence[tuple[Sequence[int], int]], *, temperature: float = 1.0, max_tokens: int = 8192
    ) -> list[list[float]]:
        """Per ``(token_ids, prompt_length)``: log-probs of ``token_ids[prompt_length:]`` under
        ``log_softmax(logits / temperature)``, the convention generation returns."""
        ...


@runtime_checkable
class LoRAEngine(Protocol):
    """An inference engine with ``info.lora_adapters``: serves LoRA adapters on its base weights."""

    def load_lora_adapter(self, named_tensors: NamedTensors, version: int) -> None:
        """Serve these adapter tensors (peft names) for every later request; ``weight_version == version``."""
        ...


@runtime_checkable
class WeightsView(Protocol):
    """An inference engine with ``info.exposes_weights``: its live weights by HF name (for ``sync.verify``)."""

    def named_weights(self) -> Mapping[str, torch.Tensor]: ...


@runtime_checkable
class SharesWeights(Protocol):
    """An inference engine that can hold tensors a trainer in its own process keeps frozen (a LoRA base) as its
    weights instead of copies (`tandem.sync.inprocess.share_frozen_base`). It checks each tensor equals its
    weight, never writes one (an update gives the weight its own memory first), and skips what does not fit."""

    def share_weights(self, named: NamedTensors,
                      quantized: Iterable[tuple[str, Mapping[str, torch.Tensor]]] = ()) -> dict[str, float]: ...


# A trainer's frozen base as it holds it: (HF name, tensor), and (HF name of a weight, its quantized tensors)
FrozenBase = tuple[list[tuple[str, torch.Tensor]], list[tuple[str, dict[str, torch.Tensor]]]]


@runtime_checkable
class FrozenWeights(Protocol):
    """A training engine that hands out the frozen tensors it holds whole in this process (a LoRA base), uncopied:
    HF-named plain tensors, and (HF name, quantized tensors) of a quantized base. It never writes them."""

    def frozen_weights(self) -> FrozenBase: ...


@dataclass(kw_only=True, slots=True)
class LossScale:
    """Global normalisers of a training step, summed over all micro-batches and data-parallel ranks.

    A loss function divides its micro-batch sum by one of these so that the micro-batch losses add up
    exactly to the full-batch loss (see core/losses.py for which aggregation uses which).
    """

    num_tokens: float  # sum of the loss mask over the global batch
    num_sequences: float  # rows with at least one loss token in the global batch
    max_response_length: int  # the constant of Dr.GRPO's sum normalisation


@dataclass(kw_only=True, slots=True)
class LogProbOutput:
    log_probs: torch.Tensor  # [B, R] float32, response space, zero on padding
    entropy: torch.Tensor | None = None  # [B, R] float32
    values: torch.Tensor | None = None  # [B, R] float32, critic only


class LossFn(Protocol):
    """A loss on one micro-batch: ``(output, micro_batch, scale) -> (loss, metrics)``.

    ``output`` holds the current policy's log-probs (with grad) for ``micro_batch`` in response space.
    The returned loss is already divided by the global normaliser in ``scale``. Metrics are floats,
    each this micro-batch's share of the global value: sum them over micro-batches and ranks; keys
    ending in ``/max`` (``/min``) reduce by max (min); see ``losses.reduce_micro_batch_metrics``.
    """

    def __call__(
        self, output: LogProbOutput, batch: TrainBatch, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


@runtime_checkable
class TrainingEngine(Protocol):
    """Owns the trainable policy (and optionally a reference model and critic).

    ``info`` describes the policy forward (`EngineInfo`: dtype, determinism, MoE layers and whether it
    replays routed experts, LoRA, the log-prob temperature). ``close`` releases process-wide state (a
    process group the engine created, Megatron's parallel state); it is idempotent.
    """

    @property
    def info(self) -> EngineInfo: ...

    @property
    def step(self) -> int: ...

    def local_rows(self, batch: TrainBatch) -> list[int]:
        """The rows of a global ``batch`` this rank works on (its data-parallel share; every row in one
        process). A placement that runs the ranks as actors hands each the global batch and lets it pick."""
        ...

    def forward_logprobs(
        self, batch: TrainBatch, *, with_entropy: bool = False, model: str = "policy"
    ) -> LogProbOutput:
        """Log-probs of the response tokens, no grad. ``model`` is ``policy``, ``ref`` or ``critic``."""
        ...

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, model: str = "policy") -> dict[str, float]:
        """One optimizer step over ``batch`` (micro-batched inside); returns metrics.

        ``model="critic"`` trains the value model. A loss that sets ``needs_entropy = True`` gets
        ``output.entropy`` with gradient.
        """
        ...

    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors in buckets of at most ``bucket_bytes`` (one tensor may exceed it)."""
        ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


class WeightSync(Protocol):
    """Moves the trainer's weights into an inference engine; the version rises by one per sync."""

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Trainer side; returns metrics (bytes, seconds). Raises if the receiver failed."""
        ...

    def close(self) -> None: ...
