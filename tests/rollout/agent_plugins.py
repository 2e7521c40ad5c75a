"""Agents, tools and environments for the generate-function tests (imported by path, as a user's are)."""

from __future__ import annotations

import asyncio
import time

import httpx2 as httpx

from tandem.rollout.examples.calculator_agent import calculator, run_episode
from tandem.rollout.tools import Tool

CALLS: list[dict] = []


def sleepy_agent(base_url, prompt, metadata):
    time.sleep(3)
    return 1.0


def failing_agent(base_url, prompt, metadata):
    raise RuntimeError("the agent's environment is down")


def wrong_type_agent(base_url, prompt, metadata):
    httpx.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                      "max_tokens": 2}, timeout=60)
    return [1, 2]


async def async_agent(base_url, prompt, metadata):
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})
        r.raise_for_status()
        CALLS.append({"base_url": base_url, "metadata": dict(metadata)})
        return r.json()["choices"][0]["message"]["content"] or "no answer"


def drifting_agent(base_url, prompt, metadata):
    """Adds a reasoning message, then a user turn: a template that drops old reasoning drifts."""
    messages = [{"role": "user", "content": prompt}]
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 2})
        messages += [r.json()["choices"][0]["message"],
                     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n7"}, {"role": "tool", "content": "x"}]
        r = c.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 2})
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "sure?"}]
        r = c.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 2})
        r.raise_for_status()
    return 0.0


def calculator_episode(base_url, prompt, metadata):
    return run_episode(base_url, prompt, metadata)


def asks_twice(messages, metadata):
    """A user simulator: one follow-up question, then the episode ends."""
    return "Are you sure?" if sum(m["role"] == "user" for m in messages) < 2 else None


def broken_environment(messages, metadata):
    raise ValueError("simulator crashed")


def _boom(expression: str) -> str:
    raise ZeroDivisionError("boom")


# the calculator's exact schema (so the taught model calls it), with a body that fails
broken_calculator = Tool(name="calculator", description=calculator.description, parameters=calculator.parameters,
                         fn=_boom)


async def slow_async_agent(base_url, prompt, metadata):
    await asyncio.sleep(5)
    return 1.0
