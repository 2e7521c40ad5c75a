"""Tool calls as text: how tools are described to a model and how its calls are read back.

Chat templates with a tools section (Qwen2.5/3, Hermes, Llama 3.1, ...) render ``tools`` and
``tool_calls`` themselves. For templates without one (ChatML as SmolLM2 ships it), Tandem renders them
into the messages in the Hermes convention that most open tool-calling models were trained on:

* the tool list goes at the end of the system message (a system message holding only the tool list is
  inserted when the conversation has none)::

      # Tools

      You can call the functions below. Their signatures are JSON schemas, between <tools></tools>:
      <tools>
      {"type": "function", "function": {"name": "calculator", ...}}
      </tools>

      To call a function, reply with a JSON object with its name and arguments between
      <tool_call></tool_call> tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

* an assistant message's calls follow its text, one block per call::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "3 + 4"}}
      </tool_call>

* a tool result is a message with role ``tool`` whose content is the result text.

`parse_tool_calls` reads the same blocks back out of a model's text, whatever the template. A block
whose body is not a JSON object with a string ``name`` and an object ``arguments`` (or a JSON string
holding one) stays in the text and is counted as invalid.

`tool` turns a Python function into a tool with an OpenAI function schema derived from its signature.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ParsedToolCalls",
    "Tool",
    "format_tool_calls",
    "parse_tool_calls",
    "tool",
    "tools_system_block",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

_TOOLS_HEADER = (
    "# Tools\n\nYou can call the functions below. Their signatures are JSON schemas, between "
    "<tools></tools>:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nTo call a function, reply with a JSON object with its name and arguments between "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_system_block(tools: list[dict[str, Any]]) -> str:
    """The text that describes ``tools`` (OpenAI ``{"type": "function", ...}`` dicts) to the model."""
    return _TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_FOOTER


def format_tool_calls(calls: list[dict[str, Any]]) -> str:
    """OpenAI ``tool_calls`` as ``<tool_call>`` blocks joined by newlines (arguments as a JSON object)."""
    blocks = []
    for call in calls:
        fn = call["function"]
        args = fn.get("arguments") or "{}"
        args_obj = json.loads(args) if isinstance(args, str) else args
        body = json.dumps({"name": fn["name"], "arguments": args_obj}, ensure_ascii=False)
        blocks.append(f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}")
    return "\n".join(blocks)


@dataclass(kw_only=True, slots=True)
class ParsedToolCalls:
    """A model's text split into its plain content and its tool calls."""

    content: str  # the text with every valid block removed, stripped
    calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name": str, "arguments": dict}]
    num_invalid: int = 0  # blocks that did not parse (left in ``content``)


def _parse_block(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split ``text`` into content and ``<tool_call>{json}</tool_call>`` calls (see the module doc)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    invalid = 0
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1).strip())
        if call is None:
            invalid += 1
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return ParsedToolCalls(content="".join(kept).strip() if calls else text, calls=calls, num_invalid=invalid)


# -- Python functions as tools --------------------------------------------------------------------------

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                               list: "array", dict: "object"}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    name = _JSON_TYPES.get(origin)
    return {"type": name} if name else {}


@dataclass(kw_only=True, slots=True)
class Tool:
    """A callable with its OpenAI function schema. Calling it with the arguments dict returns text."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {...}}``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: dict[str, Any]) -> str:
        out = self.fn(**arguments)
        return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None):
    """Make ``fn`` a `Tool`; its parameters' annotations become the JSON schema, its docstring the
    description. Usable bare (``@tool``) or with options (``@tool(name="calc")``)."""

    def wrap(f: Callable[..., Any]) -> Tool:
        hints = typing.get_type_hints(f)
        props: dict[str, Any] = {}
        required = []
        for p in inspect.signature(f).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            props[p.name] = _json_type(hints.get(p.name, Any))
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        doc = inspect.getdoc(f) or ""
        return Tool(
            name=name or f.__name__,
            description=description if description is not None else doc.split("\n\n")[0],
            parameters={"type": "object", "properties": props, "required": required},
            fn=f,
        )

    return wrap(fn) if fn is not None else wrap


def as_tool(obj: Any, *, where: str) -> Tool:
    """A `Tool` from a `Tool` or a plain function (its schema derived as `tool` does)."""
    if isinstance(obj, Tool):
        return obj
    if callable(obj):
        return tool(obj)
    raise ValueError(f"{where}: {obj!r} is not a tool (a function or a tandem.rollout.tools.Tool)")
