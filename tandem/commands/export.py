"""``tandem export TARGET OUTPUT``: a training checkpoint's policy as an HF safetensors folder.

TARGET: a run directory (its latest checkpoint), ``RUN_DIR/checkpoints/step_K`` or a trainer checkpoint
(tandem/runtime/targets.py)."""

from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="TARGET",
                   help="a run directory (its latest checkpoint), RUN_DIR/checkpoints/step_K, or a trainer checkpoint")
    p.add_argument("output", help="folder to write; an existing one is replaced only if it is empty or a "
                                  "previous export (else see --force)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast the weights"
    )
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA checkpoints: write the peft adapter instead of merged full weights",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUTPUT even if it is a folder with files that is not a previous export "
             "(never the current directory, one of its parents, or the checkpoint)",
    )


def run(args: argparse.Namespace) -> int:
    from tandem.engines.training.fsdp.export import export_hf
    from tandem.runtime.targets import resolve_target

    try:
        checkpoint = resolve_target(args.checkpoint).require_checkpoint("tandem export")
        out = export_hf(checkpoint, args.output, dtype=args.dtype, adapter_only=args.adapter_only,
                        force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
