"""Weight updates for the vLLM adapter: check an update against the checkpoint, stage it, LoRA folders.

vLLM repacks weights at load on CPU, so an update is a *reload* (the worker's ``reload_weights``):
vLLM fuses q/k/v and gate/up projections, and a layer that receives only some of its tensors would be
left half-written. An update must therefore hold every weight of the checkpoint (a tied ``lm_head``
may be left out or sent), each with its checkpoint shape and a floating-point dtype; this is checked
before vLLM sees anything, so a rejected update leaves the engine untouched.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.engines.inference.common import CheckpointIndex, lora_adapter_folder, staging_root

__all__ = ["CheckpointIndex", "lora_adapter_folder", "stage_folder", "staging_root", "untied_view"]


def untied_view(folder: Path, root: Path, dtype: torch.dtype) -> Path:
    """A folder that shows vLLM the model of ``folder`` with an untied output head.

    vLLM on CPU packs the output projection into a kernel-specific copy at load. With tied embeddings
    a reload updates the embedding but not that copy (the head layer receives no tensor of its own),
    so the logits would keep the old weights (measured: log-probs off by up to 9 nats after an update).
    Untying makes ``lm_head.weight`` a checkpoint tensor that every reload re-packs. The view holds
    symlinks to ``folder``'s files, a config with ``tie_word_embeddings: false`` and
    ``lm_head.safetensors`` (a copy of the embedding in ``dtype``): same logits, one extra matrix.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(tempfile.mkdtemp(dir=root, prefix="tandem-vllm-untied-"))
    try:
        embed = None
        for f in sorted(folder.iterdir()):
            if f.name == "config.json":
                config = json.loads(f.read_text())
                config["tie_word_embeddings"] = False
                (out / f.name).write_text(json.dumps(config, indent=2))
                continue
            if f.is_file():
                (out / f.name).symlink_to(f.resolve())
            if f.suffix == ".safetensors" and embed is None:
                with safe_open(str(f), framework="pt") as st:
                    if "model.embed_tokens.weight" in st.keys():  # noqa: SIM118
                        embed = st.get_tensor("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{folder}: tied embeddings but no model.embed_tokens.weight")
        save_file({"lm_head.weight": embed.to(dtype).contiguous()}, str(out / "lm_head.safetensors"))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def stage_folder(
    items: Sequence[tuple[str, torch.Tensor]], root: Path, model_folder: Path, dtype: torch.dtype
) -> Path:
    """Write ``items`` (cast to ``dtype``) as one safetensors file in a fresh folder under ``root``.

    The model folder's small files (config, tokenizer) are copied too, so the folder is a complete
    HF model that vLLM's loader accepts. Tensors that share storage (tied weights) are written once each.
    """
    from safetensors.torch import save_file

    out = Path(tempfile.mkdtemp(dir=root, prefix="tandem-vllm-weights-"))
    try:
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, t in items:
            t = t.detach()
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            if t.data_ptr() in seen or not t.is_contiguous():
                t = t.contiguous().clone()
            seen.add(t.data_ptr())
            tensors[name] = t.cpu()
        save_file(tensors, str(out / "model.safetensors"))
        for f in model_folder.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".gguf")):
                shutil.copy2(f, out / f.name)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out
