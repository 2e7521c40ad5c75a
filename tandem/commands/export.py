"""``tandem export CHECKPOINT OUTPUT``: a training checkpoint's policy as an HF safetensors folder."""

from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint directory written by the training engine")
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

    try:
        out = export_hf(args.checkpoint, args.output, dtype=args.dtype, adapter_only=args.adapter_only,
                        force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
