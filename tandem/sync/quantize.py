"""Quantize-on-send: the engine receives the bits of the trainer's fake-quantized forward.

`QuantizedSender(sender, cfg)` wraps any transport's sender: each bucket goes through
`tandem.kernels.iter_quantized` (FP8 block by default: e4m3 codes ``<name>`` plus fp32
``<name>_scale_inv``), the op the trainer's QAT forward (`tandem.kernels.apply_qat`) uses, so
``dequantize(quantize(w))`` on the engine side equals the trainer's forward weight bit for bit. A
fp32 weight then travels as ~1/4 of its bytes (fp8 + one fp32 scale per 128 x 128 block).

The engine side either loads the quantized tensors itself (an engine serving block-FP8, e.g. vLLM or
SGLang with ``weight_scale_inv``) or dequantizes them into its dtype: `WeightApplier(engine,
dequantize=cfg)` (`tandem.sync.apply`), which every receiver helper builds from the same config.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tandem.core.protocols import WeightSync
from tandem.kernels.config import QuantConfig
from tandem.kernels.state_dict import iter_quantized

__all__ = ["QuantizedSender", "quantize_buckets"]

Bucket = list[tuple[str, torch.Tensor]]


def quantize_buckets(buckets: Iterable[Bucket], cfg: QuantConfig) -> Iterator[Bucket]:
    """Each bucket with its targeted weights replaced by their quantized tensors (streamed: one
    bucket is quantized while the transport sends the previous one)."""
    for bucket in buckets:
        yield list(iter_quantized(bucket, cfg))


class QuantizedSender:
    """A `WeightSync` that quantizes every bucket with ``cfg`` before ``sender`` moves it."""

    def __init__(self, sender: WeightSync, cfg: QuantConfig) -> None:
        self.sender, self.cfg = sender, cfg

    def send(self, buckets: Iterable[Bucket], version: int) -> dict[str, float]:
        counted = _CountingBuckets(buckets)
        metrics = self.sender.send(quantize_buckets(counted, self.cfg), version)
        return metrics | {"sync/bytes_unquantized": float(counted.nbytes)}

    def close(self) -> None:
        self.sender.close()


class _CountingBuckets:
    """Iterates the trainer's buckets, counting their bytes before quantization."""

    def __init__(self, buckets: Iterable[Bucket]) -> None:
        self.buckets, self.nbytes = buckets, 0

    def __iter__(self) -> Iterator[Bucket]:
        for bucket in self.buckets:
            self.nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket
