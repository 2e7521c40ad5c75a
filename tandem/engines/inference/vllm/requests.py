"""Requests of the vLLM adapter: validation, conversion to vLLM sampling parameters, result assembly.

A Tandem request with ``n`` samples becomes ``n`` vLLM requests of one sample each (ids
``<request_id>/<i>``, seeds ``derive_seed(seed, i)``): vLLM refuses ``n > 1`` for greedy requests, and
one sample per vLLM request lets an abort return every sample's partial tokens. vLLM's prefix cache
computes the shared prompt once.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

from tandem.core.protocols import (
    Completion,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)

__all__ = ["RequestState", "check_request", "derive_seed", "error_result", "vllm_sampling"]

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_SEED_MASK = (1 << 63) - 1


def derive_seed(base: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``base`` (splitmix64, kept non-negative)."""
    z = (base + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


def check_request(
    request: GenerationRequest, *, vocab_size: int, max_model_len: int, filtered_logprobs: str
) -> tuple[list[int], SamplingParams] | str:
    """The validated prompt and sampling parameters, or the error message for this request: the shared
    check (`GenerationRequest.check`; no routed experts from vLLM) plus vLLM's log-prob convention."""
    try:
        prompt, sampling = request.check(vocab_size=vocab_size, max_model_len=max_model_len, routed_experts=False)
    except ValueError as e:
        return str(e)
    if filtered_logprobs == "reject" and sampling.temperature > 0 and (sampling.top_k > 0 or sampling.top_p < 1):
        return (
            f"top_k={sampling.top_k} / top_p={sampling.top_p}: vLLM renormalises the returned log-prob over "
            "the kept tokens, Tandem's convention is the full vocabulary; use top_k=0 and top_p=1, or set "
            "VLLMEngineConfig.filtered_logprobs='renormalized' to accept vLLM's values"
        )
    return prompt, sampling


def vllm_sampling(params: SamplingParams, seed: int) -> Any:
    """vLLM ``SamplingParams`` of one sample: token ids and the sampled token's log-prob, delta outputs.

    ``ignore_eos``: Tandem stops only on ``stop_token_ids`` (vLLM would add the model's EOS).
    """
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k) if params.top_k > 0 else 0,
        max_tokens=int(params.max_new_tokens),
        stop_token_ids=[int(t) for t in params.stop_token_ids],
        ignore_eos=True,
        seed=seed,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )


def error_result(request: GenerationRequest, message: str) -> GenerationResult:
    completion = Completion(token_ids=[], log_probs=[], finish_reason=FinishReason.ERROR, error=message)
    return GenerationResult(
        request_id=str(request.request_id),
        prompt_token_ids=list(request.prompt_token_ids) if isinstance(request.prompt_token_ids, list) else [],
        completions=[completion],
        error=message,
    )


@dataclass(kw_only=True)
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    error: str | None = None


class RequestState:
    """One Tandem request in flight: its ``n`` samples fill from vLLM's delta outputs (any thread)."""

    def __init__(self, request: GenerationRequest, prompt: list[int], params: SamplingParams, seeds: list[int]):
        self.request, self.prompt, self.params, self.seeds = request, prompt, params, seeds
        self.samples = [_Sample() for _ in range(params.n)]
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()

    @property
    def vllm_ids(self) -> list[str]:
        return [f"{self.request.request_id}/{i}" for i in range(self.params.n)]

    def deliver(self, index: int, output: Any, version: int) -> int:
        """Append one vLLM delta ``CompletionOutput``; returns the number of new tokens."""
        sample = self.samples[index]
        with self._lock:
            if sample.finish is not None:
                return 0
            new = list(output.token_ids)
            if new:
                logprobs = output.logprobs
                if logprobs is None or len(logprobs) != len(new):
                    raise RuntimeError("vLLM returned no log-prob for a generated token (logprobs=0 was requested)")
                sample.token_ids += new
                sample.log_probs += [float(d[t].logprob) for d, t in zip(logprobs, new, strict=True)]
                if not sample.versions or sample.versions[-1] != version:
                    sample.versions.append(version)
            if output.finish_reason is not None:
                spans = getattr(output, "weight_versions", None)
                if spans:  # vLLM's own record (exact also when outputs were read late)
                    sample.versions = list(dict.fromkeys(int(s.version) for s in spans if s.end > s.start))
                sample.finish = _FINISH.get(output.finish_reason, FinishReason.ERROR)
                if sample.finish is FinishReason.ERROR:
                    sample.error = f"vLLM finished the request with reason {output.finish_reason!r}"
        self._maybe_resolve()
        return len(new)

    def finish(self, index: int, reason: FinishReason, error: str | None = None) -> None:
        """End sample ``index`` now (abort, engine failure); its tokens so far are kept."""
        with self._lock:
            sample = self.samples[index]
            if sample.finish is None:
                sample.finish, sample.error = reason, error
        self._maybe_resolve()

    def finish_all(self, reason: FinishReason, error: str | None = None) -> None:
        for i in range(len(self.samples)):
            self.finish(i, reason, error)

    def _maybe_resolve(self) -> None:
        with self._lock:
            if self.future.done() or any(s.finish is None for s in self.samples):
                return
            completions = [
                Completion(
                    token_ids=s.token_ids,
                    log_probs=s.log_probs,
                    finish_reason=s.finish,
                    weight_versions=s.versions,
                    error=s.error,
                )
                for s in self.samples
            ]
            errors = [s.error for s in self.samples if s.error]
            result = GenerationResult(
                request_id=str(self.request.request_id),
                prompt_token_ids=self.prompt,
                completions=completions,
                error=errors[0] if errors else None,
            )
            self.future.set_result(result)
