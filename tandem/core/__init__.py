"""Engine-neutral core: samples, batches, protocols and the RL math. Imports only torch and numpy."""

from tandem.core.batch import TrainBatch, partition_by_token_budget, response_index
from tandem.core.sample import Sample, SampleStatus, SampleValidationError

__all__ = [
    "Sample",
    "SampleStatus",
    "SampleValidationError",
    "TrainBatch",
    "partition_by_token_budget",
    "response_index",
]
