"""The single-turn generate function, rollout sampling settings and completion -> `Sample`.

(The generate-function forms and their registry: tandem/rollout/functions.py.) `single_turn` sends a
prompt's token ids with ``n`` samples (one shared prefill) and turns every completion into a `Sample`:
the prompt ids and the engine's response ids exactly as generated (token-in-token-out, never
re-tokenized), the engine's log-probs, the finish reason as a status, the weight versions and, for MoE
models, the routed experts. The response text is decoded only for rewards and logs.

Per-request seeds derive from ``(seed, step, prompt index)`` (`request_seed`), so a run resumed from a
checkpoint samples exactly what the uninterrupted run sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.core.protocols import Completion, FinishReason, GenerationRequest, SamplingParams
from tandem.core.sample import Sample, SampleStatus
from tandem.rollout.data import PromptRecord

__all__ = ["MAX_NEW_TOKENS", "SamplingConfig", "completion_to_sample", "request_seed", "single_turn"]

# A sanity bound, not a model's limit: a typo such as 1000000000 fails the recipe instead of sizing
# buffers for it (the run's context is min(max_prompt_tokens + max_new_tokens, the model's context)).
MAX_NEW_TOKENS = 1_000_000

_STATUS = {
    FinishReason.STOP: SampleStatus.COMPLETED,
    FinishReason.LENGTH: SampleStatus.TRUNCATED,
    FinishReason.ABORT: SampleStatus.ABORTED,
    FinishReason.ERROR: SampleStatus.FAILED,
}


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """Rollout sampling. RL keeps ``top_p = 1`` and ``top_k = 0`` (see SamplingParams' log-prob note)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # the tokenizer's eos is always added

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer")
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} is above the limit of {MAX_NEW_TOKENS} "
                             "tokens per response (the model's context caps it lower still)")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature={self.temperature} must be a finite number")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: no top-k)")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       max_new_tokens=self.max_new_tokens).validate()

    def params(self, *, n: int, seed: int, eos_token_id: int | None, routed_experts: bool = False) -> SamplingParams:
        stops = tuple(dict.fromkeys([*self.stop_token_ids, *([eos_token_id] if eos_token_id is not None else [])]))
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_new_tokens=self.max_new_tokens,
            stop_token_ids=stops, seed=seed, n=n, return_routed_experts=routed_experts,
        )


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """A 31-bit seed that depends only on the run seed, the step and the prompt."""
    h = (seed * 1_000_003 + step) * 1_000_033 + prompt_index
    return (h ^ (h >> 29)) & 0x7FFFFFFF


def completion_to_sample(
    record: PromptRecord, completion: Completion, *, tokenizer, group_index: int, index: int
) -> Sample:
    ids = list(completion.token_ids)
    sample = Sample(
        prompt=record.prompt,
        response=tokenizer.decode(ids, skip_special_tokens=True) if ids else "",
        tokens=list(record.prompt_token_ids) + ids,
        response_length=len(ids),
        loss_mask=[1] * len(ids),
        rollout_log_probs=list(completion.log_probs),
        rollout_routed_experts=completion.routed_experts,
        label=record.label,
        status=_STATUS[completion.finish_reason],
        weight_versions=list(completion.weight_versions),
        group_index=group_index,
        index=index,
        metadata={**record.metadata, "prompt_index": record.index},
    )
    if completion.error:
        sample.metadata["error"] = completion.error
    if completion.finish_reason == FinishReason.ABORT:  # e.g. a weight update with partial_rollouts: false
        sample.metadata["status_reason"] = "engine_abort"
    return sample


async def single_turn(ctx, record: PromptRecord, *, group_index: int, seed: int) -> list[Sample]:
    """The ``n`` samples of one prompt: one request with ``n`` samples (one shared prefill).

    ``ctx`` is the `tandem.rollout.functions.RolloutContext` (engine, tokenizer, sampling settings);
    ``seed`` seeds the request (the engine derives one seed per sample from it).
    """
    request = GenerationRequest(
        prompt_token_ids=list(record.prompt_token_ids),
        sampling=ctx.sampling.params(n=ctx.n, seed=seed, eos_token_id=ctx.eos_token_id,
                                     routed_experts=ctx.routed_experts),
    )
    result = await ctx.engine.agenerate(request)
    comps = result.completions
    if len(comps) != ctx.n:  # a request-level error: one ERROR completion stands for the group
        comps = [comps[0]] * ctx.n if comps else [Completion(token_ids=[], log_probs=[], finish_reason=FinishReason.ERROR,
                                                             error=result.error)] * ctx.n
    return [completion_to_sample(record, c, tokenizer=ctx.tokenizer, group_index=group_index, index=i)
            for i, c in enumerate(comps)]
