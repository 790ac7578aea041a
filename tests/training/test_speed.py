"""The speed plan under DDP, on two gloo processes: gradients averaged as one process would (in bf16 with
`train.grad_compression: bf16`), and the cifar10 model's gradients split into buckets whose all-reduce overlaps the
backward pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raydiff.config import load_config


def _worker(rank: int, init_file: str, compression: str, out: str) -> None:
    import torch.distributed as dist

    from raydiff.config import TrainSection
    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.unet import build_model
    from raydiff.training.speed import for_training, plan_speed
    from raydiff.training.step import DenoisingLoss

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    plan = plan_speed(TrainSection(grad_compression=compression), cpu, world_size=2)
    results: dict = {"plan": plan.describe()}

    # The smoke model: this worker's half of a batch of 8, scaled as the step scales it (sum x world / global).
    cfg = load_config("smoke", check_source=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():  # leave the near-zero init: gradients everywhere
        torch.nn.init.normal_(p, std=0.05)
    loss = for_training(DenoisingLoss(model, build_diffusion(cfg), device=cpu, flip=False), plan, cpu, world_size=2)
    images, flips, timesteps, noise = _batch(8)
    mine = slice(4 * rank, 4 * rank + 4)
    (loss(images[mine], flips[mine], timesteps[mine], noise[mine]).sum() * 2 / 8).backward()
    results["grads"] = [p.grad.flatten().tolist() for p in model.parameters()]

    # The cifar10 model: its gradient buckets once DDP has seen the order they become ready in (after a step).
    cifar = load_config("cifar10", check_source=False)
    big = build_model(cifar)
    wrapped = for_training(DenoisingLoss(big, build_diffusion(cifar), device=cpu, flip=False), plan, cpu, world_size=2)
    for _ in range(3):
        wrapped(*(x[:1] for x in _batch(1, channels=3, resolution=32))).sum().backward()
    logged = wrapped._get_ddp_logging_data()
    results["buckets"] = [int(b) for b in logged["rebuilt_bucket_sizes"].split(",")]
    results["comm_hook"] = logged.get("comm_hook")
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _batch(n: int, channels: int = 1, resolution: int = 8):
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, channels, resolution, resolution), dtype=torch.uint8, generator=generator)
    return (images, torch.zeros(n, dtype=torch.bool), torch.randint(0, 1000, (n,), generator=generator),
            torch.randn(n, channels, resolution, resolution, generator=generator))


def _reference_gradients() -> torch.Tensor:
    """One process, the whole batch of 8: the mean loss's gradients."""
    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.unet import build_model
    from raydiff.training.step import DenoisingLoss

    cfg = load_config("smoke", check_source=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    loss = DenoisingLoss(model, build_diffusion(cfg), device=torch.device("cpu"), flip=False)
    (loss(*_batch(8)).sum() / 8).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("compression,tolerance", [("none", 1e-5), ("bf16", 1e-2)])
def test_ddp_averages_the_gradients_of_the_global_batch_in_overlapping_buckets(tmp_path, compression, tolerance):
    out = tmp_path / "rank0.json"
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "init"), compression, str(out)), nprocs=2)
    result = json.loads(out.read_text())
    averaged = torch.tensor([g for grads in result["grads"] for g in grads])
    reference = _reference_gradients()
    assert (averaged - reference).norm() / reference.norm() < tolerance
    assert f"gradient compression {compression}" in result["plan"]
    assert result["comm_hook"] == ("bf16_compress_hook" if compression == "bf16" else None)
    # 143 MB of fp32 gradients in DDP's 25 MB buckets, the first (the last layers', ready first) small: its
    # all-reduce starts while the backward pass is still computing the earlier layers.
    buckets = result["buckets"]
    assert sum(buckets) == 35_746_307 * 4 and len(buckets) >= 5 and buckets[0] < 4 * 2**20
