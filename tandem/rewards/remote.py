"""A reward model behind HTTP: POST JSON, read a float back. Standard library only.

Request body: ``{"prompt", "response", "label", "metadata"}`` (prompt as text or chat messages).
Response body: ``{"reward": float}`` or ``{"reward": {"name": float, ...}}``. Transient failures
(connection errors, HTTP 5xx, 429) are retried with exponential backoff; 4xx other than 429 fail
at once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from tandem.core.sample import Sample
from tandem.rewards.builtin import RewardFn


class RemoteRewardError(RuntimeError):
    pass


def remote(
    *,
    url: str,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    headers: dict[str, str] | None = None,
) -> RewardFn:
    """Score a sample by POSTing it to ``url``; see the module docstring for the protocol."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"remote reward: url={url!r} must start with http:// or https://")
    if retries < 0:
        raise ValueError(f"remote reward: retries={retries} must be >= 0")
    hdrs = {"Content-Type": "application/json", **(headers or {})}

    def fn(sample: Sample) -> Any:
        body = json.dumps(
            {
                "prompt": sample.prompt,
                "response": sample.response,
                "label": sample.label,
                "metadata": sample.metadata,
            },
            default=str,
        ).encode()
        last: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=body, headers=hdrs, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                    payload = json.loads(resp.read())
            except urllib.error.HTTPError as e:
                last = e
                if e.code < 500 and e.code != 429:
                    raise RemoteRewardError(f"{url} answered HTTP {e.code}: {e.reason}") from None
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = e
                continue
            if not isinstance(payload, dict) or "reward" not in payload:
                raise RemoteRewardError(f"{url} answered {str(payload)[:200]!r}; expected {{'reward': ...}}")
            return payload["reward"]
        raise RemoteRewardError(f"{url} failed after {retries + 1} attempts: {last}")

    return fn
