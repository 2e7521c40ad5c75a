"""``tandem export TARGET OUTPUT``: a training checkpoint's policy as an HF safetensors folder.

TARGET: a run directory (its latest checkpoint), ``RUN_DIR/checkpoints/step_K`` or a trainer checkpoint
(tandem/runtime/targets.py) of the FSDP or the Megatron engine (told apart by its marker's format)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def export_checkpoint(checkpoint: Path, output: str | Path, *, dtype: str | None = None, adapter_only: bool = False,
                      force: bool = False) -> Path:
    """The trainer checkpoint's policy as an HF folder (or peft adapter folder), by the engine that saved it."""
    from tandem.engines.training.common.checkpoint import MARKER
    from tandem.engines.training.megatron.checkpoint import FORMAT as MEGATRON

    marker = Path(checkpoint) / MARKER
    saved_by_megatron = marker.is_file() and json.loads(marker.read_text()).get("format") == MEGATRON
    if saved_by_megatron:
        from tandem.engines.training.megatron.export import export_checkpoint as export
    else:  # the FSDP engine's, or its error naming what the folder is not
        from tandem.engines.training.fsdp.export import export_hf as export
    return export(checkpoint, output, dtype=dtype, adapter_only=adapter_only, force=force)


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
    from tandem.runtime.targets import resolve_target

    try:
        checkpoint = resolve_target(args.checkpoint).require_checkpoint("tandem export")
        out = export_checkpoint(checkpoint, args.output, dtype=args.dtype, adapter_only=args.adapter_only,
                                force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
