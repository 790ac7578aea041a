"""Averaging the workers' gradients without DDP: the gradients as views of one buffer, all-reduced in one
collective after the last micro-batch's backward pass (`train.allreduce: flat`).

Why: DDP all-reduces its buckets from hooks that fire inside the backward pass, which torch cannot replay as CUDA
graphs (pytorch#128218), and compiled without CUDA graphs the step is bound by the host launching its kernels, not
by the GPU (docs/benchmarks.md#gpu-throughput). With the gradients in one buffer of their own, the all-reduce runs
after the replayed backward pass, outside the graphs, so the step replays as CUDA graphs with any number of
workers. What it gives up is DDP's overlap of the all-reduce with the backward pass: little inside a node, more
across slow links (docs/training.md#performance). The arithmetic is DDP's (each worker's gradients divided by the
world size, then summed; in bf16 with `train.grad_compression: bf16`, as DDP's `bf16_compress_hook`), so both
train the same weights (tests/training/test_speed.py; to rounding under NCCL with three or more GPUs, whose order
of summing follows its chunking of a buffer: 25 MB buckets, or one of 143 MB).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raydiff.model.flat import views_of


class FlatGradients:
    """The `.grad` of every parameter as a view of one buffer, laid out like the parameter (NCHW or NHWC), so
    that autograd accumulates micro-batches into it in place and the optimizer reads it as it would any gradient.

    :param params: the parameters the optimizer steps, in its order.
    :param world_size: the number of workers averaging.
    :param compression: "none" or "bf16" (`train.grad_compression`).
    """

    def __init__(self, params: list[nn.Parameter], *, world_size: int, compression: str) -> None:
        self.params, self.world_size, self.compression = params, world_size, compression
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views = views_of(self.buffer, params)

    def broadcast_weights(self) -> None:
        """Every worker takes rank 0's weights, as DDP makes sure when it wraps a module (they agree already: the
        same seed, checkpoint or `model.init_from` on every worker), through the buffer: one collective."""
        with torch.no_grad():
            for p, view in zip(self.params, self.views, strict=True):
                view.copy_(p)
            dist.broadcast(self.buffer, src=0)
            for p, view in zip(self.params, self.views, strict=True):
                p.copy_(view)
        self.buffer.zero_()

    def attach(self) -> None:
        """Make each parameter's gradient its view (again, where something set it to None or replaced it)."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def all_reduce(self) -> None:
        """Every worker's gradients become their average over the workers: one collective."""
        if self.compression == "bf16":
            compressed = self.buffer.to(torch.bfloat16).div_(self.world_size)
            dist.all_reduce(compressed)
            self.buffer.copy_(compressed)
        else:
            self.buffer.div_(self.world_size)
            dist.all_reduce(self.buffer)

    def zero(self) -> None:
        """After the step: the same buffer, zeroed, for the next step's first micro-batch to accumulate into."""
        self.buffer.zero_()
