"""``tandem train RECIPE [key=value ...] [--resume RUN_DIR | RUN_DIR/checkpoints/step_K]``: run the RL loop."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. run.steps=5")
    p.add_argument("--run-dir", help="output folder (default: <run.output_dir>/<run.name>)")
    p.add_argument("--resume", metavar="TARGET",
                   help="continue a run: its directory (from its latest checkpoint) or one of its checkpoints "
                        "(RUN_DIR/checkpoints/step_K)")
    p.add_argument("--debug-train-only", metavar="DUMP_DIR",
                   help="train on the rollouts a run dumped (rollout.dump=true) instead of generating")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in the run directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar; one log line per step")


def _allocator_choice(recipe: str, overrides: list[str]) -> str | None:
    """``runtime.allocator`` as the recipe and overrides give it, read without building the config (no torch
    import); None when it cannot be read (the full config build reports why)."""
    from tandem.config import ConfigError, apply_overrides, read_yaml
    from tandem.runtime.allocator import DEFAULT_CHOICE

    try:
        data = apply_overrides(read_yaml(recipe), overrides)
    except ConfigError:
        return None
    runtime = data.get("runtime")
    if runtime is None:
        return DEFAULT_CHOICE
    choice = runtime.get("allocator", DEFAULT_CHOICE) if isinstance(runtime, dict) else None
    return choice if isinstance(choice, str) else None


def run(args: argparse.Namespace) -> int:
    import logging
    import sys
    from pathlib import Path

    from tandem.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides) + (["tracking.progress=false"] if args.quiet else [])
    if args.debug_train_only:
        overrides.append(f"rollout.load_dump={args.debug_train_only}")
    from tandem.runtime.allocator import AllocatorError, reexec_under

    if getattr(args, "owns_process", False):  # never restart a program that called cli.main itself
        # restart before the full config is built: building it imports torch (~2 s), which the restarted
        # process would import again; the restarted process reports the config's errors
        choice = _allocator_choice(args.recipe, overrides)
        if choice is not None:
            with contextlib.suppress(AllocatorError):  # reported below, after the config's own errors
                reexec_under(choice)
    from tandem.runtime.config import RunConfig

    cfg = load_config(RunConfig, args.recipe, overrides)  # every error is reported before any work

    try:  # restarts this command under tcmalloc/jemalloc when one is installed (runtime.allocator)
        if getattr(args, "owns_process", False):  # never restart a program that called cli.main itself
            reexec_under(cfg.runtime.allocator)
    except AllocatorError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    from tandem.runtime.checkpoint import CheckpointError
    from tandem.runtime.engine_wire import EngineProcessError
    from tandem.runtime.loop import Run
    from tandem.runtime.preemption import Preempted
    from tandem.runtime.watchdog import SkippedStepsError, Stalled

    resume_from = None
    if args.resume:
        from tandem.config import ConfigError
        from tandem.runtime.targets import TargetError, resolve_target

        try:
            target = resolve_target(args.resume)
        except TargetError as e:
            raise ConfigError(f"--resume: {e}") from None
        if target.kind not in ("run", "run_checkpoint"):
            raise ConfigError(f"--resume {args.resume}: a {target.kind.replace('_', ' ')} is not a run to continue "
                              "(give the run directory or RUN_DIR/checkpoints/step_K)")
        run_dir = target.run_dir
        resume_from = target.run_checkpoint if target.kind == "run_checkpoint" else None
    else:
        run_dir = Path(args.run_dir or Path(cfg.run.output_dir) / cfg.run.name)
    try:
        with _sigterm_interrupts():  # while it builds: a SIGTERM releases what exists (the loop handles later ones)
            run = Run(cfg, run_dir, resume=bool(args.resume), overwrite=args.overwrite, resume_from=resume_from)
    except (FileExistsError, FileNotFoundError, CheckpointError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run.train()
    except Preempted as stop:
        how = f"continue with: tandem train {args.recipe} --resume {run_dir}" if stop.checkpoint else "nothing saved"
        print(f"tandem: {stop}; {how}", file=sys.stderr)
        return stop.exit_code
    except (Stalled, SkippedStepsError, CheckpointError, EngineProcessError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    for k, v in summary.items():
        print(f"{k}: {v}")
    return 0


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (as SIGINT does) inside the block, so start-up cleans up after itself."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
