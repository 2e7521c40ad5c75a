"""Agents for the loop tests (imported by path, as a user's are)."""

from __future__ import annotations

import httpx2 as httpx


def two_turn_agent(base_url, prompt, metadata):
    """Two short model turns with a user turn between them, whatever the model says: every episode is a
    multi-turn trajectory (the user's tokens sit inside the response with loss mask 0)."""
    messages = [{"role": "user", "content": prompt}]
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 3})
        r.raise_for_status()
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "Are you sure?"}]
        r = c.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 3})
        r.raise_for_status()
        content = r.json()["choices"][0]["message"]["content"] or ""
    return float(len(content) % 2)  # a reward that differs between samples
