"""Soak (issue 23): memory, open files and threads stay flat over many steps in every loop mode.

Runs `bench/soak.py` (a fresh `tandem train` per mode, checkpoints and evaluations along the way): the
bounded version in the suite, the full 1,000 steps as ``slow``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _soak(steps: int) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--steps", str(steps)], cwd=ROOT,
                          capture_output=True, text=True, timeout=steps * 6 + 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("RESULT "), proc.stdout
    return json.loads(line.removeprefix("RESULT "))


def _check(result: dict) -> None:
    assert set(result["modes"]) == {"sync", "one_step_off", "fully_async"}
    for mode, r in result["modes"].items():
        assert r["rss_growth"] < 0.05, (mode, r)
        assert r["fds_growth"] < 0.05 and r["fds_end"] <= r["fds_after_warmup"] + 1, (mode, r)
        assert r["threads_growth"] <= 0, (mode, r)
    assert result["soak_ok"]


def test_a_bounded_soak_in_every_mode_stays_flat():
    _check(_soak(50))


@pytest.mark.slow
def test_a_thousand_steps_in_every_mode_stay_flat():
    _check(_soak(1000))


def test_soak_refuses_too_few_steps():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--steps", "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "at least 20 steps" in proc.stderr
