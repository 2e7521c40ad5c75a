"""Token-in-token-out (TITO): a conversation's token ids, owned by the server, appended turn by turn.

A `Trajectory` holds the token ids of one conversation as the model saw and produced them, in *spans*:
environment spans (text the chat template rendered: system, user and tool messages, the generation
prompt; loss mask 0) and model spans (the engine's tokens, exactly as generated; loss mask 1, with
their log-probs). A new turn never re-tokenizes what is stored; it appends only the text that the new
messages add:

    rendered = render(all messages, tools, add_generation_prompt=True)
    delta    = rendered[len(stored text):]          # stored text = decode of the stored ids
    ids     += encode(delta)                        # loss mask 0

Special-token strings that client text (user, tool, system messages, tools) holds are tokenized as
plain text (`ChatTemplate.render_marked`), so a message cannot fake a turn of the template.

Checks, at every turn, before anything is appended (a `TokenDriftError` names the first differing
token position and character; nothing is changed):

1. **text**: the stored text is a prefix of the fresh render. A template that rewrites earlier turns
   (``loop.last``, reasoning dropped from old turns, stripped whitespace) fails here.
2. **tokens**: the ids appended for the new messages are exactly how a fresh tokenization of the whole
   render ends, starting at a token boundary at the same character. A tokenizer that tokenizes a text
   differently on its own than inside the conversation (a prefix space added at the start of a string,
   as SentencePiece tokenizers with a dummy prefix do) fails here. Earlier spans were checked when they
   were appended; the text check guarantees their text has not changed since. A model span that a
   fresh tokenization splits differently (a non-canonical split, bytes that are not valid UTF-8), or
   a fresh token that joins the model's last text with the template's, is not drift: the model chose
   those tokens; TITO keeps them and counts the case in ``stats["model_boundary_merges"]``.

**Trailing trim** (bounded and counted): when the last turn ended on a stop token that the template does
not render at that point (e.g. the model stopped on ``<|endoftext|>`` while the template closes a turn
with ``<|im_end|>``), at most ``max_trailing_trim`` such stop tokens are removed before the next turn
is appended, so the model conditions on the template's end-of-turn instead. ``stats["trimmed_tokens"]``
counts them; they are not trained on.

**Rollback** removes the last turn (its model tokens, the environment tokens appended for it, its
messages) and restores any token trimmed when it was prepared. Sending the same messages as the last
turn's request again rolls that turn back implicitly (an agent, or an HTTP client's automatic retry,
resampling a step).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.rollout.chat import ChatTemplate, Rendered, message_text
from tandem.rollout.tools import parse_tool_calls

__all__ = [
    "HistoryMismatchError", "Span", "TokenDriftError", "Trajectory", "Turn", "canonical_message",
    "first_difference",
]


class TokenDriftError(ValueError):
    """The stored token ids are not a prefix of a fresh render; ``info`` says where."""

    def __init__(self, message: str, **info: Any) -> None:
        super().__init__(message)
        self.info = info


class HistoryMismatchError(ValueError):
    """A request's messages do not start with the session's stored messages (or the tools changed)."""


@dataclass(slots=True)
class Span:
    kind: str  # "env" (template text, loss mask 0) or "model" (generated, loss mask 1)
    start: int  # token range [start, end) in the trajectory's ids
    end: int
    char_start: int  # character range in the trajectory's text
    char_end: int


@dataclass(slots=True)
class _Checkpoint:
    """What a turn changed, so that rollback can undo it."""

    num_ids: int
    num_chars: int
    num_spans: int
    num_messages: int
    last_span: Span | None  # a copy of the last span before the turn (it may have been trimmed)
    tail_ids: list[int]
    tail_log_probs: list[float]
    tail_text: str
    tools: list[dict[str, Any]] | None


@dataclass(slots=True)
class Turn:
    """One model generation: model tokens ``[start, end)``, with what preceded it for rollback."""

    start: int
    end: int
    finish_reason: str  # the engine's: "stop" or "length"
    weight_versions: list[int]
    message_index: int  # the assistant message in ``messages``
    checkpoint: _Checkpoint
    num_tool_calls: int = 0
    num_invalid_tool_calls: int = 0
    routed_experts: Any = None  # MoE: the engine's [prompt + response - 1, layers, topk] routing (R3)


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix of the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _tool_call_key(call: dict[str, Any]) -> tuple[Any, ...]:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return call.get("id"), fn.get("name"), json.dumps(args, sort_keys=True, default=str)


def canonical_message(m: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message when a client echoes the history back (serialisation details aside)."""
    role = "system" if m.get("role") == "developer" else m.get("role")
    calls = tuple(_tool_call_key(c) for c in (m.get("tool_calls") or []))
    return role, message_text(m.get("content")), calls, m.get("tool_call_id"), m.get("name")


def public_message(m: dict[str, Any]) -> dict[str, Any]:
    """A session message without Tandem's private keys, with only the keys that are set."""
    return {k: v for k, v in m.items() if not k.startswith("_") and (v is not None or k == "content")}


@dataclass
class Trajectory:
    """The token ids, loss mask, log-probs, text and messages of one conversation (module docstring)."""

    stop_token_ids: frozenset[int] = frozenset()
    max_trailing_trim: int = 1
    verify_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)  # None on environment tokens
    text: str = ""
    spans: list[Span] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: list[Turn] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: {
        "trimmed_tokens": 0, "model_boundary_merges": 0, "rollbacks": 0, "checks": 0})
    _pending: _Checkpoint | None = field(default=None, repr=False)  # the prepared turn's, until it is added

    @property
    def loss_mask(self) -> list[int]:
        return [0 if lp is None else 1 for lp in self.log_probs]

    def fork(self) -> Trajectory:
        """A copy to prepare a turn on; the session swaps it in only if the turn succeeds."""
        new = copy.copy(self)
        new.ids, new.log_probs, new.messages = list(self.ids), list(self.log_probs), list(self.messages)
        new.spans = [copy.copy(s) for s in self.spans]
        new.turns, new.stats = [copy.copy(t) for t in self.turns], dict(self.stats)
        return new

    # -- preparing a turn ---------------------------------------------------------------------------------

    def prepare(self, request_messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                template: ChatTemplate) -> tuple[int, bool]:
        """Append the new messages' tokens (mutates: call it on a `fork`). Returns (new messages, retried).

        Raises `HistoryMismatchError` if the request does not extend the stored history, `TokenDriftError`
        if a check fails (module docstring), `TemplateRenderError` if the template refuses.
        """
        stored = [canonical_message(m) for m in self.messages]
        request = [canonical_message(m) for m in request_messages]
        retried = False
        if request[: len(stored)] != stored:
            if self.turns and request == stored[: self.turns[-1].message_index]:
                self.rollback()
                retried = True
                stored = stored[: len(self.messages)]
            else:
                i = first_difference(request, stored)
                raise HistoryMismatchError(
                    f"messages[{i}] differs from the session's stored history ({len(stored)} messages): "
                    "send the stored messages unchanged followed by the new ones, or roll the last turn back"
                )
        new = [_session_message(m) for m in request_messages[len(stored):]]
        if not self.turns:
            self.tools = tools or None
        elif (tools or None) != self.tools:
            raise HistoryMismatchError("tools differ from the tools of the session's first turn")
        checkpoint = _Checkpoint(
            num_ids=len(self.ids), num_chars=len(self.text), num_spans=len(self.spans),
            num_messages=len(self.messages), last_span=copy.copy(self.spans[-1]) if self.spans else None,
            tail_ids=[], tail_log_probs=[], tail_text="", tools=self.tools,
        )
        self.messages.extend(new)
        marked = template.render_marked(self.messages, self.tools, add_generation_prompt=True)
        rendered = marked.text
        self._trim_to_prefix_of(rendered, template, checkpoint)
        delta = rendered[len(self.text):]
        delta_ids = template.encode(delta, marked.literal_from(len(self.text)))  # client text stays text
        start, char_start = len(self.ids), len(self.text)
        self.ids += delta_ids
        self.log_probs += [None] * len(delta_ids)
        self.text += delta
        self.spans.append(Span("env", start, len(self.ids), char_start, len(self.text)))
        self._pending = checkpoint
        self.stats["checks"] += 1
        if self.verify_tokens:
            self._check_tokens(marked, template)
        return len(new), retried

    def _trim_to_prefix_of(self, rendered: str, template: ChatTemplate, checkpoint: _Checkpoint) -> None:
        if rendered.startswith(self.text):
            return
        last = self.spans[-1] if self.spans else None
        if last is not None and last.kind == "model" and self.turns and self.turns[-1].finish_reason == "stop":
            for k in range(1, min(self.max_trailing_trim, last.end - last.start - 1) + 1):
                tail = self.ids[-k:]
                if any(t not in self.stop_token_ids for t in tail):
                    break
                kept_text = template.decode(self.ids[last.start : last.end - k])
                if rendered.startswith(self.text[: last.char_start] + kept_text):
                    checkpoint.tail_ids, checkpoint.tail_log_probs = tail, self.log_probs[-k:]
                    checkpoint.tail_text = self.text[last.char_start + len(kept_text):]
                    del self.ids[-k:], self.log_probs[-k:]
                    self.text = self.text[: last.char_start] + kept_text
                    last.end, last.char_end = len(self.ids), len(self.text)
                    checkpoint.num_ids, checkpoint.num_chars = len(self.ids), len(self.text)  # rollback re-adds the tail
                    self.turns[-1].end = last.end
                    self.stats["trimmed_tokens"] += k
                    return
        char = first_difference(self.text, rendered)
        pos = self._token_at_char(char, template)
        raise TokenDriftError(
            f"token drift: the stored conversation is not a prefix of a fresh render of the messages; first "
            f"difference at token {pos} (character {char}): stored {self.text[char:char + 40]!r}, render "
            f"{rendered[char:char + 40]!r}. The chat template renders earlier turns differently once later "
            "messages exist (check it with `tandem verify-template`)",
            kind="text", position=pos, char_position=char,
            stored=self.text[char:char + 80], rendered=rendered[char:char + 80],
        )

    def _token_at_char(self, char: int, template: ChatTemplate) -> int:
        """The index of the stored token that holds character ``char`` of the stored text."""
        span = next((s for s in self.spans if s.char_start <= char < s.char_end), None)
        if span is None:
            return len(self.ids)
        lo, hi = span.start, span.end  # smallest t with len(decode(ids[start:t+1])) > char - char_start
        target = char - span.char_start
        while lo < hi:
            mid = (lo + hi) // 2
            if len(template.decode(self.ids[span.start : mid + 1])) > target:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _check_tokens(self, rendered: Rendered, template: ChatTemplate) -> None:
        """The ids just appended must be how a fresh tokenization of the whole render ends, from a token
        boundary at the same character. Earlier spans were checked when they were appended, and the text
        check guarantees their text has not changed since."""
        fresh = template.encode(rendered.text, rendered.literal)
        if fresh == self.ids:
            return
        env = self.spans[-1]
        delta = self.ids[env.start : env.end]
        head = len(fresh) - len(delta)
        if head >= 0 and fresh[head:] == delta and len(template.decode(fresh[:head])) == env.char_start:
            self.stats["model_boundary_merges"] += 1  # a model span re-tokenizes differently: TITO keeps it
            return
        p = _token_ending_at(fresh, env.char_start, template, lo=0)
        if len(template.decode(fresh[:p])) != env.char_start:
            self.stats["model_boundary_merges"] += 1  # a fresh token joins the model's text and the template's
            return
        j = first_difference(delta, fresh[p:])
        self._token_drift(env.start + j, self.ids, fresh, p + j)

    def _token_drift(self, i: int, stored: list[int], fresh: list[int], j: int) -> None:
        raise TokenDriftError(
            f"token drift: the stored ids differ from a fresh tokenization of the render at token {i} "
            f"(stored {stored[i:i + 4]}, fresh {fresh[j:j + 4]}): tokenizing the new messages on their own "
            "does not give the tokens of the full conversation (e.g. the tokenizer adds a prefix space to "
            "the start of a text)",
            kind="tokens", position=i, stored=stored[i : i + 8], fresh=fresh[j : j + 8],
        )

    # -- committing a generation --------------------------------------------------------------------------

    def add_model_turn(self, token_ids: Sequence[int], log_probs: Sequence[float], *, finish_reason: str,
                       weight_versions: Sequence[int], template: ChatTemplate, call_id_prefix: str) -> dict[str, Any]:
        """Append the engine's tokens after `prepare`; returns the assistant message (OpenAI form)."""
        ids = list(token_ids)
        start, char_start = len(self.ids), len(self.text)
        span_text = template.decode(ids)
        self.ids += ids
        self.log_probs += [float(x) for x in log_probs]
        self.text += span_text
        self.spans.append(Span("model", start, len(self.ids), char_start, len(self.text)))
        ends_on_stop = finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids
        raw = template.decode(ids[:-1]) if ends_on_stop else span_text
        parsed = parse_tool_calls(raw)
        turn_index = len(self.turns)
        calls = [
            {"id": f"{call_id_prefix}{turn_index}_{i}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(parsed.calls)
        ]
        message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls or None, "_raw": raw}
        self.messages.append(message)
        self.turns.append(Turn(
            start=start, end=len(self.ids), finish_reason=finish_reason, weight_versions=list(weight_versions),
            message_index=len(self.messages) - 1, checkpoint=self._pending, num_tool_calls=len(calls),
            num_invalid_tool_calls=parsed.num_invalid,
        ))
        return public_message(message)

    # -- rollback -----------------------------------------------------------------------------------------

    def rollback(self) -> None:
        """Remove the last turn and what was appended for it (see the module docstring)."""
        if not self.turns:
            raise HistoryMismatchError("nothing to roll back: the session has no turn")
        cp = self.turns.pop().checkpoint
        del self.ids[cp.num_ids:], self.log_probs[cp.num_ids:], self.spans[cp.num_spans:]
        del self.messages[cp.num_messages:]
        self.text = self.text[: cp.num_chars]
        if cp.last_span is not None and cp.tail_ids:  # the turn trimmed the previous one: restore it
            self.ids += cp.tail_ids
            self.log_probs += cp.tail_log_probs
            self.text += cp.tail_text
            self.stats["trimmed_tokens"] -= len(cp.tail_ids)
            if self.turns:
                self.turns[-1].end = cp.last_span.end
        if cp.last_span is not None:
            self.spans[-1] = copy.copy(cp.last_span)
        self.tools = cp.tools
        self.stats["rollbacks"] += 1

    # -- views --------------------------------------------------------------------------------------------

    def model_token_count(self) -> int:
        return sum(t.end - t.start for t in self.turns)

    def weight_versions(self) -> list[int]:
        """The distinct weight versions that produced the model tokens, in order."""
        out: list[int] = []
        for t in self.turns:
            out += [v for v in t.weight_versions if not out or out[-1] != v]
        return out


def _token_ending_at(ids: list[int], char: int, template: ChatTemplate, *, lo: int) -> int:
    """The smallest ``t >= lo`` with ``len(decode(ids[:t])) >= char`` (binary search on decoded length)."""
    hi = len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(template.decode(ids[:mid])) >= char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _session_message(m: dict[str, Any]) -> dict[str, Any]:
    """A client message as the session stores it: OpenAI keys only, no private ones."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content")}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out
