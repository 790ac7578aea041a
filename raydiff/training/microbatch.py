"""`train.micro_batch: auto`: the largest per-worker micro-batch that fits the device, found by measurement.

On a GPU, forward + backward passes of the real model under the real precision are tried at growing batch
sizes (doubling, then bisecting between the last fit and the first out-of-memory), with the optimizer's
moment buffers already allocated, and the result keeps a safety margin. On a CPU memory is rarely the
limit and there is nothing to measure: the whole share is one micro-batch (no accumulation).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from raydiff.cluster.devices import out_of_memory
from raydiff.config import ConfigError
from raydiff.data.order import rank_share
from raydiff.model.unet import UNet

logger = logging.getLogger("raydiff")
SAFETY_MARGIN = 0.9  # use 90% of the largest batch that fit: the allocator fragments over a long run


class NothingFits(ConfigError):
    """`train.micro_batch: auto` found that not even one image fits a worker's device: the run cannot train as
    configured (every worker raises it alike, after agreeing; nothing has been trained or written). A config
    error, so that a command that plans memory in its own process (`raydiff.lr_find`) says it in one line too."""


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [1, upper] with fits(n), assuming fits is monotone (true up to some n, false after).
    Returns 0 if not even 1 fits. Doubles from 1, then bisects: O(log upper) calls."""
    if not fits(1):
        return 0
    good, n = 1, 2
    while n <= upper and fits(n):
        good, n = n, n * 2
    bad = min(n, upper + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def probe_share(global_batch: int, world_size: int) -> int:
    """The share every worker measures up to: the largest (rank 0's). Where shares differ by one image, the larger
    ones are then one pass, not two, when everything fits (the workers agree on the smallest measurement)."""
    return rank_share(global_batch, world_size, 0).size


def measure_micro_batch(model: torch.nn.Module, diffusion, optimizer: torch.optim.Optimizer, *, share: int,
                        shape: tuple[int, int, int], device: torch.device, autocast_dtype: torch.dtype | None) -> int:
    """Largest micro-batch (<= share) whose forward + backward fits next to the weights, EMA and optimizer, less
    the safety margin; 0 if not even one image does."""
    if device.type != "cuda":
        logger.info(f"[raydiff] train.micro_batch=auto on {device.type}: no memory to probe, one pass per step "
                    f"(micro-batch {share})")
        return share
    # Probed past the share by the margin: a share that fits without it is split too (it fit with no headroom).
    largest = largest_that_fits(model, diffusion, optimizer, share=math.ceil(share / SAFETY_MARGIN), shape=shape,
                                device=device, autocast_dtype=autocast_dtype)
    if largest == 0:  # said by `plan_memory`, once every worker agrees (a raise here would hang the others)
        return 0
    chosen = min(share, max(1, int(largest * SAFETY_MARGIN)))
    logger.info(f"[raydiff] train.micro_batch=auto: up to {largest} images fit on {device}; using {chosen}")
    return chosen


def largest_that_fits(model: torch.nn.Module, diffusion, optimizer: torch.optim.Optimizer, *, share: int,
                      shape: tuple[int, int, int], device: torch.device, autocast_dtype: torch.dtype | None) -> int:
    """The probe itself: the largest n <= share whose forward + backward passes ran, beside a reserve for the
    optimizer's moments; 0 if not even one image, or not the reserve, fits. Only running out of memory counts as
    not fitting; any other error is raised. Every allocation is inside the probe's try: an out-of-memory error that
    escaped it would end this worker before the collective the others wait in (`plan_memory`'s agree)."""
    def forward_and_backward(n: int) -> None:  # its tensors go with its frame, before the cache is emptied
        x = torch.randn(n, *shape, device=device)
        t = torch.randint(0, diffusion.timesteps, (n,), device=device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = diffusion.loss_per_sample(model, x, t, torch.randn_like(x)).sum()
        loss.backward()

    def fits(n: int) -> bool:
        try:
            forward_and_backward(n)
            return True
        except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if not out_of_memory(exc):
                raise
            return False
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    reserve: list[torch.Tensor] = []
    try:
        # Reserve what AdamW will hold after its first step, so the probe does not hand that memory out twice.
        reserve = [torch.empty_like(p, dtype=torch.float32) for p in model.parameters() for _ in range(2)
                   if not optimizer.state.get(p)]
        return largest_fitting(fits, share)
    except (RuntimeError, MemoryError) as exc:
        if not out_of_memory(exc):
            raise
        return 0  # not even the optimizer's moments fit beside the model
    finally:
        reserve.clear()
        torch.cuda.empty_cache()
        if device.type == "cuda":  # the metrics rows' peak_memory_gb is training's, not the probe's
            torch.cuda.reset_peak_memory_stats(device)


def plan_memory(model: UNet, diffusion, optimizer: torch.optim.Optimizer, *,
                fixed_micro_batch: int | None, checkpointing: bool | str, share: int, shape: tuple[int, int, int],
                device: torch.device, autocast_dtype: torch.dtype | None,
                agree: Callable[[int], int]) -> tuple[int, bool, str]:
    """The micro-batch and whether to checkpoint activations (`train.micro_batch`, `train.activation_checkpointing`),
    with a phrase for the start line saying why. `fixed_micro_batch`: the config's micro-batch for this world size
    (`Config.micro_batch_for`), None where `train.micro_batch: auto` has it measured up to `share` (`probe_share`).
    Measures with the setting it
    will train with. `agree` turns a number into the smallest over all workers (a collective), so every worker
    decides alike.

    `auto` checkpointing is on when, without it, the measured micro-batch is smaller than the share: recomputing
    activations then saves accumulation passes. With a fixed micro-batch there is nothing measured and it is off.
    """
    def measured(on: bool) -> int:
        model.activation_checkpointing = on
        return agree(measure_micro_batch(model, diffusion, optimizer, share=share, shape=shape, device=device,
                                         autocast_dtype=autocast_dtype))

    def some(n: int, tried: str) -> int:
        if n == 0:
            raise NothingFits(f"train.micro_batch=auto: not even one {'x'.join(map(str, shape))} image fits "
                              f"on {device.type} beside the model, its EMA and the optimizer ({tried}); use a "
                              f"smaller model (model.base_channels, model.channel_mult) or a device with more memory")
        return n

    if checkpointing != "auto":
        on = bool(checkpointing)
        model.activation_checkpointing = on
        tried = f"activation checkpointing {'on' if on else 'off'}"
        chosen = some(measured(on), tried) if fixed_micro_batch is None else fixed_micro_batch
        return chosen, on, f"activation checkpointing {'on' if on else 'off'}"
    if fixed_micro_batch is not None:
        model.activation_checkpointing = False
        return fixed_micro_batch, False, "activation checkpointing off (auto: train.micro_batch is fixed)"
    full = agree(share)
    without = measured(False)
    if without >= full:
        return without, False, f"activation checkpointing off (auto: the whole share of {full} fits without it)"
    with_it = measured(True)
    if with_it <= without:
        model.activation_checkpointing = False
        why = f"activation checkpointing off (auto: {without} images fit without it and no more with it)"
        return some(without, "with activation checkpointing and without"), False, why
    return with_it, True, (f"activation checkpointing on (auto: {without} of the share of {full} fit without it, "
                           f"{with_it} with it)")
