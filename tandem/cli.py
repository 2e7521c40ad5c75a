"""The ``tandem`` command line.

Each command lives in ``tandem/commands/<name>.py`` with ``configure(parser)`` and ``run(args) -> int``.
Command modules import only the standard library at the top, so ``tandem --help`` stays fast and
imports no engine; heavy imports happen inside ``run``.

Configuration errors (bad recipe, unknown key, bad value, missing file, bad plugin path, bad data)
print one line, ``tandem: error: ...``, and exit with code 2; no traceback unless ``--debug`` (before
or after the command), which prints the traceback first.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

# name -> one-line help. Commands are added by the issues that build them.
COMMANDS: dict[str, str] = {
    "config": "validate a recipe with overrides and print the resolved config",
    "models": "list the model registry or prepare a model in the cache",
    "export": "write a training checkpoint's policy as an HF safetensors folder",
    "eval": "evaluate a run, a checkpoint or a model on a recipe's eval sets",
    "report": "write PNG plots and a summary of a run directory",
    "train": "run the RL loop on a recipe (GRPO, PPO, ...)",
    "serve": "serve OpenAI-compatible chat sessions (token-in-token-out) for agents",
    "verify-template": "check that a chat template is prefix-stable for multi-turn token-in-token-out",
    "plan": "choose the engine pair, parallelism and placement for a model and cluster; write the recipe",
}


def build_parser() -> argparse.ArgumentParser:
    from tandem import __version__

    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: PyTorch-native RL post-training for LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, help_text in COMMANDS.items():
        mod = importlib.import_module(f"tandem.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS: the command's parser sets debug only when given, so 'tandem --debug CMD' holds too
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
        mod.configure(p)
        p.set_defaults(_module=mod)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from tandem.config import ConfigError
    from tandem.plugins import PluginError

    errors: list[type[BaseException]] = [ConfigError, PluginError]
    # start-up refusals of modules the command imported (looked up, not imported: `--help` stays light)
    for module, name in (("tandem.models.registry", "ModelNotFoundError"), ("tandem.core.contracts", "ContractError"),
                         ("tandem.engines.registry", "Unsupported")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # known args first: argparse ends a command's positionals at its first option, so the overrides of
    # `tandem train RECIPE --run-dir D key=value` (what `make demo DEMO_ARGS=...` runs) would be refused
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
            args.overrides = [*args.overrides, *extra]  # after the ones before the options: order kept
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # the process is this command (console script / python -m tandem), not a caller of main(): only then
    # may a command restart it (tandem train under tcmalloc, tandem/runtime/allocator.py)
    args.owns_process = argv is None
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except _user_errors() as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"tandem: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
