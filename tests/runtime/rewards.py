"""Reward plugins for the loop tests (imported by path, as a user's would be)."""

from __future__ import annotations

import time

from tandem.core.sample import Sample


def even_tokens(sample: Sample) -> float:
    """Fraction of even token ids in the response: varies between samples of a random tiny model,
    so GRPO gets a learning signal from it."""
    ids = sample.response_tokens
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def flaky(sample: Sample) -> float:
    """Raises on every response whose first token id is divisible by 5."""
    if sample.response_tokens and sample.response_tokens[0] % 5 == 0:
        raise RuntimeError("flaky reward failed")
    return even_tokens(sample)


def slow_even_tokens(sample: Sample) -> float:
    """`even_tokens` after 50 ms: stretches a step without using the CPU (fault-injection tests)."""
    time.sleep(0.05)
    return even_tokens(sample)


def constant(sample: Sample) -> float:
    """The same reward for every sample: no group has a learning signal."""
    return 0.5


def sometimes_hangs(sample: Sample) -> float:
    if sample.response_tokens and sample.response_tokens[0] % 13 == 0:
        time.sleep(5)
    return even_tokens(sample)


def pg_loss(output, batch, scale):
    """A minimal policy-gradient `LossFn` (token mean), as a user plugin would write one."""
    mask = batch.loss_mask
    loss = -(output.log_probs * batch.advantages * mask).sum() / scale.num_tokens
    return loss, {"loss/pg": float(loss)}
