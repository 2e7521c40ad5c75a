"""``tandem report RUN_DIR``: PNG plots (reward, length, KL, entropy, phase times, eval), a summary and an
HTML page (``report/report.html``) holding them, the eval table and the config."""

from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")


def run(args: argparse.Namespace) -> int:
    from tandem.runtime.report import write_report

    try:
        summary = write_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"plots and report.html in {args.run_dir}/report/")
    return 0
