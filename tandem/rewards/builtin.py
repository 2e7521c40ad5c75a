"""Built-in reward functions. Each factory takes its keyword options and returns ``fn(sample) -> float``.

They read ``sample.response`` (decoded text), ``sample.label`` and ``sample.response_length``.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable
from typing import Any

from tandem.core.sample import Sample

RewardFn = Callable[[Sample], Any]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The last number in ``text`` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    return _to_number(found[-1]) if found else None


def first_number(text: str) -> float | None:
    """The first number in ``text`` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    return _to_number(found[0]) if found else None


def _label_number(label: Any) -> float | None:
    if isinstance(label, bool):
        return None
    if isinstance(label, int | float):
        return float(label)
    if isinstance(label, str):
        if "####" in label:
            label = label.split("####")[-1]
        return last_number(label)
    return None


def number(*, position: str = "last", tolerance: float = 1e-6) -> RewardFn:
    """1.0 if the response's last (or first) number equals the numeric label, else 0.0."""
    if position not in ("last", "first"):
        raise ValueError(f"number reward: position={position!r} must be 'last' or 'first'")

    def fn(sample: Sample) -> float:
        gold = _label_number(sample.label)
        if gold is None:
            raise ValueError(f"label {sample.label!r} holds no number")
        found = _NUMBER.findall(sample.response)
        if not found:
            return 0.0
        got = _to_number(found[-1] if position == "last" else found[0])
        return float(got is not None and abs(got - gold) <= tolerance)

    return fn


def gsm8k() -> RewardFn:
    """GSM8K convention: the gold answer follows ``####`` in the label; the response's ``#### x`` if
    present, else its last number, must equal it."""

    def fn(sample: Sample) -> float:
        gold = _label_number(sample.label)
        if gold is None:
            raise ValueError(f"label {sample.label!r} holds no '#### answer' or number")
        text = sample.response
        got = last_number(text.split("####")[-1]) if "####" in text else last_number(text)
        return float(got is not None and abs(got - gold) <= 1e-6)

    return fn


def math() -> RewardFn:
    """Mathematical equivalence via the `math-verify` library (``\\boxed{}`` or the final answer)."""
    from math_verify import parse, verify

    def fn(sample: Sample) -> float:
        # Timeouts are signal-based in math-verify and only work in the main thread; the reward pool
        # enforces its own timeout, so they are disabled here.
        gold = parse(str(sample.label), parsing_timeout=None)
        if not gold:
            gold = parse(f"${sample.label}$", parsing_timeout=None)
        pred = parse(sample.response, parsing_timeout=None)
        return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None))

    return fn


def _normalize(text: str, lowercase: bool = True) -> str:
    text = text.strip()
    if lowercase:
        text = text.lower()
    return " ".join(text.split())


def exact_match(*, lowercase: bool = True) -> RewardFn:
    """1.0 if the whitespace-normalised response equals the label (case-insensitive by default)."""

    def fn(sample: Sample) -> float:
        return float(_normalize(sample.response, lowercase) == _normalize(str(sample.label), lowercase))

    return fn


def _squad_tokens(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def f1() -> RewardFn:
    """Token-level F1 between response and label (SQuAD normalisation); a list label takes the best."""

    def score(pred: str, gold: str) -> float:
        p, g = _squad_tokens(pred), _squad_tokens(gold)
        if not p or not g:
            return float(p == g)
        common = sum((collections.Counter(p) & collections.Counter(g)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)

    def fn(sample: Sample) -> float:
        golds = sample.label if isinstance(sample.label, list) else [sample.label]
        return max(score(sample.response, str(g)) for g in golds)

    return fn


_CHOICE = re.compile(r"\b([A-J])\b")


def multiple_choice(*, choices: str = "ABCDEFGHIJ") -> RewardFn:
    """1.0 if the chosen letter equals the label. The choice is the letter after 'answer is' /
    'Answer:' if present, else the last standalone capital letter among ``choices``."""
    anchored = re.compile(r"answer(?:\s+is)?\s*[:\-]?\s*\(?([A-J])\)?", re.IGNORECASE)

    def fn(sample: Sample) -> float:
        gold = str(sample.label).strip().upper()[:1]
        m = anchored.findall(sample.response)
        picks = [x.upper() for x in m] if m else _CHOICE.findall(sample.response)
        picks = [x for x in picks if x in choices]
        return float(bool(picks) and picks[-1] == gold)

    return fn


def format_regex(*, pattern: str, full_match: bool = False) -> RewardFn:
    """1.0 if the response matches ``pattern`` (re.search, or fullmatch with ``full_match``)."""
    rx = re.compile(pattern, re.DOTALL)
    match = rx.fullmatch if full_match else rx.search

    def fn(sample: Sample) -> float:
        return float(match(sample.response.strip() if full_match else sample.response) is not None)

    return fn


def length_penalty(*, target_tokens: int, coef: float = 1.0) -> RewardFn:
    """``-coef * max(0, response_tokens - target) / target``: zero up to the target length."""
    if target_tokens <= 0:
        raise ValueError(f"length_penalty: target_tokens={target_tokens} must be > 0")

    def fn(sample: Sample) -> float:
        return -coef * max(0, sample.response_length - target_tokens) / target_tokens

    return fn


BUILTINS: dict[str, Callable[..., RewardFn]] = {
    "number": number,
    "gsm8k": gsm8k,
    "math": math,
    "exact_match": exact_match,
    "f1": f1,
    "multiple_choice": multiple_choice,
    "format": format_regex,
    "length_penalty": length_penalty,
}
