"""Sessions: TITO trajectories served by an inference engine, one generation per chat turn.

`SessionStore` is the engine-facing half of the session server (tandem/rollout/server.py puts HTTP in
front of it; the ``multi_turn`` generate function uses it directly). A session owns a `Trajectory`
(tandem/rollout/tito.py). A chat-completion turn:

1. checks the request's messages extend the stored ones (or repeat the last turn's request: a retry,
   which rolls that turn back), renders and appends the new messages' tokens, and runs the drift
   checks, all on a copy of the trajectory;
2. generates from the stored token ids with the engine (``agenerate``: concurrent sessions share the
   engine's batch);
3. appends the model's tokens and log-probs, parses tool calls, and only then replaces the session's
   trajectory with the copy. A failure at any point leaves the session exactly as it was.

Limits: ``max_sessions`` (creating more raises `TooManySessionsError`), ``max_turns`` and the context
(``max_context_tokens``, by default the engine's ``info.max_context``). A session that reaches one is
*truncated*: the turn that hits the context keeps its tokens (finish reason ``length``), and every later
request answers at once with finish reason ``length`` and no tokens, so an agent loop ends normally.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.core.protocols import FinishReason, GenerationRequest, InferenceEngine, SamplingParams
from tandem.rollout.chat import ChatTemplate, TemplateRenderError
from tandem.rollout.tito import HistoryMismatchError, TokenDriftError, Trajectory, public_message

__all__ = [
    "EngineUnavailableError",
    "Session",
    "SessionConfig",
    "SessionNotFoundError",
    "SessionStore",
    "TooManySessionsError",
    "TurnOutcome",
    "TurnRequest",
]


class SessionNotFoundError(KeyError):
    """No session with this id (never created, deleted, or expired)."""


class TooManySessionsError(RuntimeError):
    """``max_sessions`` sessions are open."""


class EngineUnavailableError(RuntimeError):
    """The engine failed or aborted the generation; the session is unchanged and the turn can be retried."""


@dataclass(kw_only=True, slots=True)
class SessionConfig:
    """Limits and checks of the sessions a store serves."""

    max_sessions: int = 1024
    max_turns: int = 64  # model generations per session
    max_context_tokens: int | None = None  # None: the engine's max_model_len
    default_max_tokens: int = 256  # per turn, when the request names none
    max_tokens_cap: int | None = None  # requests asking for more get this many
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    max_trailing_trim: int = 1  # stop tokens that may be trimmed from a turn (tito.py)
    verify_tokens: bool = True  # the token-level drift check at every turn (the text check always runs)
    session_ttl_s: float = 3600.0  # idle sessions older than this are dropped when new ones are made
    chat_template: str | None = None  # a .jinja file replacing the tokenizer's template

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_turns", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens={self.max_context_tokens} must be >= 2")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap={self.max_tokens_cap} must be >= 1 (or None)")
        if self.max_trailing_trim < 0:
            raise ValueError(f"max_trailing_trim={self.max_trailing_trim} must be >= 0")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s={self.session_ttl_s} must be > 0")


@dataclass(kw_only=True, slots=True)
class TurnRequest:
    """One chat-completion request, already validated (server.py builds it from the HTTP body)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    lora: str | None = None  # a LoRA adapter the engine serves (GenerationRequest.lora); None: its default


@dataclass(kw_only=True, slots=True)
class TurnOutcome:
    message: dict[str, Any]  # the assistant message (OpenAI form)
    finish_reason: str  # OpenAI: "stop", "length" or "tool_calls"
    token_ids: list[int]
    log_probs: list[float]
    prompt_tokens: int
    weight_versions: list[int]
    turn_index: int
    retried: bool = False


@dataclass(kw_only=True)
class Session:
    id: str
    trajectory: Trajectory
    max_turns: int
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling_override: dict[str, float | int] | None = None  # temperature/top_p/top_k the session forces
    max_tokens: int | None = None  # the session's own cap per turn
    seed: int | None = None  # turn seeds derive from it (and the generation count)
    status: str = "active"  # active | truncated
    status_reason: str | None = None  # truncated: context_full | max_turns
    last_error: dict[str, Any] | None = None
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    num_generations: int = 0
    closed: bool = False
    inflight_request_id: str | None = None
    _lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def summary(self) -> dict[str, Any]:
        """The trajectory as GET /sessions/{id} returns it."""
        t = self.trajectory
        return {
            "id": self.id, "status": self.status, "status_reason": self.status_reason,
            "metadata": self.metadata, "messages": [public_message(m) for m in t.messages], "tools": t.tools,
            "token_ids": list(t.ids), "loss_mask": t.loss_mask, "log_probs": list(t.log_probs),
            "weight_versions": t.weight_versions(),
            "turns": [{"start": u.start, "end": u.end, "finish_reason": u.finish_reason,
                       "weight_versions": u.weight_versions, "num_tool_calls": u.num_tool_calls,
                       "num_invalid_tool_calls": u.num_invalid_tool_calls} for u in t.turns],
            "stats": dict(t.stats), "last_error": self.last_error,
        }


def _mix_seed(base: int, k: int) -> int:
    h = (base * 0x9E3779B1 + k * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFFFFFF
    return (h ^ (h >> 23)) & 0x7FFFFFFF


class SessionStore:
    """Sessions over one engine and one chat template (see the module docstring)."""

    def __init__(self, engine: InferenceEngine, template: ChatTemplate, config: SessionConfig | None = None, *,
                 routed_experts: bool = False) -> None:
        self.engine = engine
        self.routed_experts = routed_experts  # ask the engine for MoE routing (kept per turn, for R3)
        self.template = template
        self.config = config or SessionConfig()
        engine_limit = engine.info.max_context
        self.context_limit = min(self.config.max_context_tokens or engine_limit, engine_limit)
        stops = [*self.config.stop_token_ids, *([template.eos_token_id] if template.eos_token_id is not None else [])]
        self.stop_token_ids = tuple(dict.fromkeys(stops))
        self.sessions: dict[str, Session] = {}
        self.counters = {"sessions_created": 0, "turns": 0, "drift_errors": 0, "engine_errors": 0,
                         "history_mismatches": 0, "retries": 0}

    # -- lifecycle ------------------------------------------------------------------------------------

    def create(self, *, metadata: dict[str, Any] | None = None, max_turns: int | None = None,
               sampling_override: dict[str, float | int] | None = None, max_tokens: int | None = None,
               seed: int | None = None) -> Session:
        self._expire()
        if len(self.sessions) >= self.config.max_sessions:
            raise TooManySessionsError(
                f"{len(self.sessions)} sessions are open; max_sessions={self.config.max_sessions}: delete some"
            )
        if max_turns is not None and not 1 <= max_turns <= self.config.max_turns:
            raise ValueError(f"max_turns={max_turns} must be in [1, {self.config.max_turns}]")
        sid = uuid.uuid4().hex
        traj = Trajectory(stop_token_ids=frozenset(self.stop_token_ids),
                          max_trailing_trim=self.config.max_trailing_trim, verify_tokens=self.config.verify_tokens)
        session = Session(id=sid, trajectory=traj, max_turns=max_turns or self.config.max_turns,
                          metadata=dict(metadata or {}), sampling_override=sampling_override,
                          max_tokens=max_tokens, seed=seed)
        self.sessions[sid] = session
        self.counters["sessions_created"] += 1
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(session_id)
        session.last_used = time.monotonic()
        return session

    def delete(self, session_id: str) -> Session:
        """Close a session (aborting its running generation, if any) and forget it."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise SessionNotFoundError(session_id)
        session.closed = True
        if session.inflight_request_id is not None:
            self.engine.abort(session.inflight_request_id)
        return session

    def rollback(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.lock.locked():
            raise HistoryMismatchError("a completion is running on this session: roll back after it returns")
        work = session.trajectory.fork()
        work.rollback()
        session.trajectory = work
        session.status, session.status_reason = "active", None
        return session

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.config.session_ttl_s
        for sid in [s.id for s in self.sessions.values() if s.last_used < cutoff and not s.lock.locked()]:
            self.delete(sid)

    # -- a turn ---------------------------------------------------------------------------------------

    async def complete(self, session: Session, request: TurnRequest) -> TurnOutcome:
        """Run one chat turn (module docstring). Raises the errors of `Trajectory.prepare`,
        `EngineUnavailableError` and `SessionNotFoundError` (deleted meanwhile); the session is unchanged then."""
        async with session.lock:
            if session.closed:
                raise SessionNotFoundError(session.id)
            work = session.trajectory.fork()
            try:
                _, retried = work.prepare(request.messages, request.tools, self.template)
            except (TokenDriftError, HistoryMismatchError, TemplateRenderError) as e:
                if isinstance(e, TokenDriftError):
                    self.counters["drift_errors"] += 1
                elif isinstance(e, HistoryMismatchError):
                    self.counters["history_mismatches"] += 1
                session.last_error = {"type": type(e).__name__, "message": str(e), **getattr(e, "info", {})}
                raise
            self.counters["retries"] += retried
            if session.status == "truncated" and not retried:  # a retry rolls back the turn that truncated it
                return self._truncated(session, work, retried)
            if len(work.turns) >= session.max_turns:
                return self._truncated(session, work, retried, reason="max_turns")
            if len(work.ids) >= self.context_limit:
                return self._truncated(session, work, retried, reason="context_full")
            try:
                completion = await self._generate(session, work, request)
            except EngineUnavailableError as e:
                session.last_error = {"type": type(e).__name__, "message": str(e)}
                raise
            if session.closed:
                raise SessionNotFoundError(session.id)
            message = work.add_model_turn(
                completion.token_ids, completion.log_probs, finish_reason=completion.finish_reason.value,
                weight_versions=completion.weight_versions, template=self.template,
                call_id_prefix=f"call_{session.id[:8]}_",
            )
            work.turns[-1].routed_experts = completion.routed_experts
            session.trajectory = work
            session.status, session.status_reason, session.last_error = "active", None, None
            self.counters["turns"] += 1
            if completion.finish_reason == FinishReason.LENGTH and len(work.ids) >= self.context_limit:
                session.status, session.status_reason = "truncated", "context_full"
            turn = work.turns[-1]
            finish = "tool_calls" if message.get("tool_calls") else (
                "length" if completion.finish_reason == FinishReason.LENGTH else "stop")
            return TurnOutcome(message=message, finish_reason=finish, token_ids=list(completion.token_ids),
                               log_probs=list(completion.log_probs), prompt_tokens=turn.start,
                               weight_versions=list(completion.weight_versions), turn_index=len(work.turns) - 1,
                               retried=retried)

    def _truncated(self, session: Session, work: Trajectory, retried: bool, reason: str | None = None) -> TurnOutcome:
        if reason is not None:
            session.status, session.status_reason = "truncated", reason
        return TurnOutcome(message={"role": "assistant", "content": None}, finish_reason="length", token_ids=[],
                           log_probs=[], prompt_tokens=len(work.ids), weight_versions=[],
                           turn_index=len(work.turns), retried=retried)

    async def _generate(self, session: Session, work: Trajectory, request: TurnRequest):
        sampling = self._sampling(session, request, room=self.context_limit - len(work.ids))
        gen = GenerationRequest(prompt_token_ids=list(work.ids), sampling=sampling, session_id=session.id,
                                lora=request.lora,
                                request_id=f"{session.id}-{session.num_generations}-{uuid.uuid4().hex[:8]}")
        session.num_generations += 1
        session.inflight_request_id = gen.request_id
        try:
            result = await self.engine.agenerate(gen)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any engine failure leaves the session intact
            self.counters["engine_errors"] += 1
            raise EngineUnavailableError(f"the engine failed: {type(e).__name__}: {e}") from None
        finally:
            session.inflight_request_id = None
        completion = result.completions[0] if result.completions else None
        if completion is None or completion.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) \
                or not completion.token_ids:
            if session.closed:
                raise SessionNotFoundError(session.id)
            self.counters["engine_errors"] += 1
            why = (completion.error if completion else None) or result.error or "the generation was aborted"
            raise EngineUnavailableError(f"the engine did not complete the turn: {why}")
        return completion

    def _sampling(self, session: Session, request: TurnRequest, *, room: int) -> SamplingParams:
        forced = session.sampling_override or {}
        temperature = forced.get("temperature", request.temperature if request.temperature is not None else 1.0)
        top_p = forced.get("top_p", request.top_p if request.top_p is not None else 1.0)
        top_k = forced.get("top_k", request.top_k if request.top_k is not None else 0)
        limits = [request.max_tokens or self.config.default_max_tokens, room]
        limits += [x for x in (self.config.max_tokens_cap, session.max_tokens) if x is not None]
        if request.seed is not None:
            seed = request.seed
        elif session.seed is not None:
            seed = _mix_seed(session.seed, session.num_generations)
        else:
            seed = None
        return SamplingParams(
            temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), max_new_tokens=max(1, min(limits)),
            stop_token_ids=() if request.ignore_eos else self.stop_token_ids, seed=seed,
            return_routed_experts=self.routed_experts,
        )

    def health(self) -> dict[str, Any]:
        return {"sessions": len(self.sessions), "context_limit": self.context_limit, **self.counters}
