"""Engine-neutral core: samples, batches, protocols and the RL math. Imports only torch and numpy."""

from tandem.core.advantages import (
    AdvantageConfig,
    AdvantageEstimatorSpec,
    AdvantageInputs,
    compute_advantages,
)
from tandem.core.algorithm import ALGORITHM_PRESETS, AlgorithmConfig, algorithm_preset
from tandem.core.batch import TrainBatch, partition_by_token_budget, partition_padded, response_index
from tandem.core.filters import FilterConfig, filter_groups, filter_samples, nonfinite_reward_rows
from tandem.core.kl import KLConfig
from tandem.core.losses import (
    PolicyLossConfig,
    PolicyLossSpec,
    ValueLossConfig,
    build_loss_fn,
    build_value_loss_fn,
    loss_scale_from_masks,
    reduce_micro_batch_metrics,
)
from tandem.core.masked import NonFiniteError
from tandem.core.offpolicy import OffPolicyConfig, apply_offpolicy_rejection, compute_offpolicy_weights
from tandem.core.protocols import (
    CapabilityError,
    EngineAsleepError,
    EngineClosedError,
    EngineError,
    EngineInfo,
    InferenceEngine,
    TrainingEngine,
)
from tandem.core.sample import Sample, SampleStatus, SampleValidationError
from tandem.core.schedulers import KLController, KLScheduleConfig, LRScheduleConfig, build_lr_scheduler

__all__ = [
    "ALGORITHM_PRESETS",
    "AdvantageConfig",
    "AdvantageEstimatorSpec",
    "AdvantageInputs",
    "AlgorithmConfig",
    "CapabilityError",
    "EngineAsleepError",
    "EngineClosedError",
    "EngineError",
    "EngineInfo",
    "InferenceEngine",
    "FilterConfig",
    "KLConfig",
    "KLController",
    "KLScheduleConfig",
    "LRScheduleConfig",
    "NonFiniteError",
    "OffPolicyConfig",
    "PolicyLossConfig",
    "PolicyLossSpec",
    "Sample",
    "SampleStatus",
    "SampleValidationError",
    "TrainBatch",
    "TrainingEngine",
    "ValueLossConfig",
    "algorithm_preset",
    "apply_offpolicy_rejection",
    "build_loss_fn",
    "build_lr_scheduler",
    "build_value_loss_fn",
    "compute_advantages",
    "compute_offpolicy_weights",
    "filter_groups",
    "filter_samples",
    "loss_scale_from_masks",
    "nonfinite_reward_rows",
    "partition_by_token_budget",
    "partition_padded",
    "reduce_micro_batch_metrics",
    "response_index",
]
