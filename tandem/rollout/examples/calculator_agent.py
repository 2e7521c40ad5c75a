"""A calculator-tool agent for the synthetic arithmetic task (``data.source: synthetic:arithmetic``).

The model may call ``calculator(expression)`` (a safe arithmetic evaluator, no ``eval``) and must end
with the number. Two ways to run it, both in recipes/:

* ``rollout.generate: tandem.rollout.agent:agentic_tool_call`` with
  ``rollout.agent.function: tandem.rollout.examples.calculator_agent:run_episode``: `run_episode` is an
  ordinary OpenAI-client agent loop against the session server; it returns its reward (reward term
  ``tandem.rollout.agent:agent_reward``).
* ``rollout.generate: tandem.rollout.agent:multi_turn`` with
  ``rollout.agent.tools: [tandem.rollout.examples.calculator_agent:calculator]``: the framework runs the
  tool; reward term ``tandem.rollout.examples.calculator_agent:calculator_reward``.

Reward: 1 if the final answer's last number equals the label, plus ``TOOL_BONUS`` when the episode made
at least one well-formed calculator call (a shaping term that makes tool use worth learning for a model
that rarely calls tools at first).
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from tandem.rewards.builtin import last_number
from tandem.rollout.tools import tool

__all__ = ["SYSTEM_PROMPT", "TOOL_BONUS", "calculator", "calculator_reward", "evaluate", "run_episode"]

TOOL_BONUS = 0.2
MAX_TURNS = 4
SYSTEM_PROMPT = ("You are a careful assistant. Use the calculator tool for arithmetic, then reply with only "
                 "the final number.")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_LENGTH = 200


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary signs, parentheses.

    Anything else (names, calls, attributes, huge exponents, long inputs) raises ValueError.
    """
    if len(expression) > _MAX_LENGTH:
        raise ValueError(f"expression is {len(expression)} characters long; the limit is {_MAX_LENGTH}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported element {type(node).__name__} in {expression!r}")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return int(value) if isinstance(value, float) and value.is_integer() else value


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as "12 * (3 + 4)" and return the result."""
    return str(evaluate(expression))


def _score(answer: str, label: Any, used_tool: bool) -> float:
    got = last_number(answer or "")
    correct = got is not None and label is not None and abs(got - float(label)) < 1e-6
    return float(correct) + (TOOL_BONUS if used_tool else 0.0)


def calculator_reward(sample) -> float:
    """Reward term for the ``multi_turn`` variant: the final answer and whether a tool call was made."""
    return _score(sample.response, sample.label, sample.metadata.get("num_tool_calls", 0) > 0)


def run_episode(base_url: str, prompt: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """One episode with the OpenAI client: ask, run the calculator calls, repeat; return the reward."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="tandem", max_retries=2)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    used_tool = False
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[calculator.schema])
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        answer = choice.message.content or ""
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls or []:
            try:
                args = json.loads(call.function.arguments)
                result = calculator(args) if call.function.name == "calculator" else f"error: no tool {call.function.name!r}"
                used_tool = used_tool or not result.startswith("error")
            except (ValueError, TypeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": _score(answer, metadata.get("label"), used_tool), "response": answer, "used_tool": used_tool}
