"""tcmalloc keeping what a step freed (``TCMALLOC_RELEASE_RATE=0``, the default since 2026-12-06) vs handing
pages back gradually (gperftools' own default, rate 1), on the recipes of `bench/lora.py`.

    .venv/bin/python bench/tcmalloc_release.py [--arms full,lora,qlora] [--steps 3] [--repeats 3]

`tandem.runtime.allocator.reexec_under` restarts a run under tcmalloc and, unless the environment already
names a rate, sets ``TCMALLOC_RELEASE_RATE=0``. Each repeat runs each recipe once per rate, each run a fresh
process (`bench/lora.py --child`: the recipe's run built as `tandem train` builds it, ``--steps`` steps), the
rates' order alternating. Reported per recipe and rate: peak RSS (median and min-max), minor page faults,
seconds per step (each run's first step left out). Both rates run the same work: the same seeds, and the
allocator does not change a value, so the rewards agree (checked: ``same_rewards``).

RESULT keys: ``peak_rss_mib`` and ``minor_faults`` per recipe and rate (``rate0``, ``rate1``),
``peak_ratio_rate0_over_rate1`` per recipe, ``same_rewards``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATES = {"rate0": "0", "rate1": "1"}


def _child(arm: str, rate: str, steps: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TCMALLOC_RELEASE_RATE": rate}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lora.py"), "--child", arm, "--steps", str(steps),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} at rate {rate}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="full,lora,qlora", help="bench/lora.py recipes (comma-separated)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="runs per recipe and rate, alternating")
    a = p.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if a.repeats < 3:
        p.error(f"--repeats={a.repeats}: at least 3 for a median and a spread")
    if a.steps < 2:
        p.error(f"--steps={a.steps}: at least 2 (each run's first step is left out of the step time)")
    runs: dict[str, dict[str, list[dict]]] = {arm: {r: [] for r in RATES} for arm in arms}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-release-") as tmp:
        for rep in range(a.repeats):
            for arm in arms:
                for rate in (list(RATES) if rep % 2 == 0 else list(RATES)[::-1]):
                    r = _child(arm, RATES[rate], a.steps, Path(tmp) / f"{arm}-{rate}-{rep}")
                    if r["allocator"] != "tcmalloc":
                        raise SystemExit(f"the run ran on {r['allocator']}, not tcmalloc: nothing to compare "
                                         "(make allocator)")
                    runs[arm][rate].append(r)
                    print(f"repeat {rep + 1}/{a.repeats} {arm:>5} {rate}: peak {r['peak_rss_mib']:.0f} MiB, "
                          f"{r['minor_faults']} minor faults, steps {', '.join(f'{s:.2f}' for s in r['step_s'])} s",
                          file=sys.stderr, flush=True)
    result: dict = {"steps": a.steps, "repeats": a.repeats, "peak_rss_mib": {}, "peak_rss_min_max": {},
                    "minor_faults": {}, "s_per_step": {}, "peak_ratio_rate0_over_rate1": {}}
    rewards = set()
    for arm in arms:
        for key in ("peak_rss_mib", "peak_rss_min_max", "minor_faults", "s_per_step"):
            result[key][arm] = {}
        for rate, rs in runs[arm].items():
            peaks = [r["peak_rss_mib"] for r in rs]
            steps = [s for r in rs for s in r["step_s"][1:]]
            result["peak_rss_mib"][arm][rate] = round(statistics.median(peaks))
            result["peak_rss_min_max"][arm][rate] = f"{min(peaks):.0f}-{max(peaks):.0f}"
            result["minor_faults"][arm][rate] = round(statistics.median(r["minor_faults"] for r in rs))
            result["s_per_step"][arm][rate] = round(statistics.median(steps), 2)
            rewards.update((arm, json.dumps(r["reward"])) for r in rs)
        result["peak_ratio_rate0_over_rate1"][arm] = round(
            result["peak_rss_mib"][arm]["rate0"] / result["peak_rss_mib"][arm]["rate1"], 3)
        print(f"{arm:>5}: peak {result['peak_rss_mib'][arm]['rate0']} MiB ({result['peak_rss_min_max'][arm]['rate0']}) "
              f"at rate 0 vs {result['peak_rss_mib'][arm]['rate1']} ({result['peak_rss_min_max'][arm]['rate1']}) at rate 1; "
              f"faults {result['minor_faults'][arm]['rate0']} vs {result['minor_faults'][arm]['rate1']}; "
              f"s/step {result['s_per_step'][arm]['rate0']} vs {result['s_per_step'][arm]['rate1']}")
    result["same_rewards"] = len(rewards) == len(arms)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
