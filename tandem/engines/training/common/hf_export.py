"""Writing an HF folder from a training checkpoint, for every training engine's export (`tandem export`).

The output is written to ``.<name>.partial`` and renamed into place when complete, like a checkpoint. An
existing ``output`` is replaced only when it is empty or a previous export (it holds `EXPORT_MARKER`), or with
``force``; never the current directory, one of its parents, or the checkpoint being read, even with ``force``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.engines.training.common.checkpoint import publish_dir
from tandem.models.registry import DTYPES

__all__ = ["EXPORT_MARKER", "check_output", "check_dtype", "write_export"]

SHARD_BYTES = 4 << 30  # safetensors files above this size are split, with an index, as HF does
_WEIGHT_FILES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
EXPORT_MARKER = "tandem_export.json"  # written into every export: what may be replaced without --force
_SKIP_FILES = {"model.safetensors.index.json", "tandem_model.json", EXPORT_MARKER}


def _save_shards(tensors: dict[str, torch.Tensor], out: Path, stem: str) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(out / f"{stem}.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_model_files(src: Path, out: Path, dtype: str | None) -> None:
    """config, tokenizer and generation files of the base model (not its weights)."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name not in _SKIP_FILES:
            shutil.copy2(f, out / f.name)
    if dtype and (out / "config.json").is_file():
        cfg = json.loads((out / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _write_adapter_config(lora: dict, base: Path, out: Path) -> None:
    from peft import LoraConfig

    LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["target_modules"]),
        base_model_name_or_path=str(base),
        task_type="CAUSAL_LM",
    ).save_pretrained(str(out))


def check_output(output: str | Path, checkpoint: str | Path, *, force: bool = False) -> Path:
    """The absolute path to export to, or ValueError if writing there would delete what it must not.

    Replacing ``output`` deletes its contents: allowed for a missing or empty folder or a previous
    export (it holds `EXPORT_MARKER`), any other folder only with ``force``; never a file, the
    current directory or one of its parents, or the checkpoint (or a folder holding it).
    """
    final = Path(output).absolute()
    real, cwd = final.resolve(), Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise ValueError(f"refusing to export to {output!r}: it is the current directory or one of its "
                         "parents, and exporting replaces the folder (name a new folder)")
    ckpt = Path(checkpoint).resolve()
    if real == ckpt or real in ckpt.parents:
        raise ValueError(f"refusing to export to {output!r}: it holds the checkpoint {str(checkpoint)!r}")
    if final.is_symlink() or not final.exists():
        return final
    if not final.is_dir():
        raise ValueError(f"refusing to export to {output!r}: it is a file, not a folder")
    if not force and not (final / EXPORT_MARKER).is_file() and any(final.iterdir()):
        raise ValueError(f"refusing to replace {output!r}: it is a folder with files that is not a previous "
                         f"export (no {EXPORT_MARKER}); exporting deletes its contents: pass --force to "
                         "replace it, or name a new folder")
    return final


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")


def write_export(final: Path, tensors: dict[str, torch.Tensor], *, checkpoint: Path, base: Path, dtype: str | None,
                 lora: dict | None, adapter_only: bool) -> Path:
    """Write ``tensors`` (HF names; peft's with ``adapter_only``) as an HF folder, or a peft adapter folder, at
    ``final`` through ``.<name>.partial``; the model files (config, tokenizer) come from ``base``."""
    tmp = final.parent / f".{final.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapter_only:
            _save_shards(tensors, tmp, "adapter_model")
            _write_adapter_config(lora, base, tmp)
        else:
            _save_shards(tensors, tmp, "model")
            _copy_model_files(base, tmp, dtype)
        marker = {"checkpoint": str(checkpoint.absolute()), "dtype": dtype, "adapter_only": adapter_only}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2))
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
