"""Reliability (issue 23): bad inputs, hostile HTTP requests and injected faults, each run for real.

Three groups of cases, each classified from what actually happens:

- ``cli``: bad inputs to ``python -m tandem.cli ...`` (a subprocess in a temporary working directory):
  bad overrides, unknown keys, wrong types, values out of range, duplicate keys, missing or broken
  files, ``--resume`` mistakes, ``tandem export`` onto the working directory or a user's folder,
  ``tandem serve`` / ``report`` / ``eval`` / ``models`` / ``verify-template`` misuse. Outcomes: ``clear``
  (the documented exit code, usually 2, no traceback, exactly one ``tandem: error: ...`` line on stderr
  naming the bad value), ``traceback``, ``hang`` (timeout), ``silent`` (exit 0 where an error was
  due), ``other`` (anything else: wrong code, the line on stdout, the value not named).
- ``http``: ``tandem serve tiny-llama`` started once; malformed and hostile requests (bad JSON,
  NaN / Infinity / 40-digit numbers, wrong types, huge bodies, bad session ids, wrong methods,
  traversal-looking paths, special-token strings, raw garbage on the socket, 200 concurrent good
  requests). Each bad request is followed by a good one on the same keep-alive connection. Outcomes:
  ``ok`` (the expected status class, and the next good request served), ``5xx``, ``conn_error``,
  ``dropped`` (the connection died after the bad request, the server still up), ``down`` (the server
  no longer answers), ``hang``, ``unexpected`` (another non-5xx status than expected).
- ``faults``: short runs of the tiny recipes with a fault injected (a reward that always raises, one
  that hangs, one that kills its worker process, NaN rewards, SIGTERM mid-run then ``--resume``, a
  flipped byte in a checkpoint shard, ``LATEST`` naming a deleted checkpoint, a half-written metrics
  line, the engine process killed, a hung generate function, ``tandem export`` onto a user's folder).
  Outcomes: ``survived`` (what "survived" means is stated per case), ``hang``, ``traceback``, ``lost``
  (steps missing from ``metrics.jsonl`` or user files gone), ``failed``.

    python bench/reliability.py                       # every case (~4 minutes on 2 cores)
    python bench/reliability.py --groups cli,http     # some groups
    python bench/reliability.py --quick               # the subset tests/test_reliability_bench.py runs

Prints a table per group (case, command, outcome, seconds), the summary table of issue 23 and, last,
``RESULT {json}`` with ``bad_inputs``, ``clear_errors``, ``http_cases``, ``http_5xx``, ``faults``,
``survived``, ``hangs``, ``data_lost`` and ``cases`` (``[{group, name, outcome}]``), plus ``http_status``
(status classes over every bad and load request), ``misses`` (the cases that are not clear / ok /
survived, with their output) and ``seconds``. Exit code 0 when every case passed, 1 otherwise. One
progress line per case on stderr.

The cases live in `bench/reliability_{common,cli,http,faults}.py`; this module runs them, reports, and
re-exports the fault plug-ins the runs import by path (``bench.reliability:always_fails``,
...): nothing runs at import.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.reliability_cli import run_cli
from bench.reliability_common import (
    Context,
    Outcome,
    always_fails,  # noqa: F401  (fault plug-ins are imported by this path)
    exits_once,  # noqa: F401  (fault plug-ins are imported by this path)
    hanging_generate,  # noqa: F401  (fault plug-ins are imported by this path)
    hangs_once,  # noqa: F401  (fault plug-ins are imported by this path)
    nan_sometimes,  # noqa: F401  (fault plug-ins are imported by this path)
)
from bench.reliability_faults import fault_cases, run_faults
from bench.reliability_http import run_http

# -- report --------------------------------------------------------------------------------------------------------

PASS = {"cli": "clear", "http": "ok", "faults": "survived"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results: list[Outcome], group: str, extra: str) -> str:
    rows = [r for r in results if r.group == group]
    if not rows:
        return ""
    lines = [f"### {group} ({extra})", "", "| case | command | outcome | s |", "|---|---|---|---|"]
    for r in rows:
        mark = r.outcome if r.outcome == PASS[group] else f"**{r.outcome}**"
        lines.append(f"| {_cell(r.name)} | `{_cell(r.command)}` | {mark} | {r.seconds:.1f} |")
    return "\n".join(lines)


def summarize(results: list[Outcome], statuses: Counter, seconds: float) -> dict:
    cli = [r for r in results if r.group == "cli"]
    http_ = [r for r in results if r.group == "http" and not r.check]
    faults = [r for r in results if r.group == "faults"]
    misses = [r for r in results if r.outcome != PASS[r.group]]
    return {
        "bad_inputs": len(cli),
        "clear_errors": sum(r.outcome == "clear" for r in cli),
        "http_cases": len(http_),
        "http_ok": sum(r.outcome == "ok" for r in http_),
        "http_5xx": sum(r.outcome == "5xx" for r in http_),
        "http_status": dict(sorted(statuses.items())),
        "faults": len(faults),
        "survived": sum(r.outcome == "survived" for r in faults),
        "hangs": sum(r.outcome == "hang" for r in results),
        "data_lost": sum(r.data_lost for r in results),
        "seconds": round(seconds, 1),
        "cases": [{"group": r.group, "name": r.name, "outcome": r.outcome} for r in results],
        "misses": [{"group": r.group, "name": r.name, "outcome": r.outcome, "command": r.command, "output": r.detail}
                   for r in misses],
    }


def summary_table(s: dict) -> str:
    st = s["http_status"]
    status = ", ".join(f"{k}: {v}" for k, v in st.items()) or "-"
    return "\n".join([
        "| measure | figure | aim |",
        "|---|---|---|",
        f"| bad inputs tried / clear errors | {s['bad_inputs']} / {s['clear_errors']} | every one clear |",
        f"| HTTP cases / answered as expected / cases with a 5xx | {s['http_cases']} / {s['http_ok']} / "
        f"{s['http_5xx']} | 0 5xx |",
        f"| HTTP responses by class (bad requests + load) | {status} | no 5xx |",
        f"| faults injected / survived | {s['faults']} / {s['survived']} | every one survived |",
        f"| hangs | {s['hangs']} | 0 |",
        f"| data lost (steps missing after resume, user files changed) | {s['data_lost']} | 0 |",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="cli,http,faults", help="comma-separated: cli, http, faults")
    ap.add_argument("--quick", action="store_true", help="a subset of each group (the test's)")
    ap.add_argument("--json-out", default=None, help="also write the RESULT object to this file")
    ap.add_argument("--cases", default=None, metavar="REGEX", help="only the cases whose name matches (to repeat a miss)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (its path goes to stderr)")
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(PASS))
    if unknown or not groups:
        ap.error(f"--groups: unknown group {unknown[0] if unknown else '(none)'} (choose from cli, http, faults)")
    only = re.compile(args.cases, re.I) if args.cases else None
    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="tandem-reliability-"))
    ctx = Context(scratch)
    results: list[Outcome] = []
    statuses: Counter = Counter()
    try:
        if "cli" in groups:
            results += run_cli(ctx, args.quick, only)
        if "http" in groups:
            http_results, statuses = run_http(ctx, args.quick, only)
            results += http_results
        if "faults" in groups:
            results += run_faults(ctx, args.quick, only)
    finally:
        if args.keep:
            print(f"[scratch] {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    s = summarize(results, statuses, time.monotonic() - start)
    notes = {"cli": "outcome clear: the documented exit code, one `tandem: error:` line naming the value, no "
                    "traceback",
             "http": "outcome ok: the expected status, then a good request served on the same connection",
             "faults": "outcome survived: see the case"}
    for g in groups:
        print(table(results, g, notes[g]))
        print()
    if any(r.group == "faults" for r in results):
        print("what survived means, per fault:\n")
        for c in fault_cases():
            if any(r.name == c.name for r in results):
                print(f"- {c.name}: {c.survived_means}")
        print()
    print("### summary (issue 23)\n")
    print(summary_table(s))
    print()
    if s["misses"]:
        print("### misses\n")
        for m in s["misses"]:
            print(f"- [{m['group']}] {m['name']}: **{m['outcome']}**\n  - command: `{m['command']}`\n"
                  f"  - output: {m['output']}")
        print()
    print(f"{len(results)} cases in {s['seconds']:.0f}s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(s, indent=1))
    print("RESULT " + json.dumps(s), flush=True)
    return 0 if not s["misses"] else 1


if __name__ == "__main__":
    sys.exit(main())
