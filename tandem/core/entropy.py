"""Entropy and token log-probs from logits, chunked so memory stays bounded on large vocabularies.

A ``[N, V]`` logits tensor with ``V`` ~ 150k makes every full-size temporary (softmax, log-softmax)
as large as the logits themselves. Both functions here walk the rows in chunks of ``chunk_size``; with
grad enabled each chunk runs under activation checkpointing, so the backward pass keeps only the
logits and recomputes one chunk's softmax at a time instead of storing ``[N, V]`` probabilities.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from tandem.core.masked import check_same_shape, masked_mean

__all__ = ["compute_entropy", "entropy_from_logits", "token_log_probs_from_logits"]


def _entropy_chunk(logits: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    log_norm = torch.logsumexp(z, dim=-1)
    probs = torch.softmax(z, dim=-1)
    # H = log Z - sum_v p_v z_v  (the same as -sum p log p, without forming log p)
    return log_norm - (probs * z).sum(-1)


def _log_prob_chunk(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    return z.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _chunked(fn, chunk_size: int, logits: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_extra = [e.reshape(-1) for e in extra]
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        args = (flat[start : start + chunk_size], *(e[start : start + chunk_size] for e in flat_extra))
        parts.append(checkpoint(fn, *args, use_reentrant=False) if use_ckpt else fn(*args))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(lead)


def entropy_from_logits(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[..., V]`` -> ``[...]`` float32, differentiable."""
    return _chunked(_entropy_chunk, chunk_size, logits)


def token_log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024
) -> torch.Tensor:
    """``log softmax(logits)[label]`` per position: logits ``[..., V]``, labels ``[...]`` -> ``[...]`` float32."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} but labels has shape {tuple(labels.shape)} "
            "(expected logits [..., V] and labels [...])"
        )
    return _chunked(_log_prob_chunk, chunk_size, logits, labels.long())


def compute_entropy(
    logits: torch.Tensor, mask: torch.Tensor, *, chunk_size: int = 1024
) -> tuple[torch.Tensor, dict[str, float]]:
    """Entropy ``[B, R]`` of response-space logits ``[B, R, V]`` and the metric ``entropy/mean`` over ``mask``."""
    entropy = entropy_from_logits(logits, chunk_size=chunk_size)
    check_same_shape(entropy=entropy, loss_mask=mask)
    return entropy, {"entropy/mean": float(masked_mean(entropy.detach(), mask))}
