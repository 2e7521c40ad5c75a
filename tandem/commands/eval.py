"""``tandem eval TARGET [key=value ...] [--recipe RECIPE]``: evaluate a model or a checkpoint on eval sets.

TARGET is a run directory (its latest checkpoint), a run checkpoint (``runs/NAME/checkpoints/step_K``),
a trainer checkpoint, an HF folder or a registry name (tandem/runtime/targets.py). A checkpoint is
exported to a temporary HF folder first. The recipe gives the eval sets (``eval.sets``), the reward,
the generate function and the inference engine; its ``model`` is replaced by the target. Without
``--recipe``, a run or run checkpoint is evaluated with the configuration it was trained with (the
checkpoint's ``config.yaml``, else the run's); a model or trainer checkpoint needs one. Prints a
table and writes the metrics as JSON (``--out``, default ``eval.json`` beside a run target, else the
working directory).
"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET", help="a run dir, a run or trainer checkpoint, an HF folder or a model name")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. eval.sets[0].n=8")
    p.add_argument("--recipe", help="the recipe whose eval sets, reward and engine to use (default for a run or run "
                                    "checkpoint: the config.yaml it was trained with)")
    p.add_argument("--sets", default=None, help="comma-separated eval set names to run (default: all)")
    p.add_argument("--out", default=None, help="JSON file to write (default: eval.json beside a run, else ./eval.json)")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    import logging
    import shutil
    import tempfile
    from pathlib import Path

    from tandem.config import ConfigError, load_config
    from tandem.runtime.config import RunConfig
    from tandem.runtime.targets import TargetError, resolve_target

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        target = resolve_target(args.target)
    except TargetError as e:
        raise ConfigError(str(e)) from None
    if args.recipe is None:
        args.recipe = _trained_config(target, args.target)
    cfg = load_config(RunConfig, args.recipe, args.overrides)
    sets = cfg.eval.sets
    if args.sets:
        wanted = [s.strip() for s in args.sets.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {s.name for s in sets})
        if unknown:
            raise ConfigError(f"--sets: no eval set {unknown[0]!r} in {args.recipe} "
                              f"(sets: {', '.join(s.name for s in sets) or 'none'})")
        sets = [s for s in sets if s.name in wanted]
    if not sets:
        raise ConfigError(f"{args.recipe} has no eval sets (eval.sets): nothing to evaluate")
    workdir = Path(tempfile.mkdtemp(prefix="tandem-eval-"))
    try:
        model = target.model
        if model is None:  # a checkpoint: its policy as an HF folder
            from tandem.commands.export import export_checkpoint

            try:
                model = str(export_checkpoint(target.require_checkpoint("tandem eval"), workdir / "model"))
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"tandem eval {args.target}: {e}") from None
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=model),
                                  eval=dataclasses.replace(cfg.eval, sets=sets))
        metrics = _evaluate(cfg)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out) if args.out else (target.run_dir / "eval.json" if target.run_dir else Path("eval.json"))
    out.write_text(json.dumps({"target": args.target, "kind": target.kind, "metrics": metrics}, indent=1))
    print(format_table(metrics))
    print(f"wrote {out}")
    return 0


def _trained_config(target, name: str) -> str:
    """The configuration a run target was trained with: its checkpoint's ``config.yaml``, else the run's."""
    from tandem.config import ConfigError

    for folder in (target.run_checkpoint, target.run_dir):
        if folder is not None and (folder / "config.yaml").is_file():
            return str(folder / "config.yaml")
    if target.run_dir is not None:
        raise ConfigError(f"tandem eval {name}: the run has no config.yaml (neither in {target.run_checkpoint} nor "
                          f"in {target.run_dir}): name the recipe with --recipe")
    raise ConfigError(f"tandem eval {name}: a {target.kind.replace('_', ' ')} carries no recipe: name the one "
                      "whose eval sets, reward and engine to use with --recipe")


def _evaluate(cfg) -> dict[str, float]:
    from tandem.models import load_tokenizer
    from tandem.runtime import builders
    from tandem.runtime.evaluation import Evaluator

    plan_facts = builders.run_facts(cfg)
    entry = cfg.inference.entry
    engine = entry.spec(entry.configure(plan_facts, cfg.inference.config)).build()
    try:
        evaluator = Evaluator(cfg.eval, engine=engine, tokenizer=load_tokenizer(cfg.model.name),
                              generate=builders.check_rollout(cfg), run_reward=cfg.reward, rollout_config=cfg.rollout)
        try:
            return evaluator.run()
        finally:
            evaluator.close()
    finally:
        engine.close()


def format_table(metrics: dict[str, float]) -> str:
    """One row per eval set, one column per metric."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval":
            rows.setdefault(parts[1], {})[parts[2]] = value
    columns = sorted({c for r in rows.values() for c in r}, key=lambda c: (c not in ("prompts", "samples"), c))
    header = ["set", *columns]
    lines = [header] + [[name, *(f"{r.get(c, float('nan')):.3g}" for c in columns)] for name, r in rows.items()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
