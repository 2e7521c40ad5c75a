"""Vocabulary-parallel embedding and log-probs (fsdp/vocab_parallel.py) on 2 gloo ranks against the
one-process functions (models/logprobs.py) on the concatenated rows: values and gradients.

The engine-level checks (a sharded step equals one process, resume, bf16) run with it on by default in
test_fsdp_dist.py; here the functions alone, with the cases the engine reaches rarely: an odd
vocabulary (uneven slices), a rank with no rows, entropy, a temperature, chunks smaller than the rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tandem.engines.training.fsdp.vocab_parallel import (
    VocabParallelEmbedding,
    VocabShard,
    vocab_parallel_logprobs,
    vocab_rows,
)
from tandem.models.logprobs import TiedGrad, tied_embedding, token_logprobs

from .helpers import run_workers

pytestmark = pytest.mark.dist
V, H = 51, 8  # odd: rank 0 holds 26 rows, rank 1 25
# tokens per rank, with entropy (the backward has a one-buffer path without it)
CASES = {"uneven-rows": ((7, 3), True), "empty-rank": ((5, 0), False), "no-entropy": ((4, 6), False)}
TEMPERATURE, CHUNK = 0.7, 2


def _data(n_tokens: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(n_tokens)
    return {
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64).float(),
        "mix": torch.randn(H, H, generator=g),
        "ids": torch.randint(0, V, (n,), generator=g),
        "targets": torch.randint(0, V, (n,), generator=g),
        "c_logp": torch.randn(n, generator=g),
        "c_ent": torch.randn(n, generator=g),
    }


def _forward(embed, project, ids, targets, c_logp, c_ent, mix):
    """A tiny tied model: embed, a mixing layer, the projection's log-probs (and entropy); a loss."""
    hidden = torch.tanh(embed(ids) @ mix)
    logp, ent = project(hidden, targets)
    return logp, ent, (logp * c_logp).sum() + (0.0 if ent is None else (ent * c_ent).sum())


def _reference(d, entropy: bool):
    weight = d["weight"].clone().requires_grad_(True)
    mix = d["mix"].clone().requires_grad_(True)
    sink = TiedGrad()
    logp, ent, loss = _forward(
        lambda ids: tied_embedding(ids, weight, sink),
        lambda h, t: token_logprobs(h, weight, t, temperature=TEMPERATURE, chunk_size=CHUNK, with_entropy=entropy,
                                    tied_grad=sink),
        d["ids"], d["targets"], d["c_logp"], d["c_ent"], mix,
    )
    loss.backward()
    return logp.detach(), (ent.detach() if entropy else None), weight.grad, mix.grad


def _projection(embed: VocabParallelEmbedding, entropy: bool):
    def project(h, t):
        return vocab_parallel_logprobs(h, embed.local_weight(), t, embed.shard, temperature=TEMPERATURE,
                                       chunk_size=CHUNK, with_entropy=entropy, grad_into=embed.weight)

    return project


def worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, (counts, entropy) in CASES.items():
        d = _data(counts)
        start, stop = vocab_rows(V, world, rank)
        vs = VocabShard(dist.group.WORLD, rank, world, start, stop, V)
        local = d["weight"][start:stop].clone()
        param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(V, H),
                                                      stride=(H, 1)))
        embed = VocabParallelEmbedding(param, vs, None)
        mix = d["mix"].clone().requires_grad_(True)
        lo = sum(counts[:rank])
        mine = slice(lo, lo + counts[rank])
        inputs = (d["ids"][mine], d["targets"][mine], d["c_logp"][mine], d["c_ent"][mine])
        logp, ent, loss = _forward(embed, _projection(embed, entropy), *inputs, mix)
        loss.backward()
        dist.all_reduce(mix.grad)  # each rank's loss covers its own tokens: the sum is the full loss's
        ref_logp, ref_ent, ref_wgrad, ref_mix = _reference(d, entropy)
        first = param.grad.to_local().clone()
        # a second backward (the next micro-batch) adds into the same .grad
        _forward(embed, _projection(embed, entropy), *inputs, d["mix"])[2].backward()
        results[name] = {
            "logp": (logp.detach() - ref_logp[mine]).abs().max().item() if counts[rank] else 0.0,
            "ent": (ent.detach() - ref_ent[mine]).abs().max().item() if counts[rank] and entropy else 0.0,
            "entropy_returned": ent is not None,
            "weight_grad": (first - ref_wgrad[start:stop]).abs().max().item(),
            "accumulated": (param.grad.to_local() - 2 * ref_wgrad[start:stop]).abs().max().item(),
            "weight_grad_norm": ref_wgrad[start:stop].norm().item(),
            "mix_grad": (mix.grad - ref_mix).abs().max().item(),
            "grad_placement": str(param.grad.placements),
            "embedding_bits": torch.equal(embed(d["ids"][mine]).detach(), d["weight"][d["ids"][mine]]),
        }
    torch.save(results, Path(out_dir) / f"vp_rank{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("vp")
    run_workers(worker, 2, str(out))
    return [torch.load(out / f"vp_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_vocab_parallel_matches_one_process(spawned, case):
    for rank, results in enumerate(spawned):
        r = results[case]
        assert r["logp"] < 1e-5 and r["ent"] < 1e-5, (rank, r)
        assert r["weight_grad_norm"] > 0.1  # the slice really gets a gradient
        assert r["weight_grad"] < 1e-5 and r["mix_grad"] < 1e-5, (rank, r)
        assert r["accumulated"] < 2e-5, (rank, r)
        assert r["entropy_returned"] == CASES[case][1]
        assert r["grad_placement"] == "(Shard(dim=0),)"
        assert r["embedding_bits"], "the all-reduced lookup must be the plain lookup, bit for bit"


def test_vocab_rows_follow_torch_chunk():
    for vocab, world in [(51, 2), (49152, 2), (10, 4), (7, 3)]:
        chunks = torch.arange(vocab).chunk(world)
        for rank in range(world):
            start, stop = vocab_rows(vocab, world, rank)
            got = torch.arange(start, stop)
            want = chunks[rank] if rank < len(chunks) else torch.arange(0)
            assert torch.equal(got, want), (vocab, world, rank)
