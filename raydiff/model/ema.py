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


class EmaUpdater:
    """Updates `ema` towards `model` once per optimizer step. The parameter lists are built once (they are views
    of the live tensors, so restores and DDP wrapping keep them valid), and a step's weight can be a device
    tensor: an update weighted by `finite` (0 or 1) is skipped on the device, without a host sync."""

    def __init__(self, ema: nn.Module, model: nn.Module) -> None:
        self._ema: list[torch.Tensor] = list(ema.parameters())
        self._model = [p.detach() for p in model.parameters()]
        self._ema_buffers, self._model_buffers = list(ema.buffers()), list(model.buffers())

    @torch.no_grad()
    def __call__(self, decay: float, finite: torch.Tensor | None = None) -> None:
        # ema += weight * (model - ema). Not lerp: its weight is a number, and a device tensor given there is read
        # back to the host (a sync every step). A weight of 0 leaves the EMA exactly as it was.
        weight = 1.0 - decay if finite is None else finite.to(self._ema[0].dtype) * (1.0 - decay)
        increments = torch._foreach_sub(self._model, self._ema)
        torch._foreach_mul_(increments, weight)
        torch._foreach_add_(self._ema, increments)
        for e, b in zip(self._ema_buffers, self._model_buffers, strict=True):
            e.copy_(b)
