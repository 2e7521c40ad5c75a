"""Policy and value losses, loss aggregation, and the `LossFn` the training engines call.

Per-token tensors are ``[b, R]`` (a micro-batch of ``b`` whole rows in response space). A loss never
averages over its own micro-batch: it divides by the GLOBAL normalisers in `LossScale` (summed over
every micro-batch and data-parallel rank before the first micro-batch), so the micro-batch losses add
up exactly to the full-batch loss, whatever the micro-batching:

====================================  ====================================================================
aggregation                           full-batch loss (``m`` = loss mask, ``n_i`` = tokens of row ``i``)
====================================  ====================================================================
``token-mean`` (DAPO, default)        ``sum_{i,t} m l / num_tokens``
``seq-mean-token-mean`` (GRPO paper)  ``sum_i (sum_t m l / n_i) / num_sequences``
``seq-mean-token-sum``                ``sum_{i,t} m l / num_sequences``
``seq-mean-token-sum-norm`` (Dr.GRPO) ``sum_{i,t} m l / (num_sequences * L)``, ``L`` a constant length
====================================  ====================================================================

Policy objectives are registered in ``POLICY_LOSSES`` as `PolicyLossSpec`s; a user adds one by import
path (``policy_loss.loss: my.module:MY_SPEC``, its settings under ``policy_loss.options``).

Metric convention: every metric a loss function returns is the micro-batch's *share* of the global
value (token rates are divided by the global ``num_tokens``), so the engine SUMS them over micro-batches
and ranks; keys ending in ``/max`` (``/min``) reduce by max (min). `reduce_micro_batch_metrics` does it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from tandem.core.batch import TrainBatch
from tandem.core.kl import KLConfig, kl_estimate
from tandem.core.masked import check_finite, check_same_shape, metrics_to_floats, raise_first_nonfinite
from tandem.core.offpolicy import OffPolicyConfig, correction_tensors
from tandem.core.protocols import LogProbOutput, LossFn, LossScale
from tandem.core.registry import SpecRegistry, build_options

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "AggregationName",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossFn",
    "PolicyLossSpec",
    "ValueLoss",
    "ValueLossConfig",
    "aggregate",
    "aggregation_denominator",
    "build_loss_fn",
    "build_value_loss_fn",
    "loss_scale_from_masks",
    "policy_loss_per_token",
    "reduce_micro_batch_metrics",
]

AggregationName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AGGREGATIONS: tuple[str, ...] = get_args(AggregationName)


@dataclass(kw_only=True, slots=True)
class PolicyLossConfig:
    """The policy objective. Clip ranges are ratios' distances from 1: ``[1 - eps_low, 1 + eps_high]``.

    ``loss`` is a name registered in ``POLICY_LOSSES`` or an import path ``module.path:NAME`` of a
    `PolicyLossSpec`. ``options`` holds that loss's own settings: a mapping in a recipe, checked against
    the spec's ``config`` dataclass and replaced by an instance of it on construction (None for a loss
    without settings, as every built-in: their settings are the fields below).
    """

    loss: str = "ppo_clip"
    options: Any = None  # the loss's own settings (see the class docstring)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO "clip-higher": 0.28
    dual_clip_c: float | None = None  # dual-clip PPO (Ye et al. 2020) bound for A < 0; verl uses 3.0
    log_ratio_clamp: float = 20.0  # clamp of log pi - log pi_old before exp() (verl)
    aggregation: AggregationName = "token-mean"
    norm_length: int | None = None  # Dr.GRPO constant; None: LossScale.max_response_length
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * aggregated entropy
    compile: bool = False  # torch.compile the per-token math into fused kernels (first call compiles)

    def __post_init__(self) -> None:
        spec = self.spec  # an unknown name or a bad import path fails here, naming the value
        self.options = build_options(spec.config, self.options, owner=f"policy loss {self.loss!r}")
        if not 0 <= self.clip_eps_low <= 1:
            raise ValueError(f"clip_eps_low={self.clip_eps_low} must be in [0, 1] (the ratio stays >= 0)")
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high} must be >= 0")
        if self.dual_clip_c is not None:
            if self.dual_clip_c <= 1:
                raise ValueError(
                    f"dual_clip_c={self.dual_clip_c} must be > 1 (it bounds -A * ratio for A < 0)"
                )
            if not spec.dual_clip:
                raise ValueError(
                    f"dual_clip_c applies to a clipped surrogate (ppo_clip, gspo: dual_clip=True in the "
                    f"spec); loss={self.loss!r} has none"
                )
        if self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp} must be > 0")
        if self.norm_length is not None and self.norm_length <= 0:
            raise ValueError(f"norm_length={self.norm_length} must be > 0 (or null)")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef={self.entropy_coef} must be >= 0 (it is a bonus)")

    @property
    def spec(self) -> PolicyLossSpec:
        """The registered (or imported) policy loss named by ``loss``."""
        return POLICY_LOSSES.resolve(self.loss)


# -- aggregation ----------------------------------------------------------------------------------


def aggregation_denominator(mode: AggregationName, scale: LossScale, norm_length: int | None = None) -> float:
    """The global normaliser of aggregation ``mode`` (see the module docstring's table)."""
    if mode == "token-mean":
        return float(scale.num_tokens)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float(scale.num_sequences)
    if mode == "seq-mean-token-sum-norm":
        return float(scale.num_sequences) * float(norm_length or scale.max_response_length)
    raise ValueError(f"unknown aggregation {mode!r} (choose one of: {', '.join(AGGREGATIONS)})")


def _aggregate_sum(values: torch.Tensor, mask: torch.Tensor, mode: AggregationName) -> torch.Tensor:
    """The numerator of an aggregation: masked sum, or the sum of per-row token means."""
    masked = values * mask
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    return masked.sum()


def _divide(total: torch.Tensor, denom: torch.Tensor | float) -> torch.Tensor:
    """``total / denom``; 0 (keeping the graph) when the global normaliser is 0: no loss token anywhere."""
    if isinstance(denom, torch.Tensor):
        return torch.where(denom > 0, total / denom.clamp(min=torch.finfo(total.dtype).tiny), total * 0.0)
    return total / denom if denom > 0 else total * 0.0


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationName,
    scale: LossScale,
    *,
    norm_length: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the full-batch aggregate of ``values`` ``[b, R]`` over ``mask``."""
    denom = aggregation_denominator(mode, scale, norm_length)
    return _divide(_aggregate_sum(values, mask, mode), denom)


def loss_scale_from_masks(
    masks: Iterable[torch.Tensor], *, max_response_length: int | None = None
) -> LossScale:
    """The `LossScale` of the micro-batches of one rank (an engine all-reduces the sums across ranks).

    ``masks``: the ``[b, R]`` loss masks. ``max_response_length`` defaults to the widest mask; pass the
    generation limit instead for Dr.GRPO's constant.
    """
    num_tokens, num_sequences, width = 0.0, 0.0, 0
    for m in masks:
        per_row = m.sum(-1)  # one pass over the mask serves both counts
        num_tokens += float(per_row.sum())
        num_sequences += float((per_row > 0).sum())
        width = max(width, int(m.shape[-1]))
    return LossScale(
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        max_response_length=max_response_length if max_response_length is not None else width,
    )


def reduce_micro_batch_metrics(per_micro_batch: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine loss metrics over micro-batches (or ranks): sum of shares; max / min for those keys."""
    out: dict[str, float] = {}
    for metrics in per_micro_batch:
        for k, v in metrics.items():
            if k not in out:
                out[k] = float(v)
            elif k.endswith("/max"):
                out[k] = max(out[k], float(v))
            elif k.endswith("/min"):
                out[k] = min(out[k], float(v))
            else:
                out[k] += float(v)
    return out


# -- policy objectives ----------------------------------------------------------------------------

Stats = dict[str, torch.Tensor]


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, Stats]:
    """PPO's ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, then dual clip ``min(., -A c)`` for A < 0."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "clip_high": (r > 1 + cfg.clip_eps_high) & (adv > 0),
            "clip_low": (r < 1 - cfg.clip_eps_low) & (adv < 0),
        }
    if cfg.dual_clip_c is not None:
        bound = -adv * cfg.dual_clip_c
        negative = adv < 0
        with torch.no_grad():
            stats["dual_clip"] = negative & (loss.detach() > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return loss, stats


def ppo_clip_per_token(
    log_probs, old_log_probs, adv, mask, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, Stats]:
    """PPO clipped objective (Schulman et al. 2017) with asymmetric clip (DAPO) and optional dual clip."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    return _clipped_surrogate(ratio, adv, cfg)


def gspo_per_token(log_probs, old_log_probs, adv, mask, cfg: PolicyLossConfig) -> tuple[torch.Tensor, Stats]:
    """GSPO (Zheng et al. 2025): the ratio is the per-token geometric mean of the sequence ratio.

    Token form ("GSPO-token"): ``s_i = sg(mean_t log r_it) + log pi_t - sg(log pi_t)``; its value is the
    sequence log ratio and its gradient that of ``log pi_t``, which equals GSPO's gradient when the
    advantage is constant along the sequence and also allows per-token advantages.
    """
    seq_log_ratio = ((log_probs - old_log_probs) * mask).sum(-1, keepdim=True) / mask.sum(
        -1, keepdim=True
    ).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()
    ratio = torch.exp(token_log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    return _clipped_surrogate(ratio, adv, cfg)


def cispo_per_token(log_probs, old_log_probs, adv, mask, cfg: PolicyLossConfig) -> tuple[torch.Tensor, Stats]:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi``.

    The IS weight is clipped and detached instead of the update, so clipped tokens keep a gradient.
    """
    ratio = torch.exp((log_probs.detach() - old_log_probs).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    weight = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    stats = {"clip_high": ratio > 1 + cfg.clip_eps_high, "clip_low": ratio < 1 - cfg.clip_eps_low}
    return -adv * weight * log_probs, stats


# (log_probs, old_log_probs, advantages, mask, cfg) -> (per-token loss, stats); see PolicyLossSpec.
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossConfig], tuple[torch.Tensor, Stats]
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossSpec:
    """A policy objective: its per-token function and its own settings class.

    ``fn(log_probs, old_log_probs, advantages, mask, cfg)`` gets ``[b, R]`` tensors of one micro-batch
    (``log_probs`` carries the gradient; the others are detached) and the `PolicyLossConfig`
    (``cfg.options`` is an instance of ``config``, built from the recipe's ``policy_loss.options``). It
    returns the per-token loss ``[b, R]`` (to be minimised; values off the mask are ignored) and stats,
    a dict of bool ``[b, R]`` tensors: ``clip_high`` / ``clip_low`` are logged as
    ``loss/clip_frac_high`` / ``_low`` (and their sum ``loss/clip_frac``), any other key ``k`` as
    ``loss/k_frac``, each the share of loss tokens where it is true. Aggregation, off-policy weights,
    the KL and entropy terms are applied by `PolicyLoss` around ``fn``; it must not average itself.
    """

    fn: PolicyLossFn
    config: type | None = None  # dataclass of the loss's settings (policy_loss.options); None: none
    dual_clip: bool = False  # honours policy_loss.dual_clip_c (a clipped surrogate); False refuses it


POLICY_LOSSES: SpecRegistry[PolicyLossSpec] = SpecRegistry("policy loss", PolicyLossSpec, required_params=5)
POLICY_LOSSES.add("ppo_clip", PolicyLossSpec(fn=ppo_clip_per_token, dual_clip=True))
POLICY_LOSSES.add("gspo", PolicyLossSpec(fn=gspo_per_token, dual_clip=True))
POLICY_LOSSES.add("cispo", PolicyLossSpec(fn=cispo_per_token))


def policy_loss_per_token(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, Stats]:
    """Per-token policy loss ``[b, R]`` (differentiable in ``log_probs``) and bool stats ``[b, R]``."""
    return cfg.spec.fn(log_probs, old_log_probs, advantages, mask, cfg)


# -- the LossFn the engines call -------------------------------------------------------------------


def _policy_loss_terms(
    per_token_fn: PolicyLossFn,
    log_probs: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    ref: torch.Tensor | None,
    rollout: torch.Tensor | None,
    entropy: torch.Tensor | None,
    norms: torch.Tensor,
    cfg: PolicyLossConfig,
    kl: KLConfig | None,
    off_policy: OffPolicyConfig | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole per-token computation of `PolicyLoss` (one function, so torch.compile can fuse it).

    ``per_token_fn`` is the spec's function, resolved once outside (an import path is not traced).
    ``norms`` ``[3]``: global token count, the aggregation's denominator, the KL coefficient (tensors,
    so a new step's values do not trigger a recompile). Returns the loss and metric tensors; entries
    named ``finite/<input>`` are input sums used for the NaN / Inf check.
    """
    num_tokens, denom, kl_coef = norms[0], norms[1], norms[2]
    per_token, stats = per_token_fn(log_probs, old, adv, mask, cfg)
    if per_token.shape != mask.shape:  # a plug-in's mistake is named here, not broadcast
        raise ValueError(
            f"policy loss {cfg.loss!r} returned a per-token loss of shape {tuple(per_token.shape)}; "
            f"expected {tuple(mask.shape)}"
        )
    out: dict[str, torch.Tensor] = {}
    if rollout is not None:  # the train/rollout mismatch is measured every step, corrected or not
        with torch.no_grad():
            log_ratio = ((old.detach() - rollout) * mask).clamp(-20.0, 20.0)
            out["train_rollout_logprob_abs_diff/mean"] = _divide(log_ratio.abs().sum(), num_tokens)
            out["train_rollout_logprob_abs_diff/max"] = log_ratio.abs().amax()
            out["offpolicy/k3_kl"] = _divide(((torch.expm1(log_ratio) - log_ratio) * mask).sum(), num_tokens)
    if off_policy is not None:
        weights, _, _, _, truncated, _ = correction_tensors(old, rollout, mask, off_policy)
        per_token = per_token * weights
        with torch.no_grad():
            out["offpolicy/weight_mean"] = _divide((weights * mask).sum(), num_tokens)
            out["offpolicy/truncated_frac"] = _divide((truncated * mask).sum(), num_tokens)
    pg = _divide(_aggregate_sum(per_token, mask, cfg.aggregation), denom)
    total = pg
    if kl is not None:
        kl_tok = kl_estimate(log_probs, ref, kl.estimator, clamp=kl.clamp, log_ratio_clamp=kl.log_ratio_clamp)
        kl_term = _divide(_aggregate_sum(kl_tok, mask, cfg.aggregation), denom)
        total = total + kl_coef * kl_term
        out["loss/kl"] = kl_term.detach()
        out[f"kl/{kl.estimator}_mean"] = _divide((kl_tok.detach() * mask).sum(), num_tokens)
    if entropy is not None:
        ent_term = _divide(_aggregate_sum(entropy, mask, cfg.aggregation), denom)
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * ent_term
        out["loss/entropy"] = ent_term.detach()
    out["loss/pg"] = pg.detach()
    out["loss/total"] = total.detach()
    with torch.no_grad():
        out |= _stat_shares(stats, mask, num_tokens)
        # k1 estimate of KL(pi_old || pi): how far this step has moved the policy
        out["loss/ppo_kl"] = _divide(((old - log_probs.detach()) * mask).sum(), num_tokens)
        for name, t in (("log_probs", log_probs), ("advantages", adv), ("old_log_probs", old),
                        ("ref_log_probs", ref), ("rollout_log_probs", rollout), ("entropy", entropy)):  # fmt: skip
            if t is not None:
                out[f"finite/{name}"] = t.detach().sum()
    return total, out


def _stat_shares(stats: Stats, mask: torch.Tensor, num_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token shares of a loss's bool stats: ``clip_high`` / ``clip_low`` (and their sum), ``loss/<k>_frac``."""
    share = {k: _divide((v * mask).sum(), num_tokens) for k, v in stats.items()}
    out: dict[str, torch.Tensor] = {}
    if "clip_high" in share and "clip_low" in share:
        high, low = share.pop("clip_high"), share.pop("clip_low")
        out |= {"loss/clip_frac": high + low, "loss/clip_frac_high": high, "loss/clip_frac_low": low}
    return out | {f"loss/{k}_frac": v for k, v in share.items()}


_compiled_terms: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None


def _compiled_policy_loss_terms() -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    global _compiled_terms
    if _compiled_terms is None:
        # dynamic: micro-batches differ in [b, R]; one compiled graph serves them all.
        _compiled_terms = torch.compile(_policy_loss_terms, dynamic=True)
    return _compiled_terms


class PolicyLoss:
    """`LossFn` of the policy: clipped objective x off-policy weights, + KL term, - entropy bonus.

    ``old_log_probs`` None means one optimizer step per batch (on-policy): the current log-probs,
    detached, serve as old, so the ratio is exactly 1 in value and the gradient is the policy gradient
    (as verl and TRL do). Needs ``batch.advantages``; ``ref_log_probs`` when the KL term is on;
    ``rollout_log_probs`` when an off-policy correction is on; ``output.entropy`` for the bonus.
    A NaN / Inf in any input raises `NonFiniteError` naming the tensor and its first bad index.
    """

    def __init__(
        self,
        cfg: PolicyLossConfig,
        *,
        kl: KLConfig | None = None,
        kl_coef: float | None = None,
        off_policy: OffPolicyConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.kl_coef = float(kl_coef if kl_coef is not None else (kl.coef if kl is not None else 0.0))
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0")
        self.kl = kl if kl is not None and kl.placement == "loss" and self.kl_coef > 0 else None
        self.off_policy = off_policy if off_policy is not None and off_policy.enabled else None
        self._per_token_fn = cfg.spec.fn
        self._terms = _compiled_policy_loss_terms() if cfg.compile else _policy_loss_terms

    def __call__(
        self, output: LogProbOutput, batch: TrainBatch, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        log_probs = output.log_probs
        mask = batch.loss_mask.to(log_probs.dtype)
        adv = _require(batch.advantages, "advantages", "the policy loss (compute advantages first)")
        old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
        ref = _require(batch.ref_log_probs, "ref_log_probs", "the KL loss term") if self.kl else None
        rollout = batch.rollout_log_probs  # when present, the mismatch metrics are logged
        if self.off_policy is not None:
            rollout = _require(rollout, "rollout_log_probs", "the off-policy correction")
        entropy = output.entropy
        if cfg.entropy_coef > 0 and entropy is None:
            raise ValueError(
                "entropy_coef > 0 needs output.entropy: call forward_logprobs(with_entropy=True)"
            )
        check_same_shape(
            log_probs=log_probs, loss_mask=mask, advantages=adv, old_log_probs=old, ref_log_probs=ref,
            rollout_log_probs=rollout, entropy=entropy,
        )  # fmt: skip
        norms = torch.tensor(
            [
                float(scale.num_tokens),
                aggregation_denominator(cfg.aggregation, scale, cfg.norm_length),
                self.kl_coef,
            ],
            dtype=torch.promote_types(log_probs.dtype, torch.float32),  # bf16 cannot count tokens
            device=log_probs.device,
        )
        total, terms = self._terms(
            self._per_token_fn, log_probs, old, adv, mask, ref, rollout, entropy, norms, cfg, self.kl,
            self.off_policy,
        )  # fmt: skip
        values = metrics_to_floats(terms)
        sums = {k.removeprefix("finite/"): v for k, v in values.items() if k.startswith("finite/")}
        if not all(math.isfinite(v) for v in sums.values()):
            named = {"log_probs": log_probs, "advantages": adv, "old_log_probs": old, "ref_log_probs": ref,
                     "rollout_log_probs": rollout, "entropy": entropy}  # fmt: skip
            raise_first_nonfinite({k: named[k] for k in sums})
        return total, {k: v for k, v in values.items() if not k.startswith("finite/")}


def _require(t: torch.Tensor | None, name: str, why: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"batch.{name} is None but {why} needs it")
    return t


def _token_share(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    return _divide((values * mask).sum(), float(scale.num_tokens))


def build_loss_fn(
    cfg: PolicyLossConfig,
    *,
    kl: KLConfig | None = None,
    kl_coef: float | None = None,
    off_policy: OffPolicyConfig | None = None,
) -> LossFn:
    """The policy `LossFn`. ``kl_coef`` overrides ``kl.coef`` (pass the KL controller's current value)."""
    return PolicyLoss(cfg, kl=kl, kl_coef=kl_coef, off_policy=off_policy)


# -- value loss (PPO critic) ----------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ValueLossConfig:
    """PPO critic loss ``coef * max((V - R)^2, (V_clip - R)^2)``, ``V_clip = V_old + clip(V - V_old, +-clip)``."""

    clip: float | None = 0.5  # verl critic cliprange_value; None disables value clipping
    coef: float = 0.5  # the 1/2 of the squared error (verl, OpenAI baselines)
    aggregation: AggregationName = "token-mean"

    def __post_init__(self) -> None:
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip={self.clip} must be > 0 (or null)")
        if self.coef <= 0:
            raise ValueError(f"coef={self.coef} must be > 0")


class ValueLoss:
    """`LossFn` of the critic: needs ``output.values`` (with grad), ``batch.values`` and ``batch.returns``."""

    def __init__(self, cfg: ValueLossConfig) -> None:
        self.cfg = cfg

    def __call__(
        self, output: LogProbOutput, batch: TrainBatch, scale: LossScale
    ) -> tuple[torch.Tensor, dict[str, float]]:
        pred = output.values
        if pred is None:
            raise ValueError("output.values is None: the value loss needs the critic's predictions")
        for name in ("values", "returns"):
            if getattr(batch, name) is None:
                raise ValueError(f"batch.{name} is None but the value loss needs it")
        old, returns = batch.values, batch.returns
        mask = batch.loss_mask.to(pred.dtype)
        check_same_shape(values_pred=pred, loss_mask=mask, values=old, returns=returns)
        check_finite({"values_pred": pred, "values": old, "returns": returns})
        err = (pred - returns).square()
        metrics: dict[str, torch.Tensor] = {}
        if self.cfg.clip is not None:
            # min/max against the band's edges, not old + clamp(pred - old): that sum can differ from
            # an unclipped pred by one ulp, and clip_frac then counted tokens that were never clipped
            clipped = torch.maximum(torch.minimum(pred, old + self.cfg.clip), old - self.cfg.clip)
            err_clipped = (clipped - returns).square()
            metrics["value/clip_frac"] = _token_share((err_clipped > err).detach(), mask, scale)
            err = torch.maximum(err, err_clipped)
        loss = self.cfg.coef * aggregate(err, mask, self.cfg.aggregation, scale)
        metrics["loss/value"] = loss.detach()
        metrics["value/pred_mean"] = _token_share(pred.detach(), mask, scale)
        return loss, metrics_to_floats(metrics)


def build_value_loss_fn(cfg: ValueLossConfig) -> LossFn:
    """The critic `LossFn`."""
    return ValueLoss(cfg)
