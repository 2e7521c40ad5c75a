"""FSDP's all-gather / reduce-scatter as point-to-point rings on gloo (fsdp/ring_comms.py).

The rings against gloo's own collectives on the same inputs (world 2: bit-identical; world 3: the same
sums in another order), and an FSDP engine at world 2 whose two steps with the rings give the same
weights, bit for bit, as with gloo's collectives.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tandem.engines.training.fsdp import FSDPEngine, ParallelConfig
from tandem.engines.training.fsdp.ring_comms import (
    RingAllGather,
    RingReduceScatter,
    ring_all_gather,
    ring_reduce_scatter,
)

from . import fsdp_workers as workers
from .helpers import run_workers, sync_weights

pytestmark = pytest.mark.dist

DTYPES = (torch.float32, torch.bfloat16)


def collectives(rank: int, world: int, out_dir: str) -> None:
    """Each ring against gloo's collective on the same per-rank inputs; results to a file per rank."""
    group = dist.group.WORLD
    found: dict = {}
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(100 + rank)
        n = 7 * world  # chunks of 7: odd sizes, nothing aligned
        x = torch.randn(n, generator=g).to(dtype)
        want = torch.empty(n // world, dtype=dtype)
        dist.reduce_scatter_tensor(want, x.clone(), group=group)
        got = torch.empty(n // world, dtype=dtype)
        RingReduceScatter()(got, x.clone(), group, dist.ReduceOp.SUM)
        found[f"rs_{dtype}"] = (got, want)
        # a reduction other than SUM goes to gloo's collective
        got_max = torch.empty(n // world, dtype=dtype)
        RingReduceScatter()(got_max, x.clone(), group, dist.ReduceOp.MAX)
        want_max = x.clone()
        dist.all_reduce(want_max, op=dist.ReduceOp.MAX)
        found[f"rs_max_{dtype}"] = (got_max, want_max.view(world, -1)[rank])

        shard = torch.randn(5, generator=g).to(dtype)
        want = torch.empty(5 * world, dtype=dtype)
        dist.all_gather_into_tensor(want, shard, group=group)
        got = torch.full((5 * world,), -1.0, dtype=dtype)
        RingAllGather()(got, shard, group)
        found[f"ag_{dtype}"] = (got, want)
        # FSDP's layout: the input is this rank's slot of the output (written in place by its copy-in)
        inplace = torch.zeros(5 * world, dtype=dtype)
        inplace.view(world, -1)[rank].copy_(shard)
        ring_all_gather(inplace, inplace.view(world, -1)[rank], group)
        found[f"ag_inplace_{dtype}"] = (inplace, want)
    raw = torch.randint(0, 256, (6,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    want = torch.empty(6 * world, dtype=torch.uint8)
    dist.all_gather_into_tensor(want, raw, group=group)
    got = torch.empty(6 * world, dtype=torch.uint8)
    ring_all_gather(got, raw, group)
    found["ag_uint8"] = (got, want)
    if world == 3:  # a subgroup (as HSDP's shard dimension is): peers are named by their global ranks
        sub = dist.new_group([0, 2])
        if rank != 1:
            x = torch.randn(8, generator=torch.Generator().manual_seed(7 + rank))
            want = torch.empty(4)
            dist.reduce_scatter_tensor(want, x.clone(), group=sub)
            got = torch.empty(4)
            ring_reduce_scatter(got, x.clone(), sub)
            gathered = torch.empty(8)
            ring_all_gather(gathered, got, sub)
            want_gathered = torch.empty(8)
            dist.all_gather_into_tensor(want_gathered, want, group=sub)
            found["subgroup"] = (got, want, gathered, want_gathered)
        solo = [dist.new_group([i]) for i in range(world)][rank]  # every rank creates every group
        x = torch.randn(6, generator=torch.Generator().manual_seed(rank))
        got, gathered = torch.empty(6), torch.empty(6)
        ring_reduce_scatter(got, x.clone(), solo)
        ring_all_gather(gathered, x, solo)
        found["solo"] = (x, got, gathered)
    errors = []
    for bad in (lambda: ring_reduce_scatter(torch.empty(3), torch.empty(7 * world + 1), group),
                lambda: ring_reduce_scatter(torch.empty(3), torch.empty(7 * world), group),
                lambda: ring_all_gather(torch.empty(5 * world), torch.empty(4), group)):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    found["errors"] = errors
    torch.save(found, f"{out_dir}/collectives_rank{rank}.pt")


def engine_steps(rank: int, world: int, out_dir: str) -> None:
    """The same two steps of the tiny model at world 2 with rings, then with gloo's collectives."""
    from torch.distributed.fsdp import FSDPModule

    found = {}
    for rings in (True, False):
        engine = FSDPEngine(workers.config(micro_batch_tokens=20,
                                           parallel=ParallelConfig(ring_collectives=rings)))
        comms = {type(group._reduce_scatter_comm).__name__ for m in engine.policy.module.modules()
                 if isinstance(m, FSDPModule) for group in m._get_fsdp_state()._fsdp_param_groups}
        comms |= {type(group._all_gather_comm).__name__ for m in engine.policy.module.modules()
                  if isinstance(m, FSDPModule) for group in m._get_fsdp_state()._fsdp_param_groups}
        found[rings] = {**workers.two_steps(engine, rank, world, None), "comms": comms}
        found[rings]["weights_after"] = sync_weights(engine)
        engine.close()
    torch.save(found, f"{out_dir}/engine_rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_rings_match_gloo_collectives(tmp_path, world):
    run_workers(collectives, world, str(tmp_path))
    for r in range(world):
        found = torch.load(tmp_path / f"collectives_rank{r}.pt", weights_only=False)
        for dtype in DTYPES:
            got, want = found[f"rs_{dtype}"]
            if world == 2:  # a + b == b + a: bit-identical to gloo
                assert torch.equal(got, want), (dtype, got, want)
            else:  # three terms summed in another order
                tol = 1e-6 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            got, want = found[f"rs_max_{dtype}"]
            assert torch.equal(got, want)
            for key in (f"ag_{dtype}", f"ag_inplace_{dtype}"):
                got, want = found[key]
                assert torch.equal(got, want), key
        got, want = found["ag_uint8"]
        assert torch.equal(got, want)
        if world == 3 and r != 1:
            got, want, gathered, want_gathered = found["subgroup"]
            assert torch.equal(got, want) and torch.equal(gathered, want_gathered)
        if world == 3:  # a group of one: both are copies
            x, got, gathered = found["solo"]
            assert torch.equal(got, x) and torch.equal(gathered, x)
        errors = found["errors"]
        assert len(errors) == 3
        assert f"{7 * world + 1} elements" in errors[0] and f"into {world} equal" in errors[0]
        assert "reduce-scatter output: 3" in errors[1] and "expected 7" in errors[1]
        assert "all-gather input: 4" in errors[2] and "expected 5" in errors[2]


def test_fsdp_with_rings_equals_gloo_collectives(tmp_path):
    run_workers(engine_steps, 2, str(tmp_path))
    for r in range(2):
        found = torch.load(tmp_path / f"engine_rank{r}.pt", weights_only=False)
        rings, gloo = found[True], found[False]
        assert rings["comms"] == {"RingAllGather", "RingReduceScatter"}
        assert gloo["comms"] == {"DefaultAllGather", "DefaultReduceScatter"}
        for key in ("grads", "weights_after"):
            assert rings[key].keys() == gloo[key].keys()
            for name in rings[key]:
                assert torch.equal(rings[key][name], gloo[key][name]), (key, name)
        assert torch.equal(rings["logp"], gloo["logp"])
