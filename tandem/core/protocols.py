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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from tandem.core.batch import TrainBatch

__all__ = [
    "Completion",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "LogProbOutput",
    "LossFn",
    "LossScale",
    "NamedTensors",
    "SamplingParams",
    "TrainingEngine",
    "WeightSync",
]

NamedTensors = Iterable[tuple[str, torch.Tensor]]


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
    """Generates from token ids; its weights can be replaced in place between (or during) batches."""

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
    """Owns the trainable policy (and optionally a reference model and critic)."""

    @property
    def step(self) -> int: ...

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


class WeightSync(Protocol):
    """Moves the trainer's weights into an inference engine; the version rises by one per sync."""

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Trainer side; returns metrics (bytes, seconds). Raises if the receiver failed."""
        ...

    def close(self) -> None: ...
