"""`python -m raydiff.bench memory`: the memory one training step needs at a micro-batch, with and without
activation checkpointing, so that a run's micro-batch and GPU can be planned before it starts.

A step holds the weights, their gradients, AdamW's two moment buffers, the EMA copy (on a GPU with the copy of
the weights its update keeps, `EmaUpdater`) and the activations the backward pass needs. On CUDA the figure is
torch's peak allocated memory over a training step (forward, backward, AdamW, EMA) under the preset's precision,
measured after a first step has allocated the optimizer state. On a CPU, which has no allocator statistics, the
same parts are counted: the tensors' bytes for the weights, gradients, optimizer state and EMA, and for the
activations the bytes the autograd graph keeps for the backward pass (seen through
`torch.autograd.graph.saved_tensors_hooks`, each storage once). With checkpointing the graph keeps each
block's input only, and the backward pass recomputes one block at a time, so the largest block's own activations
are added to it. The CPU figure is the sum of the parts, an upper bound of the peak (gradients grow as
activations are freed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from raydiff.bench import load_model_config
from raydiff.config import Config
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import AttnBlock, ResBlock, UNet, build_model, count_parameters
from raydiff.model.weight_averages import EmaUpdater, make_ema
from raydiff.training.step import make_optimizer, resolve_precision

GB = 1e9


def _bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextmanager
def _kept_for_backward(model: nn.Module) -> Iterator[dict[str, int]]:
    """Counts what the autograd graph keeps: {"total": bytes, "largest_block": bytes of the residual or attention
    block that keeps the most of its own}. Each storage is counted once."""
    seen: set[int] = set()
    per_block: dict[int, int] = {}
    running: list[int] = []  # the blocks whose forward is running, innermost last
    counts = {"total": 0, "largest_block": 0}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counts["total"] += storage.nbytes()
            if running:
                per_block[running[0]] = per_block.get(running[0], 0) + storage.nbytes()
        return tensor

    def enter(module: nn.Module, args: Any) -> None:
        running.append(id(module))

    def leave(module: nn.Module, args: Any, out: Any) -> None:  # returns None: the block's output stays as it is
        running.pop()

    handles = []
    for block in (m for m in model.modules() if isinstance(m, (ResBlock, AttnBlock))):
        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield counts
    finally:
        for handle in handles:
            handle.remove()
        counts["largest_block"] = max(per_block.values(), default=0)


def _step(model: UNet, ema_update: EmaUpdater, optimizer: torch.optim.Optimizer, diffusion, batch: int,
          shape: tuple[int, int, int], device: torch.device, autocast_dtype: torch.dtype | None) -> None:
    """One training step on random images (the memory does not depend on their values)."""
    x0 = torch.randn(batch, *shape, device=device)
    t = torch.randint(0, diffusion.timesteps, (batch,), device=device)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = diffusion.loss_per_sample(model, x0, t, torch.randn_like(x0)).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ema_update(0.999)


def _fixed_parts(model: nn.Module, ema: nn.Module, ema_update: EmaUpdater,
                 optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"weights": _bytes(iter(params)), "gradients": _bytes(iter(params)), "optimizer": _bytes(iter(state)),
            "ema": _bytes(ema.parameters()) + ema_update.staging_bytes}  # on a GPU, the copy its update lerps to


def measure_step_memory(cfg: Config, micro_batch: int, device: torch.device) -> dict[str, Any]:
    """The memory of one training step of `cfg`'s model at `micro_batch`, with and without checkpointing."""
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    ema = make_ema(model)
    optimizer = make_optimizer(model, lr=1e-6, weight_decay=0.0)
    diffusion = build_diffusion(cfg)
    autocast_dtype = resolve_precision(cfg.train.precision, device)
    shape = (cfg.data.channels, cfg.data.resolution, cfg.data.resolution)
    ema_update = EmaUpdater(ema, model)
    _step(model, ema_update, optimizer, diffusion, 1, shape, device, autocast_dtype)  # allocates AdamW's state
    fixed = _fixed_parts(model, ema, ema_update, optimizer)

    result: dict[str, Any] = {"micro_batch": micro_batch, "device": str(device),
                              "parameters": count_parameters(model), "resolution": cfg.data.resolution,
                              "precision": str(autocast_dtype or torch.float32).removeprefix("torch.")}
    for checkpointed in (False, True):
        model.activation_checkpointing = checkpointed
        suffix = "_checkpointed" if checkpointed else ""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            _step(model, ema_update, optimizer, diffusion, micro_batch, shape, device, autocast_dtype)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            activations = max(0, peak - sum(fixed.values()))
        else:
            with _kept_for_backward(model) as kept:
                _step(model, ema_update, optimizer, diffusion, micro_batch, shape, device, autocast_dtype)
            activations = kept["total"] + (kept["largest_block"] if checkpointed else 0)
            peak = sum(fixed.values()) + activations
            if not checkpointed:
                result["largest_block_gb"] = round(kept["largest_block"] / GB, 3)
        result[f"peak_memory_gb{suffix}"] = round(peak / GB, 3)
        result[f"activations_gb{suffix}"] = round(activations / GB, 3)
    result.update({f"{name}_gb": round(size / GB, 3) for name, size in fixed.items()})
    result["checkpointing_saves"] = round(1 - result["peak_memory_gb_checkpointed"] / result["peak_memory_gb"], 3)
    result["method"] = ("torch.cuda.max_memory_allocated over a training step" if device.type == "cuda" else
                        "counted on CPU: weights, gradients, AdamW state and EMA by their tensors' bytes, activations "
                        "by the bytes kept for the backward pass (plus the largest block's own when checkpointed, "
                        "which its recomputation holds); the sum is an upper bound of the peak")
    return result


def bench_memory(config: str, overrides: list[str], micro_batch: int | None) -> dict[str, Any]:
    cfg = load_model_config(config, overrides, "memory")
    if micro_batch is None:  # the preset's own, else one image (micro_batch auto: what a small GPU runs)
        micro_batch = cfg.micro_batch_for(1) or 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"bench": "memory", "config": config, **measure_step_memory(cfg, micro_batch, device)}
