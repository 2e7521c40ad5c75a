"""Tool-call text format: rendering tools, serialising calls, parsing a model's text."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from tandem.rollout.tools import format_tool_calls, parse_tool_calls, tool, tools_system_block


def test_parse_one_call_removes_the_block():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me compute."
    assert parsed.calls == [{"name": "calculator", "arguments": {"expression": "3 + 4"}}]
    assert parsed.num_invalid == 0


def test_parse_several_calls_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> done')
    parsed = parse_tool_calls(text)
    assert [c["name"] for c in parsed.calls] == ["a", "b"]
    assert parsed.calls[0]["arguments"] == {"x": 1}
    assert parsed.content == "done"


@pytest.mark.parametrize("body", [
    "not json", '{"arguments": {}}', '{"name": "", "arguments": {}}', '{"name": "f", "arguments": [1]}',
    '{"name": "f", "arguments": "not json"}', '["f"]',
])
def test_invalid_blocks_stay_in_the_text_and_are_counted(body):
    text = f"before <tool_call>{body}</tool_call> after"
    parsed = parse_tool_calls(text)
    assert parsed.calls == []
    assert parsed.num_invalid == 1
    assert parsed.content == text  # nothing removed


def test_valid_and_invalid_blocks_mixed():
    text = '<tool_call>oops</tool_call>\n<tool_call>{"name": "f", "arguments": {"k": "v"}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [{"name": "f", "arguments": {"k": "v"}}]
    assert parsed.num_invalid == 1
    assert parsed.content == "<tool_call>oops</tool_call>"


def test_unterminated_block_is_text():
    text = '<tool_call>{"name": "f", "arguments": {}}'
    assert parse_tool_calls(text).calls == []


def test_format_then_parse_round_trips():
    calls = [{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}},
             {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}]
    text = format_tool_calls(calls)
    assert text.count("<tool_call>\n") == 2 and "\n</tool_call>\n<tool_call>" in text
    parsed = parse_tool_calls(text)
    assert parsed.calls == [{"name": "calculator", "arguments": {"expression": "1+2"}},
                            {"name": "search", "arguments": {"query": "x"}}]
    assert parsed.content == ""


def test_tools_block_lists_each_schema_as_json():
    schemas = [{"type": "function", "function": {"name": "f", "parameters": {}}},
               {"type": "function", "function": {"name": "g"}}]
    block = tools_system_block(schemas)
    inside = block.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in inside] == schemas
    assert "<tool_call>" in block


def test_tool_decorator_derives_the_schema():
    @tool
    def lookup(word: str, limit: int = 3, mode: Literal["exact", "fuzzy"] = "exact") -> list[str]:
        """Look a word up in the dictionary.

        Longer explanation that is not part of the description.
        """
        return [word] * limit

    assert lookup.name == "lookup"
    assert lookup.description == "Look a word up in the dictionary."
    assert lookup.parameters == {
        "type": "object",
        "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}, "mode": {"enum": ["exact", "fuzzy"]}},
        "required": ["word"],
    }
    assert lookup.schema["function"]["name"] == "lookup"
    assert lookup({"word": "a", "limit": 2}) == '["a", "a"]'  # non-string results become JSON
