"""The policy's weights as HF-named full tensors, gathered from tensor, pipeline and expert shards.

Collective: every rank walks the same list of parameters (`convert.rules`) in the same order. For each
one, the ranks that hold it (its pipeline stage, and for an expert its expert-parallel rank) gather the
tensor-parallel slices into the full Megatron tensor; broadcasts then hand it to the other expert ranks
and pipeline stages, so every rank ends up with every tensor (a sync that sends from rank 0 ignores the
copies elsewhere). The full tensor is split back into HF tensors (`convert.from_megatron`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tandem.engines.training.megatron import convert
from tandem.engines.training.megatron.model import BuiltModel
from tandem.engines.training.megatron.parallel import MegatronContext

__all__ = ["export_checkpoint", "hf_tensors", "owner_stage"]


def owner_stage(rule: convert.Rule, num_layers: int, pp_size: int) -> int:
    """The pipeline stage that holds ``rule``'s parameter (layers split evenly over stages)."""
    name = rule.megatron
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (num_layers // pp_size)
    return pp_size - 1  # final norm, output layer


def _owner_expert_rank(rule: convert.Rule, num_experts: int, ep_size: int) -> int:
    expert = int(rule.megatron.split(".local_experts.")[1].split(".")[0])
    return expert // (num_experts // ep_size)


def _gather_tp(rule: convert.Rule, local: torch.Tensor, ctx: MegatronContext) -> torch.Tensor:
    group = ctx.groups["etp"] if rule.expert else ctx.groups["tp"]
    size = dist.get_world_size(group)
    if rule.split == "replicated" or size == 1:
        return local.detach()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    return convert.unshard(rule, shards)


def _broadcast(t: torch.Tensor, group, src_group_rank: int) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.broadcast(t, src=dist.get_global_rank(group, src_group_rank), group=group)
    return t


@torch.no_grad()
def hf_tensors(
    built: BuiltModel, ctx: MegatronContext, dtype: torch.dtype, *, rules: list[convert.Rule] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor in dtype)`` for the whole model, on every rank (collective).

    Megatron keeps its norms in fp32 under a bf16 model; everything leaves in the model's ``dtype``,
    as in its HF checkpoint. ``rules``: these parameters instead of the model's (LoRA adapters: peft names).
    """
    local = {name: p for name, _, p in built.local_params()}
    layout = built.layout
    for rule in convert.rules(layout) if rules is None else rules:
        stage = owner_stage(rule, layout.num_layers, ctx.pp_size)
        expert_rank = _owner_expert_rank(rule, layout.num_experts, ctx.ep_size) if rule.expert else None
        on_stage = ctx.pp_rank == stage
        full = None
        if on_stage and (expert_rank is None or ctx.ep_rank == expert_rank):
            full = _gather_tp(rule, local[rule.megatron], ctx).to(dtype)
        if full is None:
            full = torch.empty(built.full_shapes[rule.megatron], dtype=dtype, device=ctx.device)
        if expert_rank is not None and on_stage:
            full = _broadcast(full.contiguous(), ctx.groups["ep"], expert_rank)
        if ctx.pp_size > 1:
            full = _broadcast(full.contiguous(), ctx.groups["pp"], stage)
        for name, t in convert.from_megatron(rule, layout, full):
            yield name, t.contiguous()


# -- checkpoint -> HF folder (`tandem export`) -------------------------------------------------------


def _saved_shards(path: Path) -> dict[str, torch.Tensor]:
    """``{DCP key: tensor}`` of the checkpoint's ``model/`` entries, read in one process (no process group)
    whatever layout wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tandem.engines.training.common.checkpoint import quiet_single_process

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.state_dict_metadata.items()
             if key.startswith("model/") and isinstance(m, TensorStorageMetadata)}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _unsharded(state: dict[str, torch.Tensor], rules: dict[str, convert.Rule]) -> dict[str, torch.Tensor]:
    """Global Megatron name -> the full tensor, from the TP slices saved under ``name@tp{r}of{n}``."""
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in state.items():
        name, _, tp = key.removeprefix("model/").partition("@tp")
        rank = int(tp.split("of")[0]) if tp else 0
        slices.setdefault(name, {})[rank] = t
    return {name: convert.unshard(rules[name], [parts[r] for r in sorted(parts)]) for name, parts in slices.items()}


def export_checkpoint(checkpoint: str | Path, output: str | Path, *, dtype: str | None = None,
                      adapter_only: bool = False, force: bool = False) -> Path:
    """Write the policy of a Megatron engine checkpoint as an HF folder (a peft adapter folder with
    ``adapter_only``) at ``output``, like the FSDP engine's `export_hf`; returns its path. Runs in one process,
    whatever TP/PP/EP layout saved it. A LoRA checkpoint holds the adapters alone: merged weights are the model
    folder's base plus ``B @ A * alpha / rank`` (peft's arithmetic)."""
    from tandem.config import from_dict
    from tandem.engines.training.common.config import LoRAConfig
    from tandem.engines.training.common.hf_export import check_dtype, check_output, write_export
    from tandem.engines.training.megatron.checkpoint import read_metadata
    from tandem.engines.training.megatron.lora import adapter_rules, merge_into
    from tandem.engines.training.megatron.model import HFCheckpoint, read_args
    from tandem.models.registry import DTYPES

    ckpt_dir = Path(checkpoint)
    final = check_output(output, ckpt_dir, force=force)
    meta = read_metadata(ckpt_dir)
    check_dtype(dtype)
    lora = meta.get("lora")
    if adapter_only and not lora:
        raise ValueError(f"{ckpt_dir}: --adapter-only needs a LoRA checkpoint; this one trained all weights")
    base = Path(meta["model_path"])
    args = read_args(base)
    state = _saved_shards(ckpt_dir)
    names = {key.removeprefix("model/").split("@")[0] for key in state}
    # the padded vocabulary and the layer spec as saved (the embedding's rows; where the norms live)
    padded = sum(t.shape[0] for k, t in state.items() if k.startswith("model/embedding.word_embeddings.weight"))
    layout = convert.Layout.from_args(args, padded_vocab_size=padded or args.vocab_size,
                                      fused_norms=any(n.endswith("linear_qkv.layer_norm_weight") for n in names))
    rules = {r.megatron: r for r in convert.rules(layout)}
    lora_cfg = None
    if lora:
        lora_cfg = from_dict(LoRAConfig, lora, path="lora")
        shapes = SimpleNamespace(layout=layout, args=args)  # what adapter_rules reads of a built model
        rules.update({n: r for n, (r, _) in adapter_rules(shapes, lora_cfg).items()})
    full = _unsharded(state, rules)
    adapters = {rules[n].hf[0]: t for n, t in full.items() if ".lora." in n}
    if adapter_only:
        tensors = adapters
    else:
        if lora:  # the frozen base is the model folder's
            hf = HFCheckpoint(base)
            model_dtype = DTYPES[meta["model"]["dtype"]]
            named = ((n, hf.get(n).to(model_dtype)) for r in convert.rules(layout) for n in r.hf)
            named = merge_into(named, adapters, lora_cfg.alpha / lora_cfg.rank)
        else:
            named = (pair for r in convert.rules(layout) for pair in convert.from_megatron(r, layout, full[r.megatron]))
        tensors = dict(named)
    cast = DTYPES[dtype] if dtype else DTYPES[meta["model"]["dtype"]]
    tensors = {n: t.to(cast).contiguous() for n, t in tensors.items()}
    return write_export(final, tensors, checkpoint=ckpt_dir, base=base, dtype=dtype, lora=lora,
                        adapter_only=adapter_only)

