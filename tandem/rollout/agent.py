"""Multi-turn and agentic generate functions: conversations with tools, turned into `Sample`s.

Both are async per-group generate functions (tandem/rollout/functions.py), so every loop mode runs
them, fully-async included, and read their settings from the run's ``rollout.agent`` section
(`AgentConfig`). Every episode is one session of a
`SessionStore` (tandem/rollout/session.py), so the token ids, loss mask and log-probs are the
server's TITO record, never a re-tokenization:

* ``multi_turn``: the framework drives the conversation. The model answers; its ``<tool_call>`` blocks
  run against ``agent.tools`` (Python functions, ``module:function``) and the results go back as tool
  messages; without a call, ``agent.environment`` (``module:function(messages, metadata) -> str | None``)
  may reply as the user; the episode ends when neither has more to say, or at ``max_turns``.
* ``agentic_tool_call``: the episode is user code, ``agent.function`` =
  ``module:function(base_url, prompt, metadata) -> reward | result``. It talks to an in-process session
  server on 127.0.0.1 with any OpenAI client (``OpenAI(base_url=base_url, api_key="tandem")``), one
  session per episode. The server needs a key made for this rollout (``secrets.token_urlsafe``), which
  ``base_url`` carries (``http://127.0.0.1:<port>/key/<key>/sessions/<id>/v1``), so whatever ``api_key``
  the client sends, only code given a base URL reaches the server: not another process or user. A plain function runs in a worker thread; an ``async def`` runs on the event loop.
  ``metadata`` holds the record's metadata plus ``label``, ``prompt_index``, ``sample_index``.
  What it returns: a number (or a bool) is the reward, kept in ``metadata["agent_reward"]`` for the
  reward term ``tandem.rollout.agent:agent_reward``; a string is the final answer (``sample.response``)
  for any reward; a dict may hold ``reward`` and ``response`` (the rest goes to
  ``metadata["agent_result"]``); None leaves the final assistant message as the response.

The session store (and for ``agentic_tool_call`` the HTTP server) is a resource of the rollout's
context: made once per rollout (a step, or the whole fully-async producer) on its event loop and
shared by every group in it; the engine work runs on that loop, as ``single_turn``'s does. Sessions sample with the run's ``rollout.sampling`` whatever the agent asks
(temperature, top-p, top-k, and at most ``max_new_tokens`` per turn), so the rollout log-probs are the
behaviour policy's.

Samples (``agent.samples``): ``trajectory`` gives one per episode, the response being everything after
the first model token (tool results and user turns in it have loss mask 0); ``turn`` gives one per
model turn, each with the whole history before it as the prompt, all sharing the episode's reward.

Failures: an episode is limited to ``timeout_s`` and retried from scratch (a fresh session) up to
``max_retries`` times. Then its samples are ABORTED with ``metadata["status_reason"]`` one of
``timeout``, ``agent_error``, ``environment_error``, ``engine_error``, ``token_drift``. A conversation
that fills the context or reaches ``max_turns`` is TRUNCATED (``context_full``, ``max_turns``), as is
one whose last turn hit ``max_new_tokens`` (``max_tokens``). `agent_metrics` counts the reasons.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import inspect
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.core.sample import Sample, SampleStatus
from tandem.plugins import load_callable
from tandem.rollout.data import PromptRecord
from tandem.rollout.generate import SamplingConfig

__all__ = ["AgentConfig", "agent_metrics", "agent_reward", "agentic_tool_call", "multi_turn"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """The recipe's ``rollout.agent`` section (module docstring)."""

    function: str | None = None  # agentic_tool_call: 'module:function(base_url, prompt, metadata)'
    tools: list[str] = field(default_factory=list)  # multi_turn: 'module:function' tool implementations
    environment: str | None = None  # multi_turn: 'module:function(messages, metadata) -> str | None'
    system_prompt: str | None = None  # multi_turn: prepended when the prompt has no system message
    samples: Literal["trajectory", "turn"] = "trajectory"
    max_turns: int = 8  # model generations per episode
    max_context_tokens: int | None = None  # None: the engine's max_model_len
    timeout_s: float = 300.0  # per episode attempt
    max_retries: int = 1  # fresh attempts after a failure or timeout
    max_concurrency: int = 64  # episodes in flight (and worker threads for plain-function agents/tools)
    tool_timeout_s: float = 30.0  # multi_turn: per tool call (a timeout becomes an error result)
    verify_tokens: bool = True  # the token-level drift check at every turn
    chat_template: str | None = None  # a .jinja file to use instead of the tokenizer's template

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("timeout_s", "tool_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries} must be >= 0")
        for spec in [self.function, self.environment, *self.tools]:
            if spec is not None and (spec.count(":") != 1 or not all(spec.split(":"))):
                raise ValueError(f"{spec!r} is not an import path of the form 'module.path:function'")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template={self.chat_template!r} is not a file")


# -- rewards and metrics ------------------------------------------------------------------------------------


def agent_reward(sample: Sample) -> float:
    """Reward term for agents that return their reward: ``metadata["agent_reward"]``."""
    if "agent_reward" not in sample.metadata:
        raise ValueError("the agent returned no reward (metadata has no 'agent_reward')")
    return float(sample.metadata["agent_reward"])


def agent_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Counts of status reasons (``agent/<status>/<reason>``), mean turns and tool calls per episode."""
    out: dict[str, float] = {}
    for (status, reason), k in Counter(
        (s.status.value, s.metadata.get("status_reason")) for s in samples if s.metadata.get("status_reason")
    ).items():
        out[f"agent/{status}/{reason}"] = float(k)
    episodes = {(s.group_index, s.metadata.get("sample_index")): s for s in samples}.values()
    if episodes:
        out["agent/turns_mean"] = sum(s.metadata.get("num_turns", 0) for s in episodes) / len(episodes)
        out["agent/tool_calls_mean"] = sum(s.metadata.get("num_tool_calls", 0) for s in episodes) / len(episodes)
    return out


# -- the generate functions ---------------------------------------------------------------------------------


async def multi_turn(ctx, record: PromptRecord, *, group_index: int, seed: int) -> list[Sample]:
    """Framework-driven tool/user conversations (module docstring): ``ctx.n`` episodes of one prompt."""
    agent = _agent_config(ctx.config)
    tools = _load_tools(tuple(agent.tools))
    env = _load(agent.environment, "rollout.agent.environment", 2) if agent.environment else None

    def episode(store, session, ep: _Episode, runner: _Runner):
        return _tool_episode(store, session, ep, runner, tools=tools, environment=env)

    runner = await ctx.resource("tandem.agent.direct", lambda: _Runner(ctx, agent, http=False))
    return await runner.group(record, group_index=group_index, n=ctx.n, seed=seed, episode_fn=episode)


async def agentic_tool_call(ctx, record: PromptRecord, *, group_index: int, seed: int) -> list[Sample]:
    """User agents over the session server (module docstring): ``ctx.n`` episodes of one prompt."""
    agent = _agent_config(ctx.config)
    if agent.function is None:
        raise ValueError("rollout.agent.function is not set: agentic_tool_call needs "
                         "'module:function(base_url, prompt, metadata)'")
    fn = _load(agent.function, "rollout.agent.function", 3)

    async def episode(store, session, ep: _Episode, runner: _Runner):
        base_url = f"{runner.base_url}/sessions/{session.id}/v1"
        if inspect.iscoroutinefunction(fn):
            return await fn(base_url, ep.record.prompt, ep.metadata)
        return await asyncio.get_running_loop().run_in_executor(runner.pool, fn, base_url, ep.record.prompt,
                                                                ep.metadata)

    runner = await ctx.resource("tandem.agent.http", lambda: _Runner(ctx, agent, http=True))
    return await runner.group(record, group_index=group_index, n=ctx.n, seed=seed, episode_fn=episode)


# -- running episodes ---------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Episode:
    record: PromptRecord
    group_index: int
    sample_index: int
    seed: int

    @property
    def metadata(self) -> dict[str, Any]:
        return {**self.record.metadata, "label": self.record.label, "prompt_index": self.record.index,
                "sample_index": self.sample_index}


class _EnvironmentError(RuntimeError):
    """The multi_turn environment function raised."""


def _agent_config(config: Any) -> AgentConfig:
    agent = getattr(config, "agent", None)
    return agent if isinstance(agent, AgentConfig) else AgentConfig()


@functools.lru_cache(maxsize=64)
def _load(spec: str, what: str, params: int) -> Callable[..., Any]:
    return load_callable(spec, what=what, required_params=params)


@functools.lru_cache(maxsize=16)
def _load_tools(specs: tuple[str, ...]) -> dict[str, Any]:
    from tandem.rollout.tools import as_tool

    tools = [as_tool(load_callable(s, what="rollout.agent.tools"), where=s) for s in specs]
    return {t.name: t for t in tools}


class _Runner:
    """The session store (and, for user agents, the HTTP session server) that the episodes of every
    group of one rollout share: a resource of the `RolloutContext`, entered once on its event loop.
    ``max_concurrency`` bounds the episodes in flight over all groups."""

    def __init__(self, ctx, agent: AgentConfig, *, http: bool):
        from tandem.rollout.chat import ChatTemplate
        from tandem.rollout.session import SessionConfig, SessionStore

        if ctx.tokenizer is None:
            raise ValueError("tokenizer is required (the loop passes the policy's tokenizer)")
        sampling = ctx.sampling or SamplingConfig()
        template_source = Path(agent.chat_template).read_text() if agent.chat_template else None
        self.template = ChatTemplate(ctx.tokenizer, chat_template=template_source)
        self.store = SessionStore(ctx.engine, self.template, SessionConfig(
            max_sessions=max(1, agent.max_concurrency) * (agent.max_retries + 2), max_turns=agent.max_turns,
            max_context_tokens=agent.max_context_tokens, default_max_tokens=sampling.max_new_tokens,
            max_tokens_cap=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids),
            verify_tokens=agent.verify_tokens,
        ), routed_experts=ctx.routed_experts)
        self.agent, self.sampling, self.tokenizer, self.http = agent, sampling, ctx.tokenizer, http
        self.stopping = ctx.stopping
        self.pool: cf.ThreadPoolExecutor | None = None
        self.base_url = ""
        self._server: Any = None
        self._gate: asyncio.Semaphore | None = None

    async def __aenter__(self) -> _Runner:
        from tandem.rollout.server import KEY_PREFIX, RunningServer, ServerConfig, create_app

        self.pool = cf.ThreadPoolExecutor(max_workers=self.agent.max_concurrency, thread_name_prefix="tandem-agent")
        self._gate = asyncio.Semaphore(self.agent.max_concurrency)
        if self.http:
            key = secrets.token_urlsafe(32)  # local processes reach 127.0.0.1 too: the server needs a key
            app = create_app(self.store, ServerConfig(model_name="policy", sessions=self.store.config,
                                                      api_key=key, key_in_path=True))
            self._server = RunningServer(app)
            try:
                self.base_url = f"{(await self._server.__aenter__()).base_url}{KEY_PREFIX}{key}"
            except BaseException:
                self.pool.shutdown(wait=False, cancel_futures=True)
                raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self._server is not None:
                await self._server.__aexit__(*exc)
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)

    async def group(self, record: PromptRecord, *, group_index: int, n: int, seed: int, episode_fn) -> list[Sample]:
        episodes = [_Episode(record=record, group_index=group_index, sample_index=i, seed=seed * 1_000_003 + i)
                    for i in range(n)]

        async def one(ep: _Episode) -> list[Sample]:
            async with self._gate:
                return await self._with_retries(ep, episode_fn)

        per_episode = await asyncio.gather(*(one(ep) for ep in episodes))
        samples = [s for group in per_episode for s in group]
        for i, s in enumerate(samples):
            s.index = i
        return samples

    def _level(self) -> int:
        """Episode failures are warnings, except while the rollout shuts down (the engine aborts them)."""
        return logging.DEBUG if self.stopping() else logging.WARNING

    async def _with_retries(self, ep: _Episode, episode_fn) -> list[Sample]:
        s = self.sampling
        reasons: list[str] = []
        for attempt in range(self.agent.max_retries + 1):
            session = self.store.create(
                metadata=ep.metadata, sampling_override={"temperature": s.temperature, "top_p": s.top_p,
                                                         "top_k": s.top_k},
                max_tokens=s.max_new_tokens, seed=(ep.seed + 7919 * attempt) & 0x7FFFFFFF,
            )
            try:
                result = await asyncio.wait_for(episode_fn(self.store, session, ep, self), self.agent.timeout_s)
            except TimeoutError:
                reasons.append("timeout")
            except _EnvironmentError as e:
                reasons.append("environment_error")
                log.log(self._level(), "episode %s: environment failed: %s", ep.metadata, e.__cause__ or e)
            except Exception as e:  # noqa: BLE001 - an agent bug aborts its episode, not the run
                reasons.append(_failure_reason(session))
                log.log(self._level(), "episode (prompt %d, sample %d) attempt %d failed: %s: %s", ep.record.index,
                        ep.sample_index, attempt, type(e).__name__, e)
            else:
                return _session_samples(session, ep, result, samples=self.agent.samples, tokenizer=self.tokenizer)
            finally:
                with contextlib.suppress(KeyError):
                    self.store.delete(session.id)
        return [_aborted_sample(ep, reasons)]


def _failure_reason(session) -> str:
    kind = (session.last_error or {}).get("type")
    return {"TokenDriftError": "token_drift", "EngineUnavailableError": "engine_error"}.get(kind, "agent_error")


async def _tool_episode(store, session, ep: _Episode, runner: _Runner, *, tools: dict[str, Any],
                        environment: Callable[..., Any] | None) -> None:
    from tandem.rollout.session import TurnRequest

    agent = runner.agent
    messages = _initial_messages(ep.record.prompt, agent.system_prompt)
    schemas = [t.schema for t in tools.values()] or None
    loop = asyncio.get_running_loop()
    for _ in range(agent.max_turns):
        outcome = await store.complete(session, TurnRequest(messages=list(messages), tools=schemas))
        if not outcome.token_ids or outcome.finish_reason == "length":
            return None
        messages.append(outcome.message)
        calls = outcome.message.get("tool_calls") or []
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                             "content": await _call_tool(tools, call, runner, loop)})
        if calls:
            continue
        if environment is None:
            return None
        try:
            reply = await loop.run_in_executor(runner.pool, environment, list(messages), ep.metadata)
        except Exception as e:
            raise _EnvironmentError(str(e)) from e
        if reply is None:
            return None
        messages.append({"role": "user", "content": str(reply)})
    return None


async def _call_tool(tools: dict[str, Any], call: dict[str, Any], runner: _Runner, loop) -> str:
    """The tool's result text; an unknown tool, bad arguments, an exception or a timeout become error text
    (the model sees it, as it would see any tool failing)."""
    import json

    name = call["function"]["name"]
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r} (available: {', '.join(sorted(tools))})"
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
        return await asyncio.wait_for(loop.run_in_executor(runner.pool, tool, args), runner.agent.tool_timeout_s)
    except TimeoutError:
        return f"error: tool {name!r} timed out after {runner.agent.tool_timeout_s}s"
    except Exception as e:  # noqa: BLE001 - a tool error is an observation for the model
        return f"error: {type(e).__name__}: {e}"


def _initial_messages(prompt: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and (not messages or messages[0].get("role") != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


# -- sessions to samples ------------------------------------------------------------------------------------


def _apply_result(result: Any, metadata: dict[str, Any]) -> str | None:
    """Record the agent's return value; the response text it names, if any."""
    if isinstance(result, bool | int | float):
        metadata["agent_reward"] = float(result)
    elif isinstance(result, str):
        return result
    elif isinstance(result, dict):
        if "reward" in result:
            metadata["agent_reward"] = float(result["reward"])
        extra = {k: v for k, v in result.items() if k not in ("reward", "response")}
        if extra:
            metadata["agent_result"] = extra
        if "response" in result:
            return str(result["response"])
    elif result is not None:
        raise TypeError(f"the agent returned a {type(result).__name__}; expected a number, str, dict or None")
    return None


def _status(session) -> tuple[SampleStatus, str | None]:
    if session.status == "truncated":
        return SampleStatus.TRUNCATED, session.status_reason
    if session.trajectory.turns[-1].finish_reason == "length":
        return SampleStatus.TRUNCATED, "max_tokens"
    return SampleStatus.COMPLETED, None


def _session_samples(session, ep: _Episode, result: Any, *, samples: str, tokenizer) -> list[Sample]:
    traj = session.trajectory
    metadata = {**ep.metadata, "num_turns": len(traj.turns),
                "num_tool_calls": sum(t.num_tool_calls for t in traj.turns), "tito": dict(traj.stats)}
    try:
        response = _apply_result(result, metadata)
    except TypeError as e:
        return [_aborted_sample(ep, ["agent_error"], status=SampleStatus.FAILED, error=str(e))]
    if not traj.turns:
        return [_aborted_sample(ep, ["no_model_turn"], status=SampleStatus.FAILED,
                                error="the episode ended without asking the model for a turn")]
    if response is None:
        last = traj.messages[traj.turns[-1].message_index]
        response = last.get("content") or ""
    status, reason = _status(session)
    base = dict(prompt=ep.record.prompt, response=response, label=ep.record.label, group_index=ep.group_index)
    if reason:
        metadata["status_reason"] = reason
    lps = [0.0 if lp is None else lp for lp in traj.log_probs]
    if samples == "trajectory":
        start, end = traj.turns[0].start, traj.turns[-1].end
        return [Sample(**base, tokens=traj.ids[:end], response_length=end - start, loss_mask=traj.loss_mask[start:end],
                       rollout_log_probs=lps[start:end], status=status, weight_versions=traj.weight_versions(),
                       rollout_routed_experts=_experts(traj.turns[-1], end), metadata=metadata)]
    out = []
    for k, turn in enumerate(traj.turns):
        turn_status = SampleStatus.TRUNCATED if turn.finish_reason == "length" else SampleStatus.COMPLETED
        if k == len(traj.turns) - 1:
            turn_status = status
        out.append(Sample(**base, tokens=traj.ids[: turn.end], response_length=turn.end - turn.start,
                          loss_mask=[1] * (turn.end - turn.start), rollout_log_probs=lps[turn.start : turn.end],
                          status=turn_status, weight_versions=list(turn.weight_versions),
                          rollout_routed_experts=_experts(turn, turn.end), metadata={**metadata, "turn": k}))
    return out


def _experts(turn, end: int):
    """The turn's routed experts cut to the ``end - 1`` predicted positions (a later trim may drop one)."""
    experts = getattr(turn, "routed_experts", None)
    return None if experts is None else experts[: end - 1]


def _aborted_sample(ep: _Episode, reasons: list[str], *, status: SampleStatus = SampleStatus.ABORTED,
                    error: str | None = None) -> Sample:
    ids = list(ep.record.prompt_token_ids)
    metadata = {**ep.metadata, "status_reason": reasons[-1], "attempt_reasons": reasons, "num_turns": 0,
                "num_tool_calls": 0}
    if error:
        metadata["error"] = error
    return Sample(prompt=ep.record.prompt, tokens=ids, response_length=0, loss_mask=[], rollout_log_probs=[],
                  label=ep.record.label, status=status, group_index=ep.group_index, metadata=metadata)
