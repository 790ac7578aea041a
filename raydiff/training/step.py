"""One optimizer step: accumulate the gradients of this worker's micro-batches (all-reduced only on the last
one, by DDP or the flat all-reduce), unscale, clip, and apply the step only if everything is finite; then the EMA.

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

import torch
from torch import nn

from raydiff.data.loader import MicroBatch, scaled
from raydiff.model.diffusion import GaussianDiffusion
from raydiff.model.weight_averages import EmaUpdater, PowerEma
from raydiff.seeds import derive_seed
from raydiff.training.flat_allreduce import FlatGradients
from raydiff.training.speed import ddp_of


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for fp32. auto = bf16 on GPUs that compute in it (compute capability 8, Ampere,
    and later; ROCm's), else fp32. Not `torch.cuda.is_bf16_supported()`: it says yes where bf16 is only emulated,
    slowly (T4, V100), and of the current device, not `device`."""
    if precision == "auto":
        in_hardware = device.type == "cuda" and (bool(torch.version.hip)
                                                 or torch.cuda.get_device_capability(device)[0] >= 8)
        return torch.bfloat16 if in_hardware else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def make_optimizer(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused: one kernel per step on GPUs and CPUs, and able to skip a step on the device."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


class DenoisingLoss(nn.Module):
    """The per-sample losses of one micro-batch, from the loader's uint8 images to the squared error: scaling to
    [-1, 1], flips, the forward process, the network under autocast, the target. One module so that torch.compile
    makes one graph of it, fusing the elementwise work around the network (`raydiff.training.speed`); eager, it
    computes exactly what `GaussianDiffusion.loss_per_sample` does.

    :param model: the UNet.
    :param diffusion: its schedule, prediction target and loss.
    :param device: where the micro-batches are trained (the schedule's tables are put there once).
    :param flip: horizontal flips where the loader's flip bit is set (`data.flip`).
    :param channels_last: feed the network NHWC activations (its weights are NHWC too).
    :param autocast_dtype: the network's autocast dtype (bf16, fp16), or None for fp32.
    """

    def __init__(self, model: nn.Module, diffusion: GaussianDiffusion, *, device: torch.device, flip: bool,
                 channels_last: bool = False, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.model, self.diffusion = model, diffusion
        self.flip, self.channels_last, self.autocast_dtype = flip, channels_last, autocast_dtype
        self.device_type = device.type
        diffusion.tables_on(device)  # made now, not inside a compiled graph

    def forward(self, images: torch.Tensor, flips: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        x0 = scaled(images, flips, self.flip)
        if self.channels_last:
            x0 = x0.contiguous(memory_format=torch.channels_last)
            noise = noise.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return self.diffusion.loss_per_sample(self.model, x0, timesteps, noise, labels)


@dataclass
class StepParts:
    """The parts of the optimizer step that stay from step to step: the loss module, the optimizer and its loss
    scaler, and the settings."""

    loss: nn.Module  # a `DenoisingLoss`, under DDP and torch.compile as the speed plan says
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    seed: int
    global_batch: int
    world_size: int
    grad_clip: float  # 0 disables clipping
    timesteps: int  # T, for the loss per timestep quarter
    dropout: bool = True  # the model has dropout: seed it by stream position
    cuda_graphs: bool = False  # the compiled loss replays CUDA graphs: a new step begins at each optimizer step
    flat_grads: FlatGradients | None = None  # `train.allreduce: flat`: the step all-reduces these itself

    @classmethod
    def build(cls, model: nn.Module, diffusion: GaussianDiffusion, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler, *, device: torch.device, autocast_dtype: torch.dtype | None, seed: int,
              flip: bool, global_batch: int, world_size: int, grad_clip: float, dropout: bool,
              channels_last: bool = False) -> StepParts:
        """Inputs whose loss is the eager `DenoisingLoss` of `model` (the worker wraps it for speed afterwards)."""
        loss = DenoisingLoss(model, diffusion, device=device, flip=flip, channels_last=channels_last,
                             autocast_dtype=autocast_dtype)
        return cls(loss=loss, optimizer=optimizer, scaler=scaler, device=device, seed=seed, global_batch=global_batch,
                   world_size=world_size, grad_clip=grad_clip, timesteps=diffusion.timesteps, dropout=dropout)


@dataclass
class StepResult:
    """Device tensors: reading one (float, bool, .item()) waits for the device."""

    finite: torch.Tensor  # bool: the step was applied
    grad_norm: torch.Tensor  # pre-clip global norm
    loss_sum: torch.Tensor  # this worker's summed per-sample losses
    samples: int  # this worker's samples
    quarter_sums: torch.Tensor  # (2, 4): summed losses and sample counts per timestep quarter [0, T/4), ...
    # The last micro-batch, for the divergence diagnostic.
    images: torch.Tensor  # uint8, on the device
    timesteps: torch.Tensor
    losses: torch.Tensor


def optimizer_step(s: StepParts, batches: list[MicroBatch], *, lr: float, ema: EmaUpdater | None = None,
                   ema_decay: float = 0.0, posthoc: PowerEma | None = None, step: int = 0,
                   fault: Callable[[MicroBatch], bool] | None = None) -> StepResult:
    """Train on this worker's micro-batches of optimizer step `step` (counted from 1; the post-hoc averages' time).
    `fault` (fault injection for tests) says which micro-batches get a non-finite loss."""
    params = [p for group in s.optimizer.param_groups for p in group["params"]]
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    ddp = ddp_of(s.loss)
    s.loss.train()
    loss_sum, samples = torch.zeros((), device=s.device), 0
    quarter_sums = torch.zeros((2, 4), device=s.device)
    # Under CUDA graphs a replay overwrites the previous one's outputs, the gradients among them: gradients summed
    # over several micro-batches need buffers of their own (zeroed, not freed, after the step; every parameter of
    # the UNet gets a gradient each step, so a zero buffer changes nothing the optimizer does). One micro-batch
    # lets the optimizer take the graph's output as it is, with no copy. The flat all-reduce's buffer is such a
    # buffer already.
    flat = s.flat_grads
    stable_grads = s.cuda_graphs and len(batches) > 1 and flat is None
    if flat is not None:
        flat.attach()
    elif stable_grads:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    # Accumulate gradients; all-reduce only on the last micro-batch.
    for i, batch in enumerate(batches):
        images, flips = batch.images.to(s.device, non_blocking=True), batch.flips.to(s.device, non_blocking=True)
        timesteps, noise = batch.diffusion_inputs(s.seed, s.timesteps, s.device)
        # Class-conditional: the class ids, the null class where label dropout chose it (drawn by the loader).
        labels = batch.label_inputs(s.device)
        if s.dropout:  # dropout masks, a function of the stream position
            dropout_generator(s.device).manual_seed(derive_seed(s.seed, batch.position))
        if s.cuda_graphs:  # the previous replay's outputs are not read again (losses are copied out below)
            torch.compiler.cudagraph_mark_step_begin()
        sync = ddp is None or i == len(batches) - 1
        with contextlib.nullcontext() if ddp is None or sync else ddp.no_sync():
            losses = s.loss(images, flips, timesteps, noise, labels)
            if fault is not None and fault(batch):
                losses = losses * float("nan")
            # Sum over samples, scaled so that DDP's average over workers gives the global-batch mean.
            s.scaler.scale(losses.sum() * (s.world_size / s.global_batch)).backward()
        losses = losses.detach().float().clone()
        loss_sum += losses.sum()
        samples += len(images)
        quarter = timesteps * 4 // s.timesteps
        quarter_sums[0].index_add_(0, quarter, losses)
        quarter_sums[1].index_add_(0, quarter, torch.ones_like(losses))
    if flat is not None:  # the flat all-reduce: once, after the last backward pass (DDP's ran inside it)
        flat.all_reduce()

    # Unscale, clip, and skip the step on the device if anything is not finite (the gradients are all-reduced,
    # so every worker agrees).
    s.scaler.unscale_(s.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip if s.grad_clip > 0 else math.inf)
    finite = torch.isfinite(grad_norm)
    # The fused AdamW skips the step where `found_inf` is set (attributes not in torch's type stubs). Not through
    # `scaler.step`: in fp16 it would replace this flag with its own, which sees only non-finite gradient elements,
    # and finite gradients whose norm overflows would step (their clipping multiplies them by 0 or NaN).
    s.optimizer.grad_scale, s.optimizer.found_inf = None, (~finite).float()  # type: ignore[attr-defined]
    s.optimizer.step()
    s.scaler.update()  # fp16: the scale follows the non-finite gradients `unscale_` found
    if flat is not None:
        flat.zero()
    else:
        s.optimizer.zero_grad(set_to_none=not stable_grads)

    # Update the EMA, once per optimizer step, on every worker (not at all after a skipped step), and the post-hoc
    # averages (after a skipped step too, with its unchanged weights: their profile counts every step).
    if ema is not None:
        ema(ema_decay, finite)
    if posthoc is not None:
        posthoc(step)
    return StepResult(finite, grad_norm, loss_sum, samples, quarter_sums, images, timesteps, losses)


def dropout_generator(device: torch.device) -> torch.Generator:
    """The generator dropout on `device` draws from (eager and compiled alike): the device's default one.
    Reseeding only it is cheap, where `torch.manual_seed` also reseeds the CPU's Mersenne Twister and every GPU
    (and, in a process that has not initialised CUDA, formats a stack trace)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator
