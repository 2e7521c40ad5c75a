"""Chat-template verifier: is a template prefix-stable, as TITO needs?

Token-in-token-out appends each turn's tokens to what is stored, so the render of a conversation must
extend the render of any earlier point of it. `verify_template` renders random conversations (system,
user, assistant with text, reasoning blocks and tool calls, tool results, several turns) through the
same `ChatTemplate` the session server uses, and checks, for every prefix ``messages[:k]``:

* ``string_prefix``: ``render(messages[:k])`` is a prefix of ``render(messages)``;
* ``generation_prompt``: when ``messages[k]`` is an assistant message, ``render(messages[:k],
  add_generation_prompt=True)`` is a prefix of ``render(messages[:k+1])`` and, for a text-only message,
  is followed by its content verbatim (the model's text is stored exactly as generated);
* ``token_prefix``: the token ids of ``render(messages[:k])`` are a prefix of those of the full render
  (no token merges across the boundary).

The first failure of each check is reported with the conversation, the prefix length, the first
differing character and token, both renders around it, and the template construct that most likely
causes it (``loop.last`` / ``messages[-1]``, reasoning dropped from earlier turns, stripped content,
a generation prompt unlike the assistant header, a header that depends on later messages, a token
merge across the boundary).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from tandem.rollout.chat import ChatTemplate, TemplateRenderError
from tandem.rollout.tito import first_difference

__all__ = ["Divergence", "VerifyConfig", "VerifyReport", "random_conversation", "verify_template"]

_WORDS = ("the answer is seven plus three apples tool result check value we need to add first then "
          "compute number total sum calculator says done okay").split()
CHECKS = ("string_prefix", "generation_prompt", "token_prefix")

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


@dataclass(kw_only=True, slots=True)
class VerifyConfig:
    """How many random conversations, and which constructs they contain."""

    num_conversations: int = 200
    max_turns: int = 4  # assistant turns per conversation (tool rounds add more messages)
    seed: int = 0
    tools: bool = True
    reasoning: bool = True  # assistant texts that start with a <think>...</think> block
    whitespace: bool = True  # leading/trailing whitespace and newlines in message texts

    def __post_init__(self) -> None:
        if self.num_conversations < 1:
            raise ValueError(f"num_conversations={self.num_conversations} must be >= 1")
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns} must be >= 1")


@dataclass(kw_only=True, slots=True)
class Divergence:
    check: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prefix_len: int  # the prefix is messages[:prefix_len]
    char_position: int | None
    token_position: int | None
    message_index: int | None  # the message the first difference falls in
    prefix_excerpt: str
    full_excerpt: str
    construct: str
    explanation: str

    def format(self) -> str:
        lines = [f"FAIL {self.check}: {self.explanation}"]
        where = []
        if self.char_position is not None:
            where.append(f"character {self.char_position}")
        if self.token_position is not None:
            where.append(f"token {self.token_position}")
        if self.message_index is not None and self.message_index < len(self.messages):
            where.append(f"in message {self.message_index} ({self.messages[self.message_index]['role']})")
        lines.append(f"  at {', '.join(where)}; prefix = messages[:{self.prefix_len}] of {len(self.messages)}")
        lines.append(f"  prefix: {self.prefix_excerpt}")
        lines.append(f"  full:   {self.full_excerpt}")
        lines.append(f"  construct: {self.construct}")
        lines.append("  conversation: " + " | ".join(_brief(m) for m in self.messages))
        return "\n".join(lines)


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    num_conversations: int
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKS, 0))  # checks run
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKS, 0))
    first: dict[str, Divergence] = field(default_factory=dict)  # the first divergence of each check

    @property
    def ok(self) -> bool:
        return not any(self.failures.values())

    def format(self) -> str:
        total = sum(self.counts.values())
        head = (f"{self.num_conversations} random conversations, {total} checks: "
                + ("OK" if self.ok else ", ".join(f"{k} failed {v}/{self.counts[k]}" for k, v in self.failures.items() if v)))
        return "\n".join([head, *(d.format() for d in self.first.values())])


def _brief(m: dict[str, Any]) -> str:
    text = (m.get("content") or "")[:30]
    calls = m.get("tool_calls")
    extra = f" +{len(calls)} call(s)" if calls else ""
    return f"[{m['role']}] {text!r}{extra}"


# -- random conversations -----------------------------------------------------------------------------------


def _text(rng: random.Random, cfg: VerifyConfig, lo: int = 2, hi: int = 9) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))
    if rng.random() < 0.3:
        text += f" {rng.randint(0, 999)}."
    if cfg.whitespace and rng.random() < 0.2:
        text = rng.choice([" ", "\n", "  "]) + text if rng.random() < 0.5 else text + rng.choice([" ", "\n", "\n\n"])
    return text


def random_conversation(rng: random.Random, cfg: VerifyConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A conversation and its tools (None without tools), drawn from ``rng``."""
    tools = [CALCULATOR, SEARCH][: rng.randint(1, 2)] if cfg.tools and rng.random() < 0.6 else None
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": _text(rng, cfg)})
    msgs.append({"role": "user", "content": _text(rng, cfg)})
    for turn in range(rng.randint(1, cfg.max_turns)):
        if tools and rng.random() < 0.4:
            calls = []
            for i in range(rng.randint(1, 2)):
                tool = rng.choice(tools)["function"]
                key = next(iter(tool["parameters"]["properties"]))
                calls.append({"id": f"call_{turn}_{i}", "type": "function",
                              "function": {"name": tool["name"],
                                           "arguments": f'{{"{key}": "{rng.randint(1, 99)} + {rng.randint(1, 99)}"}}'}})
            content = _text(rng, cfg) if rng.random() < 0.3 else None
            msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            for c in calls:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
                             "content": str(rng.randint(0, 999))})
            continue
        text = _text(rng, cfg)
        if cfg.reasoning and rng.random() < 0.3:
            text = f"<think>\n{_text(rng, cfg)}\n</think>\n\n{text.strip()}"
        msgs.append({"role": "assistant", "content": text})
        if rng.random() < 0.75:
            msgs.append({"role": "user", "content": _text(rng, cfg)})
    return msgs, tools


# -- checks -------------------------------------------------------------------------------------------------


def verify_template(template: ChatTemplate, cfg: VerifyConfig | None = None) -> VerifyReport:
    """Run the checks of the module docstring on ``cfg.num_conversations`` random conversations."""
    cfg = cfg or VerifyConfig()
    rng = random.Random(cfg.seed)
    report = VerifyReport(num_conversations=cfg.num_conversations)
    for _ in range(cfg.num_conversations):
        msgs, tools = random_conversation(rng, cfg)
        try:
            _check_conversation(template, msgs, tools, report)
        except TemplateRenderError as e:
            report.failures["string_prefix"] += 1
            report.first.setdefault("string_prefix", Divergence(
                check="string_prefix", messages=msgs, tools=tools, prefix_len=len(msgs), char_position=None,
                token_position=None, message_index=None, prefix_excerpt="", full_excerpt="",
                construct="the template raised on this conversation", explanation=str(e)))
    return report


def _check_conversation(t: ChatTemplate, msgs: list[dict[str, Any]], tools, report: VerifyReport) -> None:
    full = t.render(msgs, tools, add_generation_prompt=False)
    full_ids = t.encode(full)
    for k in range(1, len(msgs)):
        prefix = t.render(msgs[:k], tools, add_generation_prompt=False)
        report.counts["string_prefix"] += 1
        if not full.startswith(prefix):
            pos = first_difference(prefix, full)
            _fail(report, t, "string_prefix", msgs, tools, k, prefix, full, pos,
                  f"render(messages[:{k}]) is not a prefix of render(messages)")
        else:
            report.counts["token_prefix"] += 1
            ids = t.encode(prefix)
            if full_ids[: len(ids)] != ids:
                j = first_difference(ids, full_ids)
                _fail(report, t, "token_prefix", msgs, tools, k, prefix, full, len(t.decode(ids[:j])),
                      f"the tokens of render(messages[:{k}]) are not a prefix of the tokens of render(messages)",
                      token=j, ids=(ids, full_ids))
        if msgs[k]["role"] == "assistant":
            report.counts["generation_prompt"] += 1
            gen = t.render(msgs[:k], tools, add_generation_prompt=True)
            with_reply = t.render(msgs[: k + 1], tools, add_generation_prompt=False)
            content = msgs[k].get("content") or ""
            expected = gen + (content if not msgs[k].get("tool_calls") else "")
            if not with_reply.startswith(expected):
                pos = first_difference(expected, with_reply)
                _fail(report, t, "generation_prompt", msgs, tools, k, expected, with_reply, pos,
                      f"render(messages[:{k}], add_generation_prompt=True) + the assistant's text is not a "
                      f"prefix of render(messages[:{k + 1}])", spans=(len(prefix), len(gen)))


def _fail(report: VerifyReport, t: ChatTemplate, check: str, msgs, tools, k: int, prefix: str, full: str, pos: int,
          explanation: str, *, token: int | None = None, ids=None, spans: tuple[int, int] | None = None) -> None:
    report.failures[check] += 1
    if check in report.first:
        return
    index = _message_at(t, msgs, tools, pos)
    if token is None:
        token = len(t.encode(prefix[:pos]))
    construct = _diagnose(t.source, check, msgs, k, index, prefix, full, pos, ids=ids, spans=spans)
    report.first[check] = Divergence(
        check=check, messages=msgs, tools=tools, prefix_len=k, char_position=pos, token_position=token,
        message_index=index, prefix_excerpt=_excerpt(prefix, pos), full_excerpt=_excerpt(full, pos),
        construct=construct, explanation=explanation)


def _excerpt(text: str, pos: int, width: int = 40) -> str:
    before, after = text[max(0, pos - width) : pos], text[pos : pos + width]
    return f"...{before!r} >>> {after!r}" + (" [end]" if pos + width >= len(text) else "")


def _message_at(t: ChatTemplate, msgs, tools, pos: int) -> int | None:
    """The message whose rendering holds character ``pos`` (by the renders of growing prefixes)."""
    for j in range(1, len(msgs) + 1):
        try:
            if len(t.render(msgs[:j], tools, add_generation_prompt=False)) > pos:
                return j - 1
        except TemplateRenderError:
            return None
    return len(msgs) - 1


def _found(source: str, *patterns: str) -> list[str]:
    return [p for p in patterns if re.search(re.escape(p).replace(r"\ ", r"\s*"), source)]


def _diagnose(source: str, check: str, msgs, k: int, index: int | None, prefix: str, full: str, pos: int, *,
              ids=None, spans: tuple[int, int] | None = None) -> str:
    """The template construct most likely behind a divergence (from the failure's shape and the source)."""
    if check == "token_prefix":
        a, b = ids
        j = first_difference(a, b)
        return (f"a token merges across the boundary: the prefix ends with token {a[j:j + 3]} where the full render "
                f"has {b[j:j + 3]}; the template puts text that the tokenizer joins with what follows at the end "
                "of a message (e.g. a newline before another newline); end messages with a special token")
    message = msgs[index] if index is not None and index < len(msgs) else {}
    content = message.get("content") or ""
    if check == "generation_prompt":
        history_len, gen_len = spans or (0, 0)
        if pos < history_len:  # the history itself changed once the assistant message was added
            return _diagnose(source, "string_prefix", msgs, k, index, prefix[:history_len], full, pos)
        if pos < gen_len:
            hint = _found(source, "add_generation_prompt", "enable_thinking", "<think>")
            return ("the generation prompt differs from the header of an assistant message (e.g. it adds an empty "
                    f"'<think></think>' block that rendered assistant messages lack); constructs: {hint or '?'}")
        hint = _found(source, "| trim", "|trim", ".strip()", ".lstrip(", ".rstrip(", "</think>", "reasoning_content")
        if "<think>" in content:
            return f"the template re-renders the assistant's reasoning block (constructs: {hint or '?'})"
        return ("the assistant's text is not rendered verbatim (whitespace stripped or content rewritten); "
                f"constructs: {hint or '?'}")
    reasoning = _found(source, "</think>", "reasoning_content", "last_query_index")
    if "<think>" in content and reasoning and "<think>" not in full[pos : pos + len(content) + 20]:
        return f"reasoning blocks are dropped from earlier turns once a later user turn exists ({', '.join(reasoning)})"
    if index == k - 1 or pos >= len(prefix) - 1:
        last = _found(source, "loop.last", "messages[-1]", "loop.index", "messages|length", "messages | length")
        return (f"the last message renders differently from the same message followed by others: "
                f"{', '.join(last) if last else 'a condition on the position of the message'}")
    if index == 0 or (index is not None and msgs[index]["role"] == "system"):
        header = _found(source, "tools", "strftime_now", "now()", "messages|length", "date")
        return f"the system header depends on later messages ({', '.join(header) if header else '?'})"
    return f"message {index} renders differently once later messages exist"
