"""Tensors as views of one flat buffer, each with its own shape and layout (NCHW or NHWC), laid end to end.

Why: an operation over hundreds of small tensors costs the host one launch (and often one allocation) per tensor;
over one buffer it is one kernel. The flat all-reduce keeps the gradients so (`raydiff.training.flat_allreduce`),
the EMA its averages (`raydiff.model.weight_averages`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """`t`'s strides where they span exactly its elements (any dense layout, NCHW or NHWC), else contiguous ones."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return t.stride()
    return torch.empty(t.shape, device="meta").stride()


def views_of(buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `buffer` (1-D, at least as long as `like`'s elements together) with the shapes and dense layouts
    of `like`, in order."""
    views, offset = [], 0
    for t in like:
        views.append(buffer.as_strided(t.shape, dense_strides(t), offset))
        offset += t.numel()
    return views
