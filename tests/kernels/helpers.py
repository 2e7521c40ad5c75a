"""Bit-level comparison helpers for the kernel tests."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as an integer tensor of the same element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """Same dtype, shape and bits; NaNs must sit at the same places (their payloads may differ)."""
    if a is None or b is None:
        assert a is b, (a, b)
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point and a.element_size() > 1:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b), "NaN positions differ"
        a, b = torch.where(nan_a, 0, a), torch.where(nan_b, 0, b)
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{int(diff.sum())} of {a.numel()} elements differ, first at {diff.nonzero()[0].tolist()}"


def spread(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Random values spanning ~6 decades across columns, with some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
    x.view(-1)[::13] = 0.0
    return x.to(dtype).to(device)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, +-Inf, a negative zero and (for fp32) a subnormal planted in it."""
    x = x.clone()
    flat = x.view(-1)
    n = flat.numel()
    subnormal = {torch.float32: 1e-40, torch.bfloat16: 1e-39, torch.float16: 1e-6}[x.dtype]
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, subnormal]
    for i, v in enumerate(specials):
        flat[(7 * i + 3) % n] = v
    return x
