"""The quantized pair with the trainer sharded over 2 gloo ranks (QAT applied before ``fully_shard``):
each rank's engine matches the trainer bit for bit, and the step equals one process's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.engines import quantized_workers as workers
from tests.engines.quantized_helpers import FORMATS
from tests.engines.training.helpers import run_workers

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized_pair")
    run_workers(workers.pair_on_two_ranks, 2, str(out))
    return [torch.load(out / f"pair_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("fmt", workers.DIST_FORMATS)
def test_sharded_qat_trainer_and_quantized_engines_agree_bit_for_bit(ranks, fmt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: tiny matrices, a loaded machine
    try:
        single = workers.step_and_sync(FORMATS[fmt], sharded=False)
    finally:
        torch.set_num_threads(threads)
    for got in (r[fmt] for r in ranks):
        for k in ("0", "1"):
            assert torch.equal(got[f"train{k}"], got[f"rollout{k}"])  # trainer == this rank's engine
            assert torch.equal(got[f"train{k}"], single[f"train{k}"])  # == one process
        for part in ("masters", "engine"):
            assert got[part].keys() == single[part].keys()
            assert all(torch.equal(got[part][n], single[part][n]) for n in single[part]), part
