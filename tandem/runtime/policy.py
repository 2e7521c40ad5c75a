"""How the loop trains on a rollout batch: contract, old log-probs, mini-batches, metric reduction."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.batch import TrainBatch
from tandem.core.contracts import Contract, RunSettings, resolve_contract
from tandem.core.protocols import EngineInfo
from tandem.runtime.config import RunConfig

__all__ = ["merge_mini_batch_metrics", "mini_batch_rows", "old_log_prob_source", "run_contract", "shares_frozen_base"]


def shares_frozen_base(cfg: RunConfig) -> bool:
    """Whether the run lets its engine hold the trainer's frozen LoRA base instead of a copy
    (`tandem.sync.inprocess.share_frozen_base`): one process (colocated), adapter-only sync, and
    ``sync.share_frozen_base``. The loop decides by it, and `tandem plan --check --recipe` plans by it."""
    return cfg.runtime.placement == "colocated" and cfg.sync.lora_mode == "adapter" and cfg.sync.share_frozen_base


def run_contract(cfg: RunConfig, trainer: EngineInfo, engine: EngineInfo, *,
                 hints: dict[str, str] | None = None) -> Contract:
    """Resolve the run's true-on-policy contract from the two engines' `EngineInfo` (raises `ContractError`).

    ``hints``: how to turn on what an exact contract needs, from the engine entries (quoted in errors).
    """
    settings = RunSettings(
        trainer=trainer.name,
        engine=engine.name,
        moe=engine.moe,
        trainer_dtype=trainer.dtype,
        engine_dtype=engine.dtype,
        trainer_deterministic=trainer.deterministic,
        engine_deterministic=engine.deterministic,
        routing_replay=trainer.routed_experts,
        # LoRA breaks exactness only where the engine serves the adapters merged into its weights
        lora=trainer.lora_adapters and not (cfg.sync.lora_mode == "adapter" and engine.lora_adapters),
        trainer_temperature=trainer.temperature or 1.0,
        engine_temperature=cfg.rollout.sampling.temperature or 1.0,
        hints=tuple((hints or {}).items()),
    )
    return resolve_contract(settings, cfg.algorithm.contract)


def old_log_prob_source(cfg: RunConfig, contract: Contract) -> str:
    """``current``, ``recompute`` or ``rollout``: where the PPO ratio's old log-probs come from."""
    choice = cfg.algorithm.contract.old_log_probs
    k = cfg.algorithm.mini_batches
    if choice == "auto":
        if contract.relation == "exact":
            return "rollout"
        return "current" if k == 1 else "recompute"
    if choice == "rollout" and contract.relation != "exact":
        raise ValueError(
            "algorithm.contract.old_log_probs=rollout needs an exact contract (rollout and training "
            f"log-probs equal bit for bit); this run's is {contract.relation}: {contract.note}"
        )
    if choice == "current" and k > 1:
        raise ValueError(
            f"algorithm.contract.old_log_probs=current with mini_batches={k}: after the first update the "
            "current log-probs are no longer the old policy's; use recompute (or rollout under an exact contract)"
        )
    return choice


def mini_batch_rows(batch: TrainBatch, k: int) -> list[list[int]]:
    """Rows of ``batch`` split into ``k`` mini-batches of whole groups (round-robin over groups)."""
    if k == 1:
        return [list(range(batch.batch_size))]
    groups = batch.group_index.tolist() if batch.group_index is not None else list(range(batch.batch_size))
    order = list(dict.fromkeys(groups))
    if len(order) < k:
        raise ValueError(f"algorithm.mini_batches={k} but the batch holds only {len(order)} groups")
    slot = {g: i % k for i, g in enumerate(order)}
    parts: list[list[int]] = [[] for _ in range(k)]
    for row, g in enumerate(groups):
        parts[slot[g]].append(row)
    return parts


def merge_mini_batch_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Means over mini-batches; ``/max`` and ``/min`` keys by max/min; token counts summed."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    for key in {k for p in parts for k in p}:
        vals = [p[key] for p in parts if key in p]
        if key.endswith("/max"):
            out[key] = max(vals)
        elif key.endswith("/min"):
            out[key] = min(vals)
        elif key in ("train/tokens", "train/skipped_step"):
            out[key] = float(sum(vals))
        else:
            out[key] = float(torch.tensor(vals, dtype=torch.float64).mean())
    return out
