"""One optimizer step: accumulate the gradients of this worker's micro-batches (all-reduced only on the last
one), unscale, clip, and apply the step only if everything is finite; then the EMA.

Used by the training loop and by `raydiff.lr_find`, so that both train exactly alike.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from raydiff.data.loader import MicroBatch
from raydiff.data.order import derive_seed
from raydiff.model.diffusion import GaussianDiffusion
from raydiff.model.ema import update_ema


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for fp32. auto = bf16 on GPUs that support it, else fp32."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


@dataclass
class StepInputs:
    """What does not change from step to step."""

    model: nn.Module  # what runs forward: the DDP wrapper under DDP
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    diffusion: GaussianDiffusion
    device: torch.device
    autocast_dtype: torch.dtype | None
    seed: int
    flip: bool
    global_batch: int
    world_size: int
    grad_clip: float  # 0 disables clipping


@dataclass
class StepResult:
    finite: bool
    grad_norm: torch.Tensor  # pre-clip global norm
    loss_sum: torch.Tensor  # this worker's summed per-sample losses
    samples: int  # this worker's samples
    # The last micro-batch, for the divergence diagnostic.
    x0: torch.Tensor
    timesteps: torch.Tensor
    losses: torch.Tensor


def optimizer_step(s: StepInputs, batches: list[MicroBatch], *, lr: float, ema: nn.Module | None = None,
                   ema_decay: float = 0.0, fault: Callable[[MicroBatch], bool] | None = None) -> StepResult:
    """Train on this worker's micro-batches of one step. `fault` (fault injection for tests) says which
    micro-batches get a non-finite loss."""
    params = [p for group in s.optimizer.param_groups for p in group["params"]]
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    is_ddp = isinstance(s.model, nn.parallel.DistributedDataParallel)
    s.model.train()
    loss_sum, samples = torch.zeros((), device=s.device), 0

    # Accumulate gradients; all-reduce only on the last micro-batch.
    for i, batch in enumerate(batches):
        x0 = batch.to_device(s.device, s.flip)
        timesteps, noise = batch.diffusion_inputs(s.seed, s.diffusion.timesteps, s.device)
        torch.manual_seed(derive_seed(s.seed, batch.position))  # dropout, a function of the stream position
        sync = not is_ddp or i == len(batches) - 1
        with contextlib.nullcontext() if sync else s.model.no_sync():
            with torch.autocast(s.device.type, dtype=s.autocast_dtype, enabled=s.autocast_dtype is not None):
                losses = s.diffusion.loss_per_sample(s.model, x0, timesteps, noise)
            if fault is not None and fault(batch):
                losses = losses * float("nan")
            # Sum over samples, scaled so that DDP's average over workers gives the global-batch mean.
            s.scaler.scale(losses.sum() * (s.world_size / s.global_batch)).backward()
        loss_sum += losses.detach().float().sum()
        samples += len(x0)

    # Unscale, clip, and skip the step if anything is not finite (gradients are all-reduced: all workers agree).
    s.scaler.unscale_(s.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else math.inf)
    finite = bool(torch.isfinite(grad_norm))
    if finite or s.scaler.is_enabled():
        s.scaler.step(s.optimizer)  # the scaler skips non-finite steps itself
    s.scaler.update()
    s.optimizer.zero_grad(set_to_none=True)

    # Update the EMA, once per optimizer step, on every worker.
    if finite and ema is not None:
        update_ema(ema, unwrap(s.model), ema_decay)
    return StepResult(finite, grad_norm, loss_sum, samples, x0, timesteps, losses)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
