"""One optimizer step: accumulate the gradients of this worker's micro-batches (all-reduced only on the last
one), unscale, clip, and apply the step only if everything is finite; then the EMA.

The step never waits for the device: whether it was finite stays a device tensor, the optimizer skips a
non-finite step on the device (fused AdamW's `found_inf`, the mechanism GradScaler uses), and the EMA update is
weighted by it. The caller reads the numbers at log steps only. Used by the training loop and by
`raydiff.lr_find`, so that both train exactly alike.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from raydiff.data.loader import MicroBatch
from raydiff.data.order import derive_seed
from raydiff.model.diffusion import GaussianDiffusion
from raydiff.model.ema import EmaUpdater


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for fp32. auto = bf16 on GPUs that support it, else fp32."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused: one kernel per step on GPUs and CPUs, and able to skip a step on the device."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


def speed_options(compile_option: bool | str, channels_last: bool | str, device: torch.device) -> dict[str, Any]:
    """What `train.compile` and `train.channels_last` mean on this device: {"compile": False | True | backend,
    "channels_last": bool}. auto compiles on GPUs (falling back to eager if compilation fails there) and keeps
    NCHW (GroupNorm, most of this UNet's memory traffic, is not faster in NHWC everywhere)."""
    chosen = device.type == "cuda" if compile_option == "auto" else compile_option
    return {"compile": chosen, "compile_fallback": compile_option == "auto",
            "channels_last": False if channels_last == "auto" else bool(channels_last)}


def compiled(model: nn.Module, option: bool | str, *, fallback: bool) -> nn.Module:
    """`model` under torch.compile (option True = the default backend, a string = that backend), or as it is."""
    if option is False:
        return model
    if fallback:
        from torch import _dynamo

        _dynamo.config.suppress_errors = True  # auto: an unsupported setup trains in eager mode instead
    wrapped = torch.compile(model) if option is True else torch.compile(model, backend=option)
    return cast(nn.Module, wrapped)  # an OptimizedModule


@dataclass
class StepInputs:
    """What does not change from step to step."""

    model: nn.Module  # what runs forward: the DDP wrapper under DDP, possibly compiled
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
    dropout: bool = True  # the model has dropout: seed it by stream position
    channels_last: bool = False


@dataclass
class StepResult:
    """Device tensors: reading one (float, bool, .item()) waits for the device."""

    finite: torch.Tensor  # bool: the step was applied
    grad_norm: torch.Tensor  # pre-clip global norm
    loss_sum: torch.Tensor  # this worker's summed per-sample losses
    samples: int  # this worker's samples
    quarter_sums: torch.Tensor  # (2, 4): summed losses and sample counts per timestep quarter [0, T/4), ...
    # The last micro-batch, for the divergence diagnostic.
    x0: torch.Tensor
    timesteps: torch.Tensor
    losses: torch.Tensor


def optimizer_step(s: StepInputs, batches: list[MicroBatch], *, lr: float, ema: EmaUpdater | None = None,
                   ema_decay: float = 0.0, fault: Callable[[MicroBatch], bool] | None = None) -> StepResult:
    """Train on this worker's micro-batches of one step. `fault` (fault injection for tests) says which
    micro-batches get a non-finite loss."""
    params = [p for group in s.optimizer.param_groups for p in group["params"]]
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    bare = unwrap_compiled(s.model)
    ddp = bare if isinstance(bare, nn.parallel.DistributedDataParallel) else None
    s.model.train()
    loss_sum, samples = torch.zeros((), device=s.device), 0
    quarter_sums = torch.zeros((2, 4), device=s.device)

    # Accumulate gradients; all-reduce only on the last micro-batch.
    for i, batch in enumerate(batches):
        x0 = batch.to_device(s.device, s.flip)
        if s.channels_last:
            x0 = x0.contiguous(memory_format=torch.channels_last)
        timesteps, noise = batch.diffusion_inputs(s.seed, s.diffusion.timesteps, s.device)
        # Class-conditional: the class ids, the null class where label dropout chose it (drawn by the loader).
        labels = batch.label_inputs(s.device)
        if s.dropout:  # dropout masks, a function of the stream position
            dropout_generator(s.device).manual_seed(derive_seed(s.seed, batch.position))
        sync = ddp is None or i == len(batches) - 1
        with contextlib.nullcontext() if ddp is None or sync else ddp.no_sync():
            with torch.autocast(s.device.type, dtype=s.autocast_dtype, enabled=s.autocast_dtype is not None):
                losses = s.diffusion.loss_per_sample(s.model, x0, timesteps, noise, labels)
            if fault is not None and fault(batch):
                losses = losses * float("nan")
            # Sum over samples, scaled so that DDP's average over workers gives the global-batch mean.
            s.scaler.scale(losses.sum() * (s.world_size / s.global_batch)).backward()
        loss_sum += losses.detach().float().sum()
        samples += len(x0)
        quarter = timesteps * 4 // s.diffusion.timesteps
        quarter_sums[0].index_add_(0, quarter, losses.detach().float())
        quarter_sums[1].index_add_(0, quarter, torch.ones_like(losses, dtype=torch.float32))

    # Unscale, clip, and skip the step on the device if anything is not finite (the gradients are all-reduced,
    # so every worker agrees).
    s.scaler.unscale_(s.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else math.inf)
    finite = torch.isfinite(grad_norm)
    # The scaler sets its own in fp16; the fused AdamW reads these attributes (not in torch's type stubs).
    s.optimizer.grad_scale, s.optimizer.found_inf = None, (~finite).float()  # type: ignore[attr-defined]
    s.scaler.step(s.optimizer)
    s.scaler.update()
    s.optimizer.zero_grad(set_to_none=True)

    # Update the EMA, once per optimizer step, on every worker (not at all after a skipped step).
    if ema is not None:
        ema(ema_decay, finite)
    return StepResult(finite, grad_norm, loss_sum, samples, quarter_sums, x0, timesteps, losses)


def dropout_generator(device: torch.device) -> torch.Generator:
    """The generator dropout on `device` draws from (eager and compiled alike): the device's default one.
    Reseeding only it is cheap, where `torch.manual_seed` also reseeds the CPU's Mersenne Twister and every GPU
    (and, in a process that has not initialised CUDA, formats a stack trace)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module torch.compile wrapped, if it did."""
    return getattr(model, "_orig_mod", model)
