"""Synthetic tasks shipped with the package, so a demo or a test needs no download.

`arithmetic` makes seeded arithmetic problems with exact integer answers, either bare (``What is 7 +
5?``) or as short word problems (``Mia has 7 apples and gets 5 more. ...``). The same seed always
gives the same problems.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ArithmeticTaskConfig", "arithmetic_records"]

_NAMES = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Zoe", "Max", "Ivy")
_ITEMS = ("apples", "pencils", "books", "stickers", "cookies", "marbles", "cards", "shells")


@dataclass(kw_only=True, slots=True)
class ArithmeticTaskConfig:
    """Seeded arithmetic problems. Operands are drawn uniformly from ``[min_value, max_value]``."""

    num_examples: int = 1000
    min_value: int = 1
    max_value: int = 9
    ops: list[Literal["+", "-", "*"]] = field(default_factory=lambda: ["+"])
    style: Literal["bare", "word"] = "bare"
    instruction: str = "Reply with only the number."
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise ValueError(f"num_examples={self.num_examples} must be >= 1")
        if self.min_value > self.max_value:
            raise ValueError(f"min_value={self.min_value} must be <= max_value={self.max_value}")
        if not self.ops:
            raise ValueError("ops must hold at least one of '+', '-', '*'")


def _problem(rng: random.Random, cfg: ArithmeticTaskConfig) -> tuple[str, int]:
    a, b = rng.randint(cfg.min_value, cfg.max_value), rng.randint(cfg.min_value, cfg.max_value)
    op = rng.choice(cfg.ops)
    if op == "-" and b > a:
        a, b = b, a  # keep answers non-negative: easier for small models, same task
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    if cfg.style == "bare":
        text = f"What is {a} {op} {b}?"
    else:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        verb = {"+": f"gets {b} more", "-": f"gives away {b}", "*": f"gets {b} times as many"}[op]
        text = f"{name} has {a} {item} and {verb}. How many {item} does {name} have now?"
    if cfg.instruction:
        text = f"{text} {cfg.instruction}"
    return text, answer


def arithmetic_records(cfg: ArithmeticTaskConfig) -> list[dict[str, Any]]:
    """``[{"prompt": str, "label": int}, ...]``, ``cfg.num_examples`` of them, seeded."""
    rng = random.Random(cfg.seed)
    return [dict(zip(("prompt", "label"), _problem(rng, cfg), strict=True)) for _ in range(cfg.num_examples)]
