"""Render conversations through a tokenizer's chat template, the way the session server sees them.

`ChatTemplate` wraps a Hugging Face tokenizer (and optionally a template source of its own) and turns
*session messages* into text and token ids. Session messages are OpenAI chat messages, plus one private
key: an assistant message the model generated carries ``"_raw"``, the exact text it produced (before
its stop token). Rendering rules:

* an assistant message with ``_raw`` renders as that text and nothing else (no ``tool_calls``): the
  model's own tokens stay what they were, whatever the template would make of a parsed version;
* other assistant messages (written by a client) render their content and tool calls: natively when
  the template has a tools section (it reads ``tools``), else as ``<tool_call>`` blocks after the text
  (tandem/rollout/tools.py);
* ``tools`` go to the template natively, else at the end of the system message (tools.py);
* content given as a list of text parts is joined; ``None`` content is the empty string; role
  ``developer`` renders as ``system``.

Text is tokenized without adding special tokens (the template writes them), and decoded without
skipping any, so ``decode(encode(text)) == text`` for the byte-level BPE tokenizers this targets.

**Client text never becomes a special token.** A message (or a tool definition) whose text contains a
special token's string (``<|im_end|><|im_start|>assistant``) would otherwise tokenize into the real
special tokens and fake a turn boundary. `render_marked` renders such text through stand-in characters
and returns the character ranges where it wrote those strings (`Rendered.literal`); `encode` with those
ranges tokenizes them as plain text (the tokenizer's ``encode_special_tokens``), while the template's
own special tokens stay special. The model's own text (``_raw``) is not client text: a special token it
generated stays one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.rollout.tools import format_tool_calls, tools_system_block

__all__ = ["ChatTemplate", "Rendered", "TemplateRenderError", "message_text"]

# Stand-ins for special-token strings in client text while the template renders (Supplementary Private
# Use Area-A): the i-th special string becomes chr(_STAND_IN + i).
_STAND_IN = 0xF0000


class TemplateRenderError(ValueError):
    """The chat template refused the conversation (e.g. ``raise_exception`` on a role order)."""


def message_text(content: Any) -> str:
    """OpenAI message content (a string, a list of ``{"type": "text", "text": ...}`` parts or None)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


@dataclass(frozen=True, slots=True)
class Rendered:
    """A render's text and the ``[start, end)`` character ranges of special-token strings that client
    text wrote there (tokenized as plain text, module docstring)."""

    text: str
    literal: tuple[tuple[int, int], ...] = ()

    def literal_from(self, start: int) -> tuple[tuple[int, int], ...]:
        """The literal ranges of ``text[start:]``, relative to ``start``."""
        return tuple((max(a, start) - start, b - start) for a, b in self.literal if b > start)


@functools.lru_cache(maxsize=32)
def _template_variables(source: str) -> frozenset[str]:
    import jinja2
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source)))


class ChatTemplate:
    """A tokenizer plus its chat template, rendering session messages (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not source:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.tokenizer = tokenizer
        self.source: str = source
        self.native_tools = "tools" in _template_variables(source)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos if isinstance(eos, int) else None
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special = {i: t.content for i, t in added.items() if getattr(t, "special", False)}
        self._special_ids = frozenset(special)
        # longest first, so that a special string that holds another is replaced whole
        self._specials: tuple[str, ...] = tuple(sorted(set(special.values()), key=len, reverse=True))
        self._special_index = {text: i for i, text in enumerate(self._specials)}
        self._special_re = re.compile("|".join(map(re.escape, self._specials))) if self._specials else None
        self._literal_backend: Any = None

    # -- text ------------------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
               add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (session messages) and ``tools``."""
        return self.render_marked(messages, tools, add_generation_prompt=add_generation_prompt).text

    def render_marked(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                      add_generation_prompt: bool) -> Rendered:
        """`render`'s text plus where client text wrote special-token strings (module docstring)."""
        msgs = [self._template_message(m) for m in messages]
        client = [i for i, m in enumerate(messages) if "_raw" not in m]  # the model's own text stays as is
        marked = self._special_re is not None and _any_string([tools, *(msgs[i] for i in client)],
                                                              self._special_re.search)
        if marked:
            self._check_no_stand_ins([tools, *(msgs[i] for i in client)])
            for i in client:
                msgs[i] = _map_strings(msgs[i], self._stand_in)
            tools = _map_strings(tools, self._stand_in)
        kwargs: dict[str, Any] = {}
        if tools:
            if self.native_tools:
                kwargs["tools"] = tools
            else:
                msgs = _with_tools_in_system(msgs, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=self.source, **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - jinja raises many types; the caller gets one
            raise TemplateRenderError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        return self._restore(text) if marked else Rendered(text)

    def _stand_in(self, text: str) -> str:
        return self._special_re.sub(lambda m: chr(_STAND_IN + self._special_index[m.group()]), text)

    def _check_no_stand_ins(self, values: list[Any]) -> None:
        top = chr(_STAND_IN + len(self._specials))
        if any(_STAND_IN <= ord(c) < ord(top) for c in self.source) or _any_string(
                values, lambda t: any(chr(_STAND_IN) <= c < top for c in t)):
            raise TemplateRenderError(
                f"text with special-token strings cannot also hold the characters U+{_STAND_IN:X}.."
                f"U+{ord(top) - 1:X} (private use; the server reserves them)")

    def _restore(self, text: str) -> Rendered:
        """The stand-ins back to their special strings, with the ranges they now cover."""
        parts, literal, pos, size = [], [], 0, 0
        for i, c in enumerate(text):
            k = ord(c) - _STAND_IN
            if 0 <= k < len(self._specials):
                parts.append(text[pos:i])
                size += i - pos
                parts.append(self._specials[k])
                literal.append((size, size + len(self._specials[k])))
                size += len(self._specials[k])
                pos = i + 1
        parts.append(text[pos:])
        return Rendered("".join(parts), tuple(literal))

    def _template_message(self, m: dict[str, Any]) -> dict[str, Any]:
        role = "system" if m["role"] == "developer" else m["role"]
        if "_raw" in m:
            return {"role": role, "content": m["_raw"]}
        out: dict[str, Any] = {"role": role, "content": message_text(m.get("content"))}
        calls = m.get("tool_calls") or []
        if calls:
            if self.native_tools:
                out["tool_calls"] = [
                    {"id": c.get("id"), "type": "function",
                     "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                    for c in calls
                ]
            else:
                text = out["content"]
                out["content"] = (text + "\n" if text else "") + format_tool_calls(calls)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                out[key] = m[key]
        return out

    # -- tokens ----------------------------------------------------------------------------------------

    def encode(self, text: str, literal: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text`` (no special tokens added: the template wrote them); special tokens in
        the ``literal`` character ranges (`Rendered.literal`) are tokenized as plain text."""
        if not text:
            return []
        if not literal:
            return self._encode(text)
        if self._backend is None:  # a slow tokenizer splits at special tokens first: so can we
            out, pos = [], 0
            for a, b in sorted(literal):
                out += self._encode(text[pos:a]) + list(self._literal_ids(text[a:b]))
                pos = b
            return out + self._encode(text[pos:])
        enc = self._backend.encode(text, add_special_tokens=False)
        out = []
        for tid, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            if tid in self._special_ids and any(a < end and start < b for start, end in literal):
                out += self._literal_ids(text[a:b])
            else:
                out.append(tid)
        return out

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @functools.lru_cache(maxsize=256)  # noqa: B019 - a few strings per template, for its lifetime
    def _literal_ids(self, text: str) -> tuple[int, ...]:
        """``text`` tokenized with its special-token strings as plain text."""
        if self._backend is None:
            return tuple(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        if self._literal_backend is None:
            from tokenizers import Tokenizer

            self._literal_backend = Tokenizer.from_str(self._backend.to_str())
            self._literal_backend.encode_special_tokens = True
        return tuple(self._literal_backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included, no clean-up."""
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (as the OpenAI ``logprobs.content[].token`` field shows it)."""
        return [self.decode([i]) for i in ids]


def _arguments(call: dict[str, Any]) -> Any:
    """HF templates expect tool-call arguments as a mapping (they ``tojson`` it); OpenAI sends a string."""
    args = call["function"].get("arguments") or "{}"
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _with_tools_in_system(msgs: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    block = tools_system_block(tools)
    if msgs and msgs[0]["role"] == "system":
        head = msgs[0]
        text = head["content"]
        return [{**head, "content": (text + "\n\n" if text else "") + block}, *msgs[1:]]
    return [{"role": "system", "content": block}, *msgs]


def _map_strings(value: Any, fn) -> Any:
    """``value`` (messages, tools: JSON-like) with ``fn`` applied to every string in it."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value


def _any_string(value: Any, pred) -> bool:
    if isinstance(value, str):
        return bool(pred(value))
    if isinstance(value, dict):
        return any(_any_string(v, pred) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_any_string(v, pred) for v in value)
    return False
