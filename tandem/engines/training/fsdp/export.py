"""Export a training checkpoint's policy to an HF folder that HF, vLLM, SGLang and Tandem load.

Runs in one process without a process group: DCP reads the sharded checkpoint into an unsharded model
whatever the world size that saved it. Writing the folder: `tandem.engines.training.common.hf_export`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.engines.training.common.hf_export import EXPORT_MARKER, check_dtype, check_output, write_export
from tandem.engines.training.fsdp.checkpoint import load_model_weights, read_metadata
from tandem.engines.training.fsdp.config import LoRAConfig
from tandem.engines.training.fsdp.lora import apply_lora, hf_tensors
from tandem.engines.training.fsdp.modules import PolicyModel, load_lm
from tandem.models.registry import DTYPES, ModelConfig

__all__ = ["EXPORT_MARKER", "check_output", "export_hf"]


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
    check_dtype(dtype)
    if adapter_only and not meta.get("lora"):
        raise ValueError(f"{ckpt_dir}: --adapter-only needs a LoRA checkpoint; this one trained all weights")
    policy, base = _policy_from_checkpoint(ckpt_dir, meta)
    with torch.no_grad():
        tensors = {
            name: (t.to(DTYPES[dtype]) if dtype else t).contiguous()
            for name, t in hf_tensors(policy.lm, gather=lambda x: x.detach(), adapter_only=adapter_only)
        }
    return write_export(final, tensors, checkpoint=ckpt_dir, base=base, dtype=dtype, lora=meta.get("lora"),
                        adapter_only=adapter_only)
