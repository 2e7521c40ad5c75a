"""Small builders of `TrainBatch`es in response space for the core-math tests."""

from __future__ import annotations

import torch

from tandem.core.batch import TrainBatch


def make_batch(mask, **fields) -> TrainBatch:
    """A batch whose response-space fields are given directly (token ids are irrelevant to the math)."""
    mask = torch.as_tensor(mask, dtype=fields.pop("dtype", torch.float32))
    b, r = mask.shape
    tensors = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name == "group_index":
            tensors[name] = torch.as_tensor(value, dtype=torch.long)
        else:
            tensors[name] = torch.as_tensor(value, dtype=mask.dtype)
    return TrainBatch(
        input_ids=torch.zeros(b, r + 1, dtype=torch.long),
        seq_lengths=torch.full((b,), r + 1, dtype=torch.long),
        prompt_lengths=torch.ones(b, dtype=torch.long),
        loss_mask=mask,
        **tensors,
    )


def right_padded_mask(lengths, width: int, dtype=torch.float32) -> torch.Tensor:
    lengths = torch.as_tensor(lengths)
    return (torch.arange(width)[None, :] < lengths[:, None]).to(dtype)
