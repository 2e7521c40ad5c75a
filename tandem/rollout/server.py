"""The session server: an OpenAI-compatible HTTP API over a `SessionStore` (FastAPI + uvicorn).

Endpoints (the OpenAPI schema is at ``/openapi.json``)::

    GET    /health                                       engine + session counters
    POST   /sessions                                     -> {"id", "base_url"}           201
    GET    /sessions/{id}                                the trajectory: messages, token ids, loss mask,
                                                         log-probs, weight versions, turns, stats
    DELETE /sessions/{id}                                close it; returns the final trajectory
    POST   /sessions/{id}/rollback                       remove the last turn
    POST   /sessions/{id}/v1/chat/completions            OpenAI chat completions (tools, stream: true)
    GET    /sessions/{id}/v1/models                      the served model, for clients that list models

An OpenAI client works unchanged with ``base_url=<server>/sessions/<id>/v1``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: unknown session 404, a
body that does not validate 422 (``param`` names the field), history that does not extend the session
409, token drift 409 (``info`` holds the first differing position), too many sessions 429, a request
larger than ``max_request_bytes`` 413, missing or wrong bearer token 401, engine failure 503 with the
session unchanged (retry the same request). No input gives a 5xx other than the engine's 503: error
bodies never fail to encode what they echo (``SafeJSONResponse``).

With ``key_in_path`` every endpoint is also served under ``/key/<api_key>/`` (`KeyInPath`): the URLs
that the training run's agent runner hands to agents carry its per-run key.

The engine is driven by the event loop that serves the requests (``agenerate``); run the server in the
thread that should do the engine's work (`serve_forever` in the main thread; `RunningServer` inside an
existing event loop, as the agentic generate function does). Streaming sends its chunks when the turn
is complete: the engine protocol returns whole completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import re
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.rollout.chat import TemplateRenderError
from tandem.rollout.openai_schema import (
    ChatCompletion,
    ChatCompletionRequest,
    CreateSession,
    ErrorBody,
    SessionCreated,
    SessionView,
)
from tandem.rollout.session import (
    EngineUnavailableError,
    SessionConfig,
    SessionNotFoundError,
    SessionStore,
    TooManySessionsError,
    TurnOutcome,
    TurnRequest,
)
from tandem.rollout.tito import HistoryMismatchError, TokenDriftError

__all__ = ["RunningServer", "ServerConfig", "create_app", "serve_forever"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_PREFIX = "/key/"
_URL_SAFE = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """The HTTP side of the session server; ``sessions`` holds the per-session limits and checks."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every endpoint but /health needs "Authorization: Bearer <key>"
    # with api_key: /key/<api_key>/... also serves every endpoint, authenticated by its path (the agent
    # runner's base URLs: any OpenAI client works unchanged, whatever api_key it sends)
    key_in_path: bool = False
    max_request_bytes: int = 4 << 20
    model_name: str = "tandem"  # the "model" field of responses
    sessions: SessionConfig = field(default_factory=SessionConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be >= 1024")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")
        if self.key_in_path and (self.api_key is None or not _URL_SAFE.fullmatch(self.api_key)):
            raise ValueError("key_in_path needs an api_key of URL-safe characters (A-Z a-z 0-9 - _)")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str, param: str | None = None,
                 info: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.info = status, message, kind, param, info
        self.headers = headers


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings. JSON cannot encode them, and a response may hold one
    (a 422 echoing a client's ``NaN``, an engine's ``-inf`` log-prob): it would become a 500 instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class SafeJSONResponse(JSONResponse):
    """Every response of the app: JSON with non-finite floats written as strings, never a 500 from encoding."""

    def render(self, content: Any) -> bytes:
        content = _json_safe(content)
        try:
            return super().render(content)
        except UnicodeEncodeError:  # a lone surrogate echoed from the request: escape it (valid JSON)
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error_response(status: int, message: str, *, kind: str, param: str | None = None,
                    info: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                    extra: dict[str, Any] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    if info:
        body["error"]["info"] = jsonable_encoder(info)
    return SafeJSONResponse(body | (extra or {}), status_code=status, headers=headers)


class KeyInPath:
    """ASGI middleware: ``/key/<api_key>/<path>`` is ``/<path>`` with the bearer token ``<api_key>``.

    A capability URL: whoever was given the base URL may use it, with any client and any api_key of its
    own; the prefix becomes the request's ``root_path``, so URLs the server returns keep it. A wrong key
    is a 401 (compared in constant time).
    """

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(KEY_PREFIX):
            given = scope["path"][len(KEY_PREFIX):].partition("/")[0]
            if not hmac.compare_digest(given.encode(), self.key):
                response = _error_response(401, "wrong key in the URL", kind="authentication_error")
                return await response(scope, receive, send)
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"authorization"]
            scope = {**scope, "headers": [*headers, (b"authorization", b"Bearer " + self.key)],
                     "root_path": scope.get("root_path", "") + KEY_PREFIX + given}
        await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes, declared or streamed.

    The body is read (and counted) before the app sees it, then replayed: an error raised while the
    app reads would reach FastAPI's body parser, which reports any read failure as a 400.
    """

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for the disconnect, as the server would
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send) -> None:
        response = _error_response(413, f"request body larger than max_request_bytes={self.limit}",
                                   kind="request_too_large")
        await response(scope, receive, send)


def create_app(store: SessionStore, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``store`` (see the module docstring)."""
    config = config or ServerConfig()
    app = FastAPI(title="Tandem session server", version="1", default_response_class=SafeJSONResponse,
                  description="Token-in-token-out chat sessions for agentic RL rollouts.")
    bearer = HTTPBearer(auto_error=False)

    def check_auth(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if config.api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong bearer token", kind="authentication_error",
                           headers={"WWW-Authenticate": "Bearer"})

    _install_error_handlers(app)
    errors = {404: {"model": ErrorBody}, 401: {"model": ErrorBody}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        engine = store.engine.health()
        return {"status": engine.get("status", "ok"), "engine": engine, "sessions": store.health()}

    @app.post("/sessions", status_code=201, response_model=SessionCreated, dependencies=[Depends(check_auth)],
              responses={429: {"model": ErrorBody}, 401: {"model": ErrorBody}})
    async def create_session(request: Request, body: CreateSession | None = None) -> dict[str, Any]:
        body = body or CreateSession()
        try:
            session = store.create(metadata=body.metadata, max_turns=body.max_turns)
        except TooManySessionsError as e:
            raise ApiError(429, str(e), kind="too_many_sessions") from None
        except ValueError as e:
            raise ApiError(422, str(e), kind="invalid_request_error", param="max_turns") from None
        base = str(request.base_url).rstrip("/")
        return {"id": session.id, "base_url": f"{base}/sessions/{session.id}/v1"}

    @app.get("/sessions/{session_id}", response_model=SessionView, dependencies=[Depends(check_auth)],
             responses=errors)
    async def get_session(session_id: str) -> dict[str, Any]:
        return _session(store, session_id).summary()

    @app.delete("/sessions/{session_id}", response_model=SessionView, dependencies=[Depends(check_auth)],
                responses=errors)
    async def delete_session(session_id: str) -> dict[str, Any]:
        try:
            return store.delete(session_id).summary()
        except SessionNotFoundError:
            raise _not_found(session_id) from None

    @app.post("/sessions/{session_id}/rollback", response_model=SessionView, dependencies=[Depends(check_auth)],
              responses=errors | {409: {"model": ErrorBody}})
    async def rollback(session_id: str) -> dict[str, Any]:
        try:
            return store.rollback(session_id).summary()
        except SessionNotFoundError:
            raise _not_found(session_id) from None
        except HistoryMismatchError as e:
            raise ApiError(409, str(e), kind="conflict") from None

    @app.get("/sessions/{session_id}/v1/models", dependencies=[Depends(check_auth)], responses=errors)
    async def models(session_id: str) -> dict[str, Any]:
        _session(store, session_id)
        adapters = [{"id": name, "object": "model", "owned_by": "tandem", "parent": config.model_name}
                    for name in _adapters(store)]
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "tandem"},
                                           *adapters]}

    @app.post("/sessions/{session_id}/v1/chat/completions", dependencies=[Depends(check_auth)],
              responses=errors | {200: {"model": ChatCompletion}, 409: {"model": ErrorBody},
                                  503: {"model": ErrorBody}})
    async def chat_completions(session_id: str, body: ChatCompletionRequest):
        session = _session(store, session_id)
        turn = TurnRequest(
            messages=[m.model_dump(exclude_none=True) for m in body.messages],
            tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            max_tokens=body.max_completion_tokens or body.max_tokens, seed=body.seed, ignore_eos=body.ignore_eos,
            lora=_adapter(store, body.model),
        )
        outcome = await _run_turn(store, session, turn)
        payload = _completion(store, session.id, outcome, body, config.model_name)
        if body.stream:
            return StreamingResponse(_sse(_json_safe(payload), include_usage=_include_usage(body)),
                                     media_type="text/event-stream")
        return SafeJSONResponse(payload)

    app.add_middleware(BodySizeLimit, limit=config.max_request_bytes)
    if config.key_in_path:
        app.add_middleware(KeyInPath, key=config.api_key)
    return app


def _adapters(store: SessionStore) -> list[str]:
    """The named LoRA adapters the engine serves (engines with ``lora_adapters()``; the synced policy
    adapter is the default, not a name)."""
    listing = getattr(store.engine, "lora_adapters", None)
    return sorted(n for n in listing() if n != "policy") if callable(listing) else []


def _adapter(store: SessionStore, model: str | None) -> str | None:
    """``model`` names an adapter the engine serves (or ``base``): generate with it; any other name (clients
    send their own) means the engine's default."""
    if model == "base" or (model is not None and model in _adapters(store)):
        return model
    return None


def _include_usage(body: ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _session(store: SessionStore, session_id: str):
    try:
        return store.get(session_id)
    except SessionNotFoundError:
        raise _not_found(session_id) from None


def _not_found(session_id: str) -> ApiError:
    return ApiError(404, f"no session {session_id!r} (never created, deleted, or expired)", kind="not_found",
                    param="session_id")


async def _run_turn(store: SessionStore, session, turn: TurnRequest) -> TurnOutcome:
    try:
        return await store.complete(session, turn)
    except SessionNotFoundError:
        raise _not_found(session.id) from None
    except TokenDriftError as e:
        raise ApiError(409, str(e), kind="token_drift", info=e.info) from None
    except HistoryMismatchError as e:
        raise ApiError(409, str(e), kind="history_mismatch", param="messages") from None
    except TemplateRenderError as e:
        raise ApiError(422, str(e), kind="invalid_request_error", param="messages") from None
    except EngineUnavailableError as e:
        raise ApiError(503, f"{e}; the session is unchanged: retry the request", kind="engine_unavailable",
                       headers={"Retry-After": "1"}) from None


def _completion(store: SessionStore, session_id: str, outcome: TurnOutcome, body: ChatCompletionRequest,
                model_name: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": outcome.message, "finish_reason": outcome.finish_reason}
    if body.logprobs:
        tokens = store.template.token_strings(outcome.token_ids)
        choice["logprobs"] = {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(tokens, outcome.log_probs, strict=True)
        ]}
    if body.return_token_ids:
        choice["token_ids"] = outcome.token_ids
    n = len(outcome.token_ids)
    return {
        "id": f"chatcmpl-{session_id[:12]}-{outcome.turn_index}", "object": "chat.completion",
        "created": int(time.time()), "model": model_name, "choices": [choice],
        "usage": {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": n,
                  "total_tokens": outcome.prompt_tokens + n},
    }


async def _sse(payload: dict[str, Any], *, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI ``chat.completion.chunk`` events for a finished completion, then ``[DONE]``."""
    base = {"id": payload["id"], "object": "chat.completion.chunk", "created": payload["created"],
            "model": payload["model"]}
    choice = payload["choices"][0]
    message = choice["message"]

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        chunk = base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
        return f"data: {json.dumps(chunk)}\n\n"

    yield event({"role": "assistant", "content": ""})
    if message.get("content"):
        yield event({"content": message["content"]}, logprobs=choice.get("logprobs"))
    for i, call in enumerate(message.get("tool_calls") or []):
        yield event({"tool_calls": [{"index": i, **call}]})
    yield event({}, choice["finish_reason"])
    if include_usage:
        yield f"data: {json.dumps(base | {'choices': [], 'usage': payload['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc.status, exc.message, kind=exc.kind, param=exc.param, info=exc.info,
                               headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        details = jsonable_encoder(exc.errors(), custom_encoder={BaseException: str})
        first = details[0] if details else {"loc": [], "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        return _error_response(422, f"{param or 'body'}: {first.get('msg')}", kind="invalid_request_error",
                               param=param, extra={"detail": details})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail), kind="http_error", headers=exc.headers)


# -- running it ---------------------------------------------------------------------------------------------


def _uvicorn_config(app, **kw):
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", log_config=None,
                          timeout_graceful_shutdown=2, **kw)


def serve_forever(app, host: str, port: int) -> None:
    """Serve in the calling thread until interrupted (the engine's steps run in this thread)."""
    import uvicorn

    uvicorn.Server(_uvicorn_config(app, host=host, port=port)).run()


class RunningServer:
    """``async with RunningServer(app) as srv:`` serves ``app`` on ``srv.base_url`` in the running event loop.

    Binds 127.0.0.1 on a free port by default. Signals are left alone (the caller owns them).
    """

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.base_url = ""

    async def __aenter__(self) -> RunningServer:
        import uvicorn

        class _Embedded(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without it,
        # Nagle plus delayed ACKs add ~40 ms to every request on loopback (measured)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{host}:{self.port}"
        self._server = _Embedded(_uvicorn_config(self.app))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise its error
                raise RuntimeError("the session server stopped during start-up")
            await asyncio.sleep(0.005)
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sock.close()
