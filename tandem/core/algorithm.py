"""`AlgorithmConfig`: the recipe's ``algorithm:`` section, grouping the configs of the RL math.

Presets name well-known algorithms as complete configs (a recipe may start from one in Python, or copy
its values into YAML). Each lists the paper it follows; docs/algorithms.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tandem.core.advantages import AdvantageConfig
from tandem.core.contracts import ContractConfig
from tandem.core.filters import FilterConfig
from tandem.core.kl import KLConfig
from tandem.core.losses import PolicyLossConfig, ValueLossConfig, build_loss_fn, build_value_loss_fn
from tandem.core.offpolicy import OffPolicyConfig
from tandem.core.protocols import LossFn
from tandem.core.schedulers import KLController, LRScheduleConfig

__all__ = ["ALGORITHM_PRESETS", "AlgorithmConfig", "algorithm_preset"]


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Advantages, policy / value losses, KL, off-policy correction, filters and LR schedule of a run."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)  # used by estimator gae only
    kl: KLConfig = field(default_factory=KLConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    contract: ContractConfig = field(default_factory=ContractConfig)  # rollout/train log-prob relation
    mini_batches: int = 1  # optimizer steps per rollout batch (the batch split by groups)

    def __post_init__(self) -> None:
        if self.mini_batches < 1:
            raise ValueError(f"mini_batches={self.mini_batches} must be >= 1")
        if self.filters.drop_zero_std_groups and not self.advantage.uses_groups:
            raise ValueError(
                f"filters.drop_zero_std_groups is for group estimators; advantage.estimator="
                f"{self.advantage.estimator!r} does not compare samples within a group"
            )
        if self.kl.schedule.kind == "adaptive" and self.kl.coef == 0:
            raise ValueError(
                "kl.schedule.kind='adaptive' needs kl.coef > 0 (a multiplicative controller stays at 0)"
            )

    @property
    def needs_ref(self) -> bool:
        """A reference model must produce ``ref_log_probs``."""
        return self.kl.enabled

    @property
    def needs_critic(self) -> bool:
        """The estimator reads a critic's values (``gae``, or a plug-in that declares ``needs_critic``)."""
        return self.advantage.spec.needs_critic

    @property
    def needs_teacher(self) -> bool:
        return self.advantage.distill_coef > 0

    def kl_controller(self) -> KLController:
        """A fresh controller of the KL coefficient (step 0)."""
        return KLController(self.kl.coef, self.kl.schedule)

    def build_loss_fn(self, *, kl_coef: float | None = None) -> LossFn:
        """The policy `LossFn`; pass the controller's current ``kl_coef`` when the KL is scheduled."""
        return build_loss_fn(self.policy_loss, kl=self.kl, kl_coef=kl_coef, off_policy=self.off_policy)

    def build_value_loss_fn(self) -> LossFn:
        return build_value_loss_fn(self.value_loss)


def _grpo() -> AlgorithmConfig:
    """GRPO as in DeepSeekMath (Shao et al. 2024): group-normalised reward, k3 KL in the loss (beta 0.04)."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(aggregation="seq-mean-token-mean"),
        kl=KLConfig(estimator="k3", placement="loss", coef=0.04),
    )


def _dr_grpo() -> AlgorithmConfig:
    """Dr.GRPO (Liu et al. 2025): no std normalisation, constant length normaliser, no KL."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="dr_grpo"),
        policy_loss=PolicyLossConfig(aggregation="seq-mean-token-sum-norm"),
    )


def _dapo() -> AlgorithmConfig:
    """DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-mean, dynamic sampling, overlong filter, no KL."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token-mean"),
        filters=FilterConfig(drop_zero_std_groups=True, drop_truncated=True),
    )


def _gspo() -> AlgorithmConfig:
    """GSPO (Zheng et al. 2025): sequence-level ratio, clip 3e-4 / 4e-4, sequence-mean aggregation."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="gspo"),
        policy_loss=PolicyLossConfig(
            loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean"
        ),
    )


def _cispo() -> AlgorithmConfig:
    """CISPO (MiniMax-M1, 2025): clipped, detached IS weight; no lower bound, weight cap 5 (ScaleRL)."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="grpo"),
        policy_loss=PolicyLossConfig(
            loss="cispo", clip_eps_low=1.0, clip_eps_high=4.0, aggregation="token-mean"
        ),
    )


def _rloo() -> AlgorithmConfig:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline."""
    return AlgorithmConfig(advantage=AdvantageConfig(estimator="rloo"))


def _reinforce_pp() -> AlgorithmConfig:
    """REINFORCE++ (Hu 2025): k1 KL folded into token rewards, discounted returns, batch whitening."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="reinforce_pp", gamma=1.0),
        kl=KLConfig(estimator="k1", placement="reward", coef=0.01),
    )


def _reinforce_pp_baseline() -> AlgorithmConfig:
    """REINFORCE++-baseline: group-mean baseline, batch whitening, k3 KL in the loss."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="reinforce_pp_baseline"),
        kl=KLConfig(estimator="k3", placement="loss", coef=0.001),
    )


def _ppo() -> AlgorithmConfig:
    """PPO with GAE (Schulman et al. 2017 / 2016): critic, gamma 1, lambda 0.95, KL in the reward."""
    return AlgorithmConfig(
        advantage=AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95),
        kl=KLConfig(estimator="k1", placement="reward", coef=0.001),
    )


def _opd() -> AlgorithmConfig:
    """On-policy distillation: the advantage is the per-token reverse-KL reward to a teacher."""
    return AlgorithmConfig(advantage=AdvantageConfig(estimator="distill", distill_coef=1.0))


ALGORITHM_PRESETS: dict[str, Callable[[], AlgorithmConfig]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "dapo": _dapo,
    "gspo": _gspo,
    "cispo": _cispo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "ppo": _ppo,
    "opd": _opd,
}


def algorithm_preset(name: str, **sections) -> AlgorithmConfig:
    """The preset ``name`` with whole sections replaced, e.g. ``algorithm_preset("dapo", kl=KLConfig(...))``."""
    if name not in ALGORITHM_PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r} (choose one of: {', '.join(ALGORITHM_PRESETS)})")
    return replace(ALGORITHM_PRESETS[name](), **sections)
