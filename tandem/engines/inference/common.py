"""What the inference adapters share: the seed convention, error results, and staging of weight and LoRA
folders checked against the base checkpoint.

The embedded engine, the vLLM adapter and the SGLang adapter import these from here rather than from each
other: one adapter never imports another.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.core.protocols import Completion, FinishReason, GenerationRequest, GenerationResult

__all__ = ["CheckpointIndex", "derive_seed", "error_result", "lora_adapter_folder", "staging_root"]

_MASK64 = (1 << 64) - 1
_SHOWN = 5


def derive_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample ``index`` of a request seeded with ``seed`` (SplitMix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def error_result(request: GenerationRequest, message: str) -> GenerationResult:
    prompt = request.prompt_token_ids if isinstance(request.prompt_token_ids, list) else []
    return GenerationResult(
        request_id=request.request_id,
        prompt_token_ids=list(prompt),
        completions=[Completion(token_ids=[], log_probs=[], finish_reason=FinishReason.ERROR, error=message)],
        error=message,
    )


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
    out = Path(tempfile.mkdtemp(dir=root, prefix="tandem-lora-"))
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
