"""Request and response bodies of the session server (OpenAI chat-completions compatible).

Validation lives here, so a malformed body is answered with 422 naming the field (``loc``). Fields the
server does not support are rejected by name rather than ignored (``stop`` strings, ``n > 1``,
``top_logprobs``, a ``tool_choice`` other than ``auto``/``none``); unknown extra fields are ignored, as
OpenAI clients send some (``stream_options``, ``user``, ...). Extensions: ``top_k``, ``ignore_eos``
(generate exactly ``max_tokens`` tokens, as vLLM's) and ``return_token_ids`` (the turn's token ids in
the response).

Numbers are bounded: floats must be finite (``NaN``, ``Infinity`` and overflowing literals such as
``1e999`` are refused, in the sampling fields and inside ``metadata`` and tool ``parameters``, which
the server echoes back as JSON), and integers that reach the engine stay within int32.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatCompletion",
    "ChatCompletionRequest",
    "ChatMessage",
    "CreateSession",
    "ErrorBody",
    "SessionCreated",
    "SessionView",
]

MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1  # token counts and top-k: what any engine's kernels take
MAX_JSON_DEPTH = 64
# Below these, float32 sampling degenerates (logits / T overflows; top-p keeps no token): the engine
# fails the step. Rejected here with a 422 instead.
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6


def valid_text(text: str) -> str:
    """``text``, or ValueError if it holds a lone UTF-16 surrogate (not valid Unicode text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text holds a lone UTF-16 surrogate {text[e.start]!r} at position {e.start} (not valid "
                         "Unicode)") from None
    return text


def finite_json(value: Any, *, depth: int = 0, numbers: bool = True) -> Any:
    """``value`` (parsed JSON) unchanged, or ValueError for a non-finite float (unless ``numbers`` is false:
    the schema's fields check their own), a string holding a lone UTF-16 surrogate (JSON's ``\\ud800`` escapes
    decode to one; it cannot be encoded back) or nesting deeper than 64."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if numbers and isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number (JSON has no NaN or Infinity)")
    if isinstance(value, str):
        valid_text(value)
    if isinstance(value, dict):
        for k, v in value.items():
            valid_text(str(k))
            finite_json(v, depth=depth + 1, numbers=numbers)
    elif isinstance(value, list):
        for v in value:
            finite_json(v, depth=depth + 1, numbers=numbers)
    return value


class FunctionCall(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(default="{}", max_length=1_000_000)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _finite_parameters(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return finite_json(v)


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    temperature: float | None = Field(default=None, ge=0, le=100, description="0 (greedy) or in [1e-4, 100]")
    top_p: float | None = Field(default=None, ge=MIN_TOP_P, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT32)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    n: int | None = Field(default=None, ge=1, le=1, description="only 1 is supported (one trajectory per session)")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0,
                                     description="only 0: the engine returns the sampled token's log-prob")
    stop: str | list[str] | None = Field(default=None, description="not supported: stop strings would cut tokens")
    ignore_eos: bool = False
    return_token_ids: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        # every string of the request is valid Unicode (no lone surrogate); numbers: the fields' own checks
        finite_json(data, numbers=False)
        return data

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"temperature={v} is below {MIN_TEMPERATURE}: use 0 for greedy decoding")
        return v

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, v: str | list[str] | None) -> None:
        if v:
            raise ValueError("stop strings are not supported (the server never cuts the model's tokens); "
                             "the tokenizer's end-of-turn token ends a turn")
        return None


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] = Field(default_factory=dict)
    max_turns: int | None = Field(default=None, ge=1, le=MAX_INT32)

    @field_validator("metadata")
    @classmethod
    def _finite_metadata(cls, v: dict[str, Any]) -> dict[str, Any]:
        return finite_json(v)


class SessionCreated(BaseModel):
    id: str
    base_url: str = Field(description="the OpenAI base URL of this session (append /chat/completions)")


class TurnView(BaseModel):
    start: int
    end: int
    finish_reason: str
    weight_versions: list[int]
    num_tool_calls: int
    num_invalid_tool_calls: int


class SessionView(BaseModel):
    id: str
    status: Literal["active", "truncated"]
    status_reason: str | None
    metadata: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    token_ids: list[int]
    loss_mask: list[int] = Field(description="1 on model tokens, 0 on tokens the template rendered")
    log_probs: list[float | None] = Field(description="the rollout log-prob of each model token; null elsewhere")
    weight_versions: list[int]
    turns: list[TurnView]
    stats: dict[str, int]
    last_error: dict[str, Any] | None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None
    info: dict[str, Any] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
