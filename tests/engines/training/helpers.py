"""Shared pieces of the training-engine tests: batches, loss functions, references, a gloo launcher.

The loss functions here are what a user plugin would be: small `LossFn`s that divide by the global
normaliser in `LossScale`, with metrics reported as micro-batch shares of the global value.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

from tandem.core.batch import TrainBatch, response_index
from tandem.core.protocols import LogProbOutput, LossScale
from tandem.core.sample import Sample
from tandem.engines.training.common.rank_exit import exit_rank

TINY = "tiny-llama"
# (prompt, response) lengths of a mixed batch; row 3 has a one-token response.
MIXED = [(5, 7), (3, 12), (9, 4), (2, 1), (6, 9), (4, 3), (7, 6), (3, 10)]


# GRPO-like: rows 2k and 2k + 1 share a prompt length; with ``shared_prompts`` also the prompt's tokens
GROUPED = [(5, 7), (5, 12), (9, 4), (9, 1), (6, 9), (6, 3), (7, 6), (7, 10)]


def make_batch(
    shape: Sequence[tuple[int, int]] = MIXED, *, seed: int = 0, vocab: int = 512, shared_prompts: bool = False
) -> TrainBatch:
    """Random token ids, advantages, and a loss mask with one environment span (row 1).

    ``shared_prompts``: a row with the group index (``i // 2``) and prompt length of the row before it
    repeats that row's prompt tokens (the rows of a GRPO group)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate(shape):
        tokens = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        if shared_prompts and i % 2 and shape[i - 1][0] == p:
            tokens[:p] = samples[-1].tokens[:p]
        mask = [1] * r
        if i == 1 and r > 6:
            mask[3:6] = [0, 0, 0]  # a tool result inside the response
        samples.append(Sample(tokens=tokens, response_length=r, loss_mask=mask, index=i, group_index=i // 2))
    batch = TrainBatch.from_samples(samples, pad_token_id=2)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def token_mean_pg(out: LogProbOutput, batch: TrainBatch, scale: LossScale):
    """``-sum(A * log p * m) / num_tokens`` (token-mean policy gradient)."""
    loss = -(out.log_probs * batch.advantages * batch.loss_mask).sum() / scale.num_tokens
    share = (out.log_probs.detach() * batch.loss_mask).sum() / scale.num_tokens
    return loss, {"pg/loss": loss.detach(), "pg/logp_mean": share, "pg/logp/min": out.log_probs.detach().min()}


def seq_mean_pg(out: LogProbOutput, batch: TrainBatch, scale: LossScale):
    """``-sum_i (sum_t A log p m / n_i) / num_sequences`` (sequence-mean policy gradient)."""
    per_row = (out.log_probs * batch.advantages * batch.loss_mask).sum(1)
    n = batch.loss_mask.sum(1).clamp(min=1)
    loss = -(per_row / n).sum() / scale.num_sequences
    return loss, {"pg/loss": loss.detach()}


class EntropyBonusLoss:
    """Token-mean PG minus an entropy bonus; asks the engine for entropy with ``needs_entropy``."""

    needs_entropy = True

    def __call__(self, out: LogProbOutput, batch: TrainBatch, scale: LossScale):
        pg, metrics = token_mean_pg(out, batch, scale)
        ent = (out.entropy * batch.loss_mask).sum() / scale.num_tokens
        return pg - 0.01 * ent, {**metrics, "entropy": ent.detach()}


class NaNOnCall:
    """Token-mean PG whose ``k``-th micro-batch loss (0-based) is NaN."""

    def __init__(self, k: int = 0) -> None:
        self.k, self.calls = k, 0

    def __call__(self, out: LogProbOutput, batch: TrainBatch, scale: LossScale):
        loss, metrics = token_mean_pg(out, batch, scale)
        self.calls += 1
        if self.calls - 1 == self.k:
            loss = loss * float("nan")
        return loss, metrics


def value_mse(out: LogProbOutput, batch: TrainBatch, scale: LossScale):
    """``sum((V - returns)^2 m) / (2 num_tokens)``."""
    err = ((out.values - batch.returns) ** 2 * batch.loss_mask).sum() / (2 * scale.num_tokens)
    return err, {"value/loss": err.detach()}


# -- references -------------------------------------------------------------------------------------


def hf_response_logprobs(hf_model, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
    """``[B, R]`` log-probs from the HF model's full padded logits (plain log_softmax, no chunking)."""
    ids = batch.input_ids
    mask = (torch.arange(ids.shape[1])[None, :] < batch.seq_lengths[:, None]).long()
    logits = hf_model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
    width = int(batch.loss_mask.shape[1])
    idx = response_index(batch.prompt_lengths, width).clamp(max=logp.shape[1] - 1)
    valid = torch.arange(width)[None, :] < batch.response_lengths[:, None]
    return logp.gather(1, idx) * valid


def global_scale(batch: TrainBatch) -> LossScale:
    per_row = batch.loss_mask.sum(1)
    return LossScale(
        num_tokens=float(per_row.sum()),
        num_sequences=float((per_row > 0).sum()),
        max_response_length=int(batch.response_lengths.max()),
    )


def strip(name: str) -> str:
    return name.removeprefix("lm.")


def engine_grads(engine) -> dict[str, torch.Tensor]:
    """Full gradients of the policy's trainable parameters under HF names (collective when sharded)."""
    from tandem.engines.training.fsdp.parallel import full_tensor

    return {
        strip(n): full_tensor(p.grad, engine.ctx.device).clone()
        for n, p in engine.policy.module.named_parameters()
        if p.grad is not None
    }


def sync_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's weights as `named_parameters_for_sync` yields them (collective when sharded)."""
    return {n: t.detach().cpu().clone() for bucket in engine.named_parameters_for_sync(1 << 20) for n, t in bucket}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# -- multi-process launcher -------------------------------------------------------------------------


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets are held together, so two calls' ports cannot collide."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a worker killed by a signal (SIGABRT from C++) shows where it was

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two ranks share the machine's two cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # not a normal exit: gloo's worker threads may abort the interpreter's finalization


def run_workers(fn: Callable, world_size: int, *args, master_port: int | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by gloo.

    ``fn`` must be importable (module level); results travel through files the caller names in
    ``args``. Raises if any worker fails.
    """
    port = master_port or free_port()
    mp.start_processes(_entry, args=(fn, world_size, port, args), nprocs=world_size, start_method="spawn")
