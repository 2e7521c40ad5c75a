"""``tandem config RECIPE [key=value ...]``: validate a recipe and print the resolved config."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. run.seed=3")


def run(args: argparse.Namespace) -> int:
    import yaml

    from tandem.config import load_config, to_dict
    from tandem.runtime.config import RunConfig

    cfg = load_config(RunConfig, args.recipe, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0
