"""Issue 23 as one script: `bench/reliability.py` runs bad CLI inputs, hostile HTTP requests and injected
faults against the real `tandem` command and server, and classifies each outcome.

The suite runs its ``--quick`` subset (~45 s on 2 cores); the whole bench (~4 minutes) is ``slow``. Both
assert the aims of the issue: every bad input a clear error, no 5xx, no hang, no data lost, every fault
survived. ``KNOWN`` lists the misses of bugs that are reported and not fixed yet, each with the outcome it
has today: another outcome of a known case fails the test, and so does a known case that now passes
(remove it from ``KNOWN`` then), as a strict xfail would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "bench" / "reliability.py"
PASS = {"cli": "clear", "http": "ok", "faults": "survived"}

# (group, case) -> its outcome today, while the bug behind it is open (docs/reliability.md, "Figures")
KNOWN_QUICK: dict[tuple[str, str], str] = {}
KNOWN_FULL: dict[tuple[str, str], str] = {**KNOWN_QUICK}


def _bench(*args: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert proc.returncode == (1 if result["misses"] else 0), proc.stderr[-3000:]
    return result


def _check(result: dict, known: dict[tuple[str, str], str]) -> None:
    outcomes = {(c["group"], c["name"]): c["outcome"] for c in result["cases"]}
    misses = {k: v for k, v in outcomes.items() if v != PASS[k[0]]}
    new = [m for m in result["misses"] if known.get((m["group"], m["name"])) != m["outcome"]]
    assert not new, "\n".join(f"[{m['group']}] {m['name']}: {m['outcome']}\n  {m['command']}\n  {m['output']}"
                              for m in new)
    fixed = sorted(k for k in known if k in outcomes and k not in misses)
    assert not fixed, f"these known misses pass now: remove them from KNOWN: {fixed}"
    known_faults = sum(1 for g, _ in misses if g == "faults")
    known_cli = sum(1 for g, _ in misses if g == "cli")
    known_5xx = sum(1 for k, v in misses.items() if k[0] == "http" and v == "5xx")
    assert result["clear_errors"] == result["bad_inputs"] - known_cli
    assert result["survived"] == result["faults"] - known_faults
    assert result["http_5xx"] == known_5xx
    assert result["hangs"] == 0
    assert result["data_lost"] == 0


def test_the_quick_reliability_cases():
    result = _bench("--quick", timeout=300)
    groups = Counter(c["group"] for c in result["cases"])
    assert set(groups) == {"cli", "http", "faults"} and sum(groups.values()) >= 10, groups
    _check(result, KNOWN_QUICK)


@pytest.mark.slow
def test_every_reliability_case():
    result = _bench(timeout=1500)
    assert result["bad_inputs"] >= 40 and result["http_cases"] >= 25 and result["faults"] >= 10
    _check(result, KNOWN_FULL)


# -- the classification itself: each kind of miss is caught --------------------------------------------------


def _module():
    """The bench's CLI group (`bench/reliability_cli.py`, with the shared `Proc`)."""
    from types import SimpleNamespace

    from bench.reliability_cli import classify_cli
    from bench.reliability_common import Proc

    return SimpleNamespace(classify_cli=classify_cli, Proc=Proc)


@pytest.mark.parametrize("rc, out, err, outcome", [
    (2, "", "tandem: error: run.steps: expected an integer, got 'abc'\n", "clear"),
    (2, "", "usage: tandem serve ...\ntandem serve: error: argument --port: invalid int value: 'abc'\n", "clear"),
    (None, "", "", "hang"),
    (0, "run: ...\n", "", "silent"),
    (1, "", "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: abc\n", "traceback"),
    (2, "tandem: error: run.steps: expected an integer, got 'abc'\n", "", "other"),  # on stdout
    (2, "", "tandem: error: something is wrong\n", "other"),  # the value is not named
    (2, "", "tandem: error: abc\ntandem: error: abc again\n", "other"),  # two error lines
    (1, "", "tandem: error: run.steps: expected an integer, got 'abc'\n", "other"),  # another exit code
])
def test_the_classification_catches_each_kind_of_miss(rc, out, err, outcome):
    bench = _module()
    got, _ = bench.classify_cli(bench.Proc(rc, out, err, 0.1), (2,), ["abc"])
    assert got == outcome


def test_the_check_fails_on_a_new_miss_and_on_a_fixed_known_one():
    def result(outcomes: dict[tuple[str, str], str]) -> dict:
        cases = [{"group": g, "name": n, "outcome": o} for (g, n), o in outcomes.items()]
        misses = [{**c, "command": "c", "output": "o"} for c in cases if c["outcome"] != PASS[c["group"]]]
        cli = [c for c in cases if c["group"] == "cli"]
        faults = [c for c in cases if c["group"] == "faults"]
        return {"cases": cases, "misses": misses, "bad_inputs": len(cli),
                "clear_errors": sum(c["outcome"] == "clear" for c in cli), "faults": len(faults),
                "survived": sum(c["outcome"] == "survived" for c in faults),
                "http_5xx": sum(c["outcome"] == "5xx" for c in cases), "hangs": 0, "data_lost": 0}

    known = {("faults", "f"): "traceback"}
    good = {("cli", "a"): "clear", ("http", "b"): "ok", ("faults", "f"): "traceback"}
    _check(result(good), known)
    with pytest.raises(AssertionError, match="a: traceback"):
        _check(result({**good, ("cli", "a"): "traceback"}), known)  # a regression
    with pytest.raises(AssertionError, match="b: 5xx"):
        _check(result({**good, ("http", "b"): "5xx"}), known)
    with pytest.raises(AssertionError, match="f: hang"):
        _check(result({**good, ("faults", "f"): "hang"}), known)  # a known case that got worse
    with pytest.raises(AssertionError, match="remove them from KNOWN"):
        _check(result({**good, ("faults", "f"): "survived"}), known)  # fixed
