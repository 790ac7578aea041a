"""Sample quality during training (`eval.every`, `eval.at_end`), and the EMA's drift from the online weights.

Every worker generates its part of the images (chunk c goes to worker c mod W) from the EMA weights in fp32;
the feature sums are added over the workers with one all-reduce, so the images and, up to float64 summation
order, the result are those of `python -m raydiff.evaluate` with the same settings. A class-conditional run's
images are asked for classes drawn in the training data's class frequencies, as the command draws them, and
generated with `eval.guidance`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raydiff.quality.features import Features
from raydiff.quality.measure import SampleJob, chunks, class_targets, empty_stats, sample_stats, scores, total
from raydiff.quality.reference_stats import Reference
from raydiff.training.distributed import from_rank_zero, in_a_group


@dataclass
class InRunQuality:
    """What the driver prepares once per run: the feature network and the reference statistics; for a
    class-conditional run also its classes (`state["classes"]`: names, and training images per class)."""

    features: Features
    reference: Reference
    class_names: tuple[str, ...] | None = None
    class_counts: tuple[int, ...] | None = None  # None: an unconditional run


@torch.no_grad()
def evaluate_in_run(quality: InRunQuality, ema: torch.nn.Module, diffusion, cfg, rank: int, world_size: int,
                    device: torch.device, batch: int | None = None) -> dict[str, Any]:
    """The quality metrics of the EMA weights now (a collective: every worker calls it), generating at most
    `batch` images per forward pass. Returns the metrics on every worker."""
    e, d = cfg.eval, cfg.data
    keep = "kid" in e.metrics
    job = SampleJob(model=ema, diffusion=diffusion, shape=(d.channels, d.resolution, d.resolution),
                    sampler=e.sampler, steps=e.steps, seed=e.seed, batch=batch, class_counts=quality.class_counts,
                    guidance=e.guidance, class_targets=class_targets(quality.features, quality.class_names,
                                                              quality.class_counts))
    mine = chunks(e.num)[rank::world_size]
    parts = sample_stats(job, quality.features, mine, device, keep) if mine else []
    dim = len(quality.reference.mu)
    stats = total(parts) if parts else empty_stats(quality.features, keep, dim)
    if in_a_group():
        box = stats.packed().to(device)
        dist.all_reduce(box)
        gathered: list[Any] = [None] * world_size
        if keep:
            dist.all_gather_object(gathered, stats.features)
        stats = stats.unpacked(box)
        if keep:  # in chunk order, as the command keeps them: KID's subsets are drawn by position
            stats.features = [gathered[c % world_size][c // world_size] for c in range(len(chunks(e.num)))]
    result = scores(stats, quality.reference, quality.features, e.metrics, seed=e.seed) if rank == 0 else None
    return from_rank_zero(result)


@torch.no_grad()
def ema_drift(ema: torch.nn.Module, model: torch.nn.Module) -> float:
    """||ema - online|| / ||online|| over all parameters: how far the average lags the weights being trained."""
    online = [p.detach().float() for p in model.parameters()]
    averaged = [p.detach().float() for p in ema.parameters()]
    diff = torch._foreach_sub(averaged, online)
    num = torch.stack(torch._foreach_norm(diff)).norm()
    den = torch.stack(torch._foreach_norm(online)).norm()
    return float(num / den.clamp(min=1e-12))
