"""Export a training checkpoint's policy to an HF folder that HF, vLLM, SGLang and Tandem load.

Runs in one process without a process group: DCP reads the sharded checkpoint into an unsharded model
whatever the world size that saved it. The output is written to ``.<name>.partial`` and renamed into
place when complete, like a checkpoint. An existing ``output`` is replaced only when it is empty or a
previous export (it holds `EXPORT_MARKER`), or with ``force``; never the current directory, one of
its parents, or the checkpoint being read, even with ``force``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.engines.training.fsdp.checkpoint import load_model_weights, publish_dir, read_metadata
from tandem.engines.training.fsdp.config import LoRAConfig
from tandem.engines.training.fsdp.lora import apply_lora, hf_tensors
from tandem.engines.training.fsdp.modules import PolicyModel, load_lm
from tandem.models.registry import DTYPES, ModelConfig

__all__ = ["EXPORT_MARKER", "check_output", "export_hf"]

SHARD_BYTES = 4 << 30  # safetensors files above this size are split, with an index, as HF does
_WEIGHT_FILES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
EXPORT_MARKER = "tandem_export.json"  # written into every export: what may be replaced without --force
_SKIP_FILES = {"model.safetensors.index.json", "tandem_model.json", EXPORT_MARKER}


def _policy_from_checkpoint(ckpt_dir: Path, meta: dict) -> tuple[PolicyModel, Path]:
    # the resolved folder, not the name: a relative path or a cache key may differ where export runs
    model_cfg = ModelConfig(**{**meta["model"], "name": meta["model_path"]})
    loaded = load_lm(model_cfg, packing=bool(meta["native"]))
    lora = meta.get("lora")
    if lora:
        from tandem.config import from_dict

        lora_cfg = from_dict(LoRAConfig, lora, path="lora")
        apply_lora(loaded.lm, lora_cfg)
        if lora_cfg.quantize_base is not None:  # QLoRA: the base the adapters were trained on
            from tandem.engines.training.fsdp.modules import output_module_name
            from tandem.engines.training.fsdp.qlora import quantize_base

            quantize_base(loaded.lm, lora_cfg.quantize_base, output_module=output_module_name(loaded))
    policy = PolicyModel(loaded)
    load_model_weights(ckpt_dir, "policy", policy, frozen_params_saved=not lora)
    return policy, Path(loaded.path)


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


def _write_adapter_config(meta: dict, base: Path, out: Path) -> None:
    from peft import LoraConfig

    lora = meta["lora"]
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


def export_hf(
    checkpoint: str | Path, output: str | Path, *, dtype: str | None = None, adapter_only: bool = False,
    force: bool = False,
) -> Path:
    """Write the policy of ``checkpoint`` as an HF folder at ``output``; returns its path.

    Full weights (LoRA merged, peft's arithmetic) by default; ``adapter_only`` writes a peft adapter
    folder (``adapter_model.safetensors`` + ``adapter_config.json``) instead. ``dtype`` casts the
    weights (``float32``, ``bfloat16``, ``float16``); default: the checkpoint's dtype. An existing
    ``output`` is replaced only as `check_output` allows (``force``: any folder but the unsafe ones).
    """
    ckpt_dir = Path(checkpoint)
    final = check_output(output, ckpt_dir, force=force)
    meta = read_metadata(ckpt_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    if adapter_only and not meta.get("lora"):
        raise ValueError(f"{ckpt_dir}: --adapter-only needs a LoRA checkpoint; this one trained all weights")
    policy, base = _policy_from_checkpoint(ckpt_dir, meta)
    with torch.no_grad():
        tensors = {
            name: (t.to(DTYPES[dtype]) if dtype else t).contiguous()
            for name, t in hf_tensors(policy.lm, gather=lambda x: x.detach(), adapter_only=adapter_only)
        }
    tmp = final.parent / f".{final.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapter_only:
            _save_shards(tensors, tmp, "adapter_model")
            _write_adapter_config(meta, base, tmp)
        else:
            _save_shards(tensors, tmp, "model")
            _copy_model_files(base, tmp, dtype)
        marker = {"checkpoint": str(ckpt_dir.absolute()), "dtype": dtype, "adapter_only": adapter_only}
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=2))
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
