"""Exponential moving average of the weights, updated once per optimizer step, with warmup."""

from __future__ import annotations

import copy

import torch
from torch import nn


def ema_decay_at(step: int, decay: float, warmup_steps: int) -> float:
    """Decay for the update after `step` optimizer steps.

    The EMA averages over a window of about 1 / (1 - decay) steps. During warmup that window grows
    linearly from 1 step (a copy of the online weights) to its full length at `warmup_steps`, so the
    average never holds on to the random initialisation for long.
    """
    if warmup_steps <= 0:
        return decay
    full_window = 1.0 / (1.0 - decay)
    window = min(full_window, 1.0 + (full_window - 1.0) * step / warmup_steps)
    return 1.0 - 1.0 / window


def make_ema(model: nn.Module) -> nn.Module:
    """An fp32 copy of `model` for averaging: eval mode, no gradients."""
    return copy.deepcopy(model).float().eval().requires_grad_(False)


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    ema_params = list(ema.parameters())
    torch._foreach_lerp_(ema_params, [p.detach().to(e.dtype) for e, p in zip(ema_params, model.parameters())],
                         1.0 - decay)
    for e, b in zip(ema.buffers(), model.buffers()):
        e.copy_(b)
