"""Weight updates for the vLLM adapter: check an update against the checkpoint, stage it, LoRA folders.

vLLM repacks weights at load on CPU, so an update is a *reload* (the worker's ``reload_weights``):
vLLM fuses q/k/v and gate/up projections, and a layer that receives only some of its tensors would be
left half-written. An update must therefore hold every weight of the checkpoint (a tied ``lm_head``
may be left out or sent), each with its checkpoint shape and a floating-point dtype; this is checked
before vLLM sees anything, so a rejected update leaves the engine untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["CheckpointIndex", "lora_adapter_folder", "stage_folder", "staging_root", "untied_view"]

_SHOWN = 5


class CheckpointIndex:
    """Names and shapes of a model folder's weights (read from the safetensors headers)."""

    def __init__(self, folder: Path, *, tied_embeddings: bool) -> None:
        from safetensors import safe_open

        self.folder = folder
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())
        if not self.shapes:
            raise ValueError(f"{folder} holds no *.safetensors weights (vLLM needs the safetensors folder)")
        self.optional: set[str] = set()
        if tied_embeddings and "model.embed_tokens.weight" in self.shapes:
            # a trainer may send the tied output projection under its own name too
            self.optional.add("lm_head.weight")
            self.shapes.setdefault("lm_head.weight", self.shapes["model.embed_tokens.weight"])

    def check(self, items: Sequence[tuple[str, torch.Tensor]], version: int) -> None:
        """Raise ValueError naming every problem if ``items`` is not a complete, well-formed update."""
        errors: list[str] = []
        seen: set[str] = set()
        for name, tensor in items:
            shape = self.shapes.get(name)
            if name in seen:
                errors.append(f"{name} sent twice")
            elif shape is None:
                errors.append(f"unknown weight {name!r}")
            elif not isinstance(tensor, torch.Tensor):
                errors.append(f"{name}: {type(tensor).__name__} is not a tensor")
            elif tuple(tensor.shape) != shape:
                errors.append(f"{name}: shape {tuple(tensor.shape)} != engine shape {shape}")
            elif not tensor.is_floating_point():
                errors.append(f"{name}: dtype {tensor.dtype} is not floating point")
            seen.add(name)
        missing = sorted(set(self.shapes) - seen - self.optional)
        if missing:
            errors.append(
                f"{len(missing)} weight(s) missing, e.g. {missing[0]!r} (vLLM reloads whole layers: "
                "send every weight of the model)"
            )
        if errors:
            more = f" (+{len(errors) - _SHOWN} more)" if len(errors) > _SHOWN else ""
            raise ValueError(
                f"update_weights(version={version}) rejected, weights untouched: "
                + "; ".join(errors[:_SHOWN]) + more
            )

    def check_folder(self, folder: Path, version: int) -> None:
        """The same check for a safetensors folder (names and shapes only, nothing is read)."""
        other = CheckpointIndex(folder, tied_embeddings=False)
        meta = [(n, torch.empty(s, dtype=torch.float32, device="meta")) for n, s in other.shapes.items()]
        self.check(meta, version)


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


def staging_root(preferred: str | None) -> Path:
    """Where staged updates go: ``preferred``, else /dev/shm (memory, no disk write), else the temp dir."""
    if preferred:
        root = Path(preferred)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        root = Path("/dev/shm")
    else:
        root = Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return root


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


def lora_adapter_folder(
    items: Sequence[tuple[str, torch.Tensor]], root: Path, base: CheckpointIndex, *, alpha: float, max_rank: int
) -> Path:
    """A peft adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) from peft-named
    tensors (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``); checked against the base."""
    from safetensors.torch import save_file

    errors: list[str] = []
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in items:
        prefix, _, rest = name.partition("base_model.model.")
        module, _, part = rest.rpartition(".lora_")
        if prefix or part not in ("A.weight", "B.weight"):
            errors.append(f"{name!r} is not a peft LoRA tensor name (base_model.model.<module>.lora_A.weight)")
            continue
        if f"{module}.weight" not in base.shapes:
            errors.append(f"{name}: the base model has no {module}.weight")
            continue
        modules.setdefault(module, {})[part[0]] = t
    ranks = set()
    for module, parts in modules.items():
        if set(parts) != {"A", "B"}:
            errors.append(f"{module}: lora_A and lora_B must come together")
            continue
        out_dim, in_dim = base.shapes[f"{module}.weight"]
        a, b = parts["A"], parts["B"]
        rank = a.shape[0]
        if tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
            errors.append(f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                          f"the base weight {(out_dim, in_dim)}")
        ranks.add(rank)
    if len(ranks) > 1:
        errors.append(f"adapters of several ranks {sorted(ranks)} in one update")
    elif ranks and max(ranks) > max_rank:
        errors.append(f"rank {max(ranks)} > lora_max_rank={max_rank}")
    if errors or not modules:
        raise ValueError("LoRA adapter rejected, engine untouched: " + "; ".join(errors[:_SHOWN] or ["no tensors"]))
    out = Path(tempfile.mkdtemp(dir=root, prefix="tandem-vllm-lora-"))
    save_file({n: t.detach().contiguous().cpu() for n, t in items}, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(ranks.pop()),
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({m.rpartition(".")[2] for m in modules}),
        "base_model_name_or_path": str(base.folder),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
