"""The ``tandem`` command line.

Each command lives in ``tandem/commands/<name>.py`` with ``configure(parser)`` and ``run(args) -> int``.
Command modules import only the standard library at the top, so ``tandem --help`` stays fast and
imports no engine; heavy imports happen inside ``run``.

Configuration errors (bad recipe, unknown key, bad value, missing file, bad plugin path) print one
line, ``tandem: error: ...``, and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> one-line help. Commands are added by the issues that build them.
COMMANDS: dict[str, str] = {
    "config": "validate a recipe with overrides and print the resolved config",
    "models": "list the model registry or prepare a model in the cache",
    "export": "write a training checkpoint's policy as an HF safetensors folder",
    "report": "write PNG plots and a summary of a run directory",
    "train": "run the RL loop on a recipe (GRPO, PPO, ...)",
    "serve": "serve OpenAI-compatible chat sessions (token-in-token-out) for agents",
    "verify-template": "check that a chat template is prefix-stable for multi-turn token-in-token-out",
}


def build_parser() -> argparse.ArgumentParser:
    from tandem import __version__

    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: PyTorch-native RL post-training for LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, help_text in COMMANDS.items():
        mod = importlib.import_module(f"tandem.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.configure(p)
        p.set_defaults(_module=mod)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from tandem.config import ConfigError
    from tandem.plugins import PluginError

    errors: list[type[BaseException]] = [ConfigError, PluginError]
    if "tandem.models.registry" in sys.modules:
        errors.append(sys.modules["tandem.models.registry"].ModelNotFoundError)
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except _user_errors() as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
