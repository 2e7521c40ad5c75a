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
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from tandem.rollout.tools import format_tool_calls, tools_system_block

__all__ = ["ChatTemplate", "TemplateRenderError", "message_text"]


class TemplateRenderError(ValueError):
    """The chat template refused the conversation (e.g. ``raise_exception`` on a role order)."""


def message_text(content: Any) -> str:
    """OpenAI message content (a string, a list of ``{"type": "text", "text": ...}`` parts or None)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


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

    # -- text ------------------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
               add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (session messages) and ``tools``."""
        msgs = [self._template_message(m) for m in messages]
        kwargs: dict[str, Any] = {}
        if tools:
            if self.native_tools:
                kwargs["tools"] = tools
            else:
                msgs = _with_tools_in_system(msgs, tools)
        try:
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=self.source, **kwargs,
            )
        except Exception as e:  # noqa: BLE001 - jinja raises many types; the caller gets one
            raise TemplateRenderError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

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

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added: the template wrote them)."""
        if not text:
            return []
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

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
