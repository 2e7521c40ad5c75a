"""``tandem models``: list the registry, or build a model into the cache and print its folder."""

from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=["list", "prepare"], default="list")
    p.add_argument("name", nargs="?", help="model name or HF folder (for prepare)")


def run(args: argparse.Namespace) -> int:
    from tandem.models import list_models, resolve_model

    if args.action == "list":
        for name, desc in list_models().items():
            print(f"{name:24s} {desc}")
        return 0
    if not args.name:
        print("tandem: error: 'tandem models prepare' needs a model name", file=sys.stderr)
        return 2
    print(resolve_model(args.name))
    return 0
