"""A third-party inference engine and generate function, named in recipes by import path.

What someone outside Tandem writes to plug an engine in: a config dataclass, a class that satisfies
`tandem.core.protocols.InferenceEngine`, and an `EngineEntry` (``inference.engine:
tests.runtime.toy_engine:ENTRY``). Nothing in ``tandem/`` names it.

It is a real engine, if a slow one: Tandem's native model in float32 without a KV cache (the whole
sequence is recomputed for every token), requests interleaved token by token on the caller's event
loop. Its log-probs follow the shared convention (log_softmax(logits / T) of the sampled token), so a
run with it trains; its contract with the FSDP trainer is bounded (registered by the entry).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tandem.core.contracts import Contract, PairContract
from tandem.core.protocols import (
    CapabilityError,
    Completion,
    EngineClosedError,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    NamedTensors,
)
from tandem.core.sample import Sample
from tandem.engines.registry import EngineEntry, RunFacts, run_section
from tandem.models.attention import VarlenAttention
from tandem.models.registry import ModelConfig, resolve_model
from tandem.models.transformer import CausalLM
from tandem.rollout.generate import completion_to_sample

GROUPS: list[int] = []  # group indices the toy generate function was asked for (this process)


@dataclasses.dataclass(kw_only=True, slots=True)
class ToyEngineConfig:
    model: ModelConfig | None = None  # the run's model when unset
    max_model_len: int = 512
    seed: int = 0
    label: str = "toy"  # reported by health(): shows the recipe's inference.toy section reached the engine

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")


class ToyEngine:
    def __init__(self, config: ToyEngineConfig) -> None:
        if config.model is None:
            raise ValueError("ToyEngineConfig.model is not set")
        self.config = config
        self.model = CausalLM.from_pretrained(resolve_model(config.model.name), dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        args = self.model.args
        self._info = EngineInfo(name="toy", version="0.0.1", dtype="float32", max_context=config.max_model_len,
                                vocab_size=args.vocab_size, exposes_weights=True, partial_updates=True)
        self._version = 0
        self._aborted: set[str] = set()
        self._abort_all = 0  # a generation started before the last abort_all ends as ABORT
        self._lock = threading.Lock()  # generation steps vs weight updates
        self._closed = False
        self._tokens = 0

    # -- protocol ----------------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        async def run() -> list[GenerationResult]:
            return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

        return asyncio.run(run())

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        if self._closed:
            raise EngineClosedError("the toy engine is closed")
        try:
            prompt, sampling = request.check(vocab_size=self._info.vocab_size, max_model_len=self.config.max_model_len)
            if sampling.top_k > 0 or sampling.top_p < 1:
                raise ValueError("the toy engine samples from the full distribution (top_k=0, top_p=1)")
        except ValueError as e:
            return GenerationResult(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                                    completions=[Completion(token_ids=[], log_probs=[], finish_reason=FinishReason.ERROR,
                                                            error=str(e))], error=str(e))
        base = sampling.seed if sampling.seed is not None else self.config.seed
        completions = await asyncio.gather(*(self._sample(request.request_id, prompt, sampling, base * 7919 + i)
                                             for i in range(sampling.n)))
        self._aborted.discard(request.request_id)
        return GenerationResult(request_id=request.request_id, prompt_token_ids=prompt, completions=list(completions))

    async def _sample(self, request_id: str, prompt: list[int], sampling, seed: int) -> Completion:
        gen = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
        epoch = self._abort_all
        ids, lps, versions = list(prompt), [], []
        temperature = sampling.temperature or 1.0
        while True:
            await asyncio.sleep(0)  # other requests (and aborts) get their turn between tokens
            if request_id in self._aborted or epoch != self._abort_all or self._closed:
                return Completion(token_ids=ids[len(prompt):], log_probs=lps, finish_reason=FinishReason.ABORT,
                                  weight_versions=versions)
            with self._lock, torch.no_grad():
                hidden = self.model(torch.tensor(ids), torch.arange(len(ids)), VarlenAttention.from_lengths([len(ids)]))
                logp = torch.log_softmax(self.model.logits(hidden[-1:])[0] / temperature, -1)
                version = self._version
            token = int(logp.argmax()) if sampling.temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(token)
            lps.append(float(logp[token]))
            if not versions or versions[-1] != version:
                versions.append(version)
            self._tokens += 1
            new = len(ids) - len(prompt)
            if token in sampling.stop_token_ids:
                return Completion(token_ids=ids[len(prompt):], log_probs=lps, finish_reason=FinishReason.STOP,
                                  weight_versions=versions)
            if new >= sampling.max_new_tokens or len(ids) >= self.config.max_model_len:
                return Completion(token_ids=ids[len(prompt):], log_probs=lps, finish_reason=FinishReason.LENGTH,
                                  weight_versions=versions)

    def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def abort_all(self) -> None:
        self._abort_all += 1

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        weights = self.model.state_dict()
        items = list(named_tensors)
        bad = [n for n, t in items if n not in weights or tuple(t.shape) != tuple(weights[n].shape)]
        if bad:
            raise ValueError(f"update_weights(version={version}) rejected: unknown name or shape {bad[0]!r}")
        with self._lock, torch.no_grad():
            for name, tensor in items:
                weights[name].copy_(tensor)
            self._version = int(version)

    def sleep(self) -> None:
        raise CapabilityError("the toy engine cannot sleep (info.can_sleep is false)")

    def wake_up(self) -> None:
        raise CapabilityError("the toy engine cannot sleep (info.can_sleep is false)")

    def health(self) -> dict[str, Any]:
        return {"status": "closed" if self._closed else "ok", "weight_version": self._version,
                "label": self.config.label, "generated_tokens": self._tokens, "running": 0}

    def named_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def close(self) -> None:
        self._closed = True


def fill(facts: RunFacts, config: ToyEngineConfig | None) -> ToyEngineConfig:
    cfg, changes = run_section(config, ToyEngineConfig, facts)  # the run's model and seed
    return dataclasses.replace(cfg, **changes, max_model_len=min(cfg.max_model_len, facts.max_context))


ENTRY = EngineEntry(
    name="toy",
    kind="inference",
    config="tests.runtime.toy_engine:ToyEngineConfig",
    factory="tests.runtime.toy_engine:ToyEngine",
    fill=fill,
    capabilities=frozenset({"exposes_weights", "partial_updates"}),
    contracts=(PairContract(trainer="fsdp", engine="toy", contract=Contract(
        relation="bounded", tolerance=1e-3, note="toy engine: the native model without a cache, in fp32")),),
)


async def tagged_single_turn(ctx, record, *, group_index: int, seed: int) -> list[Sample]:
    """A user's generate function: one request of ``ctx.n`` samples, each sample tagged."""
    from tandem.core.protocols import GenerationRequest

    GROUPS.append(group_index)
    result = await ctx.engine.agenerate(GenerationRequest(
        prompt_token_ids=list(record.prompt_token_ids),
        sampling=ctx.sampling.params(n=ctx.n, seed=seed, eos_token_id=ctx.eos_token_id,
                                     routed_experts=ctx.routed_experts)))
    samples = [completion_to_sample(record, c, tokenizer=ctx.tokenizer, group_index=group_index, index=i)
               for i, c in enumerate(result.completions)]
    for s in samples:
        s.metadata["generated_by"] = "tagged_single_turn"
    return samples
