"""Reward plugins for the loop tests (imported by path, as a user's would be)."""

from __future__ import annotations

import asyncio
import os
import signal
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


def even_label_solved(sample: Sample) -> float:
    """1 for every sample of a prompt whose label is even (a solved prompt: its group has no signal and
    ``drop_zero_std_groups`` drops it), else `even_tokens`."""
    if int(sample.label) % 2 == 0:
        return 1.0
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


# -- reward isolation (tests/rewards/test_reward_isolation.py) -----------------------------------------


def misbehaving(sample: Sample) -> float:
    """1.0, except on a response "hang" (never returns), "slow" (returns after 2 s), "exit" (ends its
    process with exit code 3) or "segv" (a segfault)."""
    if sample.response == "hang":
        time.sleep(10**6)
    elif sample.response == "slow":
        time.sleep(2)
    elif sample.response == "exit":
        os._exit(3)
    elif sample.response == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    return 1.0


def reads_fields(sample: Sample) -> float:
    """len(response) + metadata["bonus"] + the sum of the routed experts (fields a reward process must
    receive intact); NaN for a response "nan", raises on "boom"."""
    if sample.response == "boom":
        raise RuntimeError("boom")
    if sample.response == "nan":
        return float("nan")
    experts = sample.rollout_routed_experts
    routed = 0 if experts is None else int(experts.sum())
    return len(sample.response) + sample.metadata.get("bonus", 0) + routed


async def async_even_tokens(sample: Sample) -> float:
    await asyncio.sleep(0)
    return even_tokens(sample)


def batched_position(samples: list[Sample]) -> list[dict[str, float]]:
    """A batched reward: each sample's position in the batch, as a dict reward."""
    return [{"score": i / len(samples)} for i in range(len(samples))]
