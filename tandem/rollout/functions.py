"""Generate functions: the one way samples are produced, in every loop mode.

A generate function turns one prompt into its group of samples (``n`` samples of one prompt) through
an `InferenceEngine`. The preferred form is a coroutine, one group per call:

    async def my_generate(ctx: RolloutContext, record: PromptRecord, *, group_index: int,
                          seed: int) -> list[Sample]:
        result = await ctx.engine.agenerate(GenerationRequest(
            prompt_token_ids=record.prompt_token_ids,
            sampling=ctx.sampling.params(n=ctx.n, seed=seed, eos_token_id=ctx.eos_token_id,
                                         routed_experts=ctx.routed_experts)))
        return [...]  # each sample with group_index=group_index

``sync`` and ``one_step_off`` run a step's groups concurrently on one event loop (they share the
engine's batch, as one ``generate`` call would); ``fully_async`` streams groups from the same
function into its queue. ``seed`` is the group's seed, derived from the run seed, the step (or the
group, in fully-async mode) and the prompt, so a resumed run samples what the uninterrupted one did.
``ctx.resource(key, factory)`` gives a per-loop object that lives as long as the context (a session
server, a thread pool): ``factory()`` returns an async context manager, entered once and exited when the
rollout ends.

A plain (non-async) function with the earlier batch signature also works:
``fn(engine, prompts, *, n, sampling, tokenizer, seed, step, first_group, routed_experts, config)
-> list[Sample]``; the synchronous modes call it once per step with that step's prompts, and the
fully-async producer once per prompt in a worker thread (``step`` = the group index there).

Built-ins by name (``rollout.generate``): ``single_turn``, ``multi_turn``, ``agentic_tool_call``; a user
function by import path ``module:function`` (imported at start-up: user code, see tandem/plugins.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.core.aio import run_blocking
from tandem.core.protocols import InferenceEngine
from tandem.core.sample import Sample
from tandem.plugins import PluginError, Registry
from tandem.rollout.data import PromptRecord
from tandem.rollout.generate import SamplingConfig, request_seed

__all__ = ["GENERATE_FUNCTIONS", "GenerateFunction", "RolloutContext", "generate_groups", "resolve_generate"]


@dataclass(kw_only=True)
class RolloutContext:
    """What a generate function is given besides its prompt: the engine, the tokenizer, the run's sampling
    settings and its ``rollout`` section (``config``: a function's own settings live there), and
    per-loop resources. Use it as ``async with ctx:`` on the loop the groups run on."""

    engine: InferenceEngine
    tokenizer: Any
    n: int  # samples per prompt
    sampling: SamplingConfig
    routed_experts: bool = False  # the trainer replays MoE routes: request the routed experts
    config: Any = None  # the run's RolloutConfig
    seed: int = 0  # the run seed
    stopping: Callable[[], bool] = lambda: False  # True once the rollout is being shut down (failures expected)
    _resources: dict[str, Any] = field(default_factory=dict, repr=False)
    _stack: contextlib.AsyncExitStack | None = field(default=None, repr=False)
    _lock: asyncio.Lock | None = field(default=None, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    async def resource(self, key: str, factory: Callable[[], contextlib.AbstractAsyncContextManager]) -> Any:
        """The resource ``key`` of this context, made by entering ``factory()`` on first use."""
        if key in self._resources:
            return self._resources[key]
        if self._stack is None:
            raise RuntimeError("RolloutContext.resource() outside 'async with ctx:'")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent groups ask at once: enter it once
            if key not in self._resources:
                self._resources[key] = await self._stack.enter_async_context(factory())
        return self._resources[key]

    async def __aenter__(self) -> RolloutContext:
        self._stack = contextlib.AsyncExitStack()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        self._resources.clear()
        if stack is not None:
            await stack.aclose()


GroupFn = Callable[..., Awaitable[list[Sample]]]


@dataclass(frozen=True, slots=True)
class GenerateFunction:
    """A resolved ``rollout.generate``: ``name`` and the function, in either form (module docstring)."""

    name: str
    fn: Callable[..., Any]
    per_group: bool  # the async per-group form; False: the batch form

    def run_step(self, ctx: RolloutContext, records: Sequence[PromptRecord], *, step: int, seed: int,
                 first_group: int) -> list[Sample]:
        """Every group of one step (blocking): ``records[i]`` becomes group ``first_group + i``. The async
        form's samples get ``index`` = their position in the step (a batch function sets its own)."""
        if not records:
            return []
        if not self.per_group:
            samples = self._call_batch(ctx, records, step=step, seed=seed, first_group=first_group)
            self._check(samples, set(range(first_group, first_group + len(records))))
            return samples
        samples = run_blocking(self._step(ctx, records, step=step, seed=seed, first_group=first_group))
        for i, s in enumerate(samples):
            s.index = i
        return samples

    async def run_group(self, ctx: RolloutContext, record: PromptRecord, *, group_index: int,
                        seed: int) -> list[Sample]:
        """One group, on the running loop (the fully-async producer). A batch-form function runs in a
        worker thread, with ``step = group_index`` and the run seed (its own seed derivation then gives
        ``seed`` for its one prompt)."""
        if self.per_group:
            samples = await self.fn(ctx, record, group_index=group_index, seed=seed)
        else:
            loop = asyncio.get_running_loop()
            samples = await loop.run_in_executor(None, lambda: self._call_batch(
                ctx, [record], step=group_index, seed=ctx.seed, first_group=group_index))
        self._check(samples, {group_index})
        return samples

    async def _step(self, ctx: RolloutContext, records: Sequence[PromptRecord], *, step: int, seed: int,
                    first_group: int) -> list[Sample]:
        async with ctx:
            groups = await asyncio.gather(*(
                self.run_group(ctx, r, group_index=first_group + g, seed=request_seed(seed, step, r.index))
                for g, r in enumerate(records)))
        return [s for group in groups for s in group]

    def _call_batch(self, ctx: RolloutContext, records: Sequence[PromptRecord], *, step: int, seed: int,
                    first_group: int) -> list[Sample]:
        return self.fn(ctx.engine, list(records), n=ctx.n, sampling=ctx.sampling, tokenizer=ctx.tokenizer,
                       seed=seed, step=step, first_group=first_group, routed_experts=ctx.routed_experts,
                       config=ctx.config)

    def _check(self, samples: Any, groups: set[int]) -> None:
        if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
            raise TypeError(f"generate function {self.name!r} returned {type(samples).__name__}; "
                            "expected a list of tandem.core.sample.Sample")
        stray = sorted({s.group_index for s in samples} - groups)
        if stray:
            raise ValueError(f"generate function {self.name!r} returned samples of group {stray[0]}; it was asked "
                             f"for group(s) {sorted(groups)} (set each sample's group_index to the one given)")


def _wrap(name: str, fn: Callable[..., Any]) -> GenerateFunction:
    return GenerateFunction(name=name, fn=fn, per_group=inspect.iscoroutinefunction(fn))


def _builtins() -> dict[str, Callable[..., Any]]:
    from tandem.rollout.agent import agentic_tool_call, multi_turn
    from tandem.rollout.generate import single_turn

    return {"single_turn": single_turn, "multi_turn": multi_turn, "agentic_tool_call": agentic_tool_call}


GENERATE_FUNCTIONS: Registry = Registry("generate function")  # the call is checked by `resolve_generate`
_BATCH_KWARGS = {"n": 1, "sampling": None, "tokenizer": None, "seed": 0, "step": 0, "first_group": 0,
                 "routed_experts": False, "config": None}


def resolve_generate(name_or_path: str) -> GenerateFunction:
    """A built-in generate function by name, or a user function by import path (imported now), checked
    against the call its form gets: ``(ctx, record, *, group_index, seed)`` for a coroutine function,
    ``(engine, prompts, *, n, sampling, tokenizer, seed, step, first_group, routed_experts, config)``
    for a plain one."""
    if not GENERATE_FUNCTIONS.names():
        for name, fn in _builtins().items():
            GENERATE_FUNCTIONS.register(name)(fn)
    fn = GENERATE_FUNCTIONS.resolve(name_or_path)
    per_group = inspect.iscoroutinefunction(fn)
    try:
        if per_group:
            inspect.signature(fn).bind(None, None, group_index=0, seed=0)
        else:
            inspect.signature(fn).bind(None, None, **_BATCH_KWARGS)
    except TypeError as e:
        form = ("an async generate function must accept (ctx, record, *, group_index, seed)" if per_group else
                "a plain generate function must accept (engine, prompts, *, n, sampling, tokenizer, seed, step, "
                "first_group, routed_experts, config)")
        raise PluginError(f"generate function {name_or_path!r}: {form}: {e}") from None
    except ValueError:  # a builtin without a signature: nothing to check
        pass
    return _wrap(name_or_path, fn)


def generate_groups(generate: str | GenerateFunction, engine: InferenceEngine, prompts: Sequence[PromptRecord], *,
                    n: int, sampling: SamplingConfig, tokenizer: Any, seed: int = 0, step: int = 0,
                    first_group: int = 0, routed_experts: bool = False, config: Any = None) -> list[Sample]:
    """Run a generate function (a name, an import path or a resolved one) over ``prompts`` outside the
    loop, as one synchronous step does: for scripts, benchmarks and tests."""
    fn = resolve_generate(generate) if isinstance(generate, str) else generate
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, n=n, sampling=sampling, routed_experts=routed_experts,
                         config=config, seed=seed)
    return fn.run_step(ctx, prompts, step=step, seed=seed, first_group=first_group)
