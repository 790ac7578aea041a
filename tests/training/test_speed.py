"""The speed plan under DDP, on two gloo processes: gradients averaged as one process would (in bf16 with
`train.grad_compression: bf16`), and the cifar10 model's gradients split into buckets whose all-reduce overlaps the
backward pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_groups import end_process_group

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
    model = _smoke_model(cfg)
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
    end_process_group()


def _smoke_model(cfg):
    from raydiff.model.unet import build_model

    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():  # leave the near-zero init: gradients everywhere
        torch.nn.init.normal_(p, std=0.05)
    return model


def _batch(n: int, channels: int = 1, resolution: int = 8):
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, channels, resolution, resolution), dtype=torch.uint8, generator=generator)
    return (images, torch.zeros(n, dtype=torch.bool), torch.randint(0, 1000, (n,), generator=generator),
            torch.randn(n, channels, resolution, resolution, generator=generator))


def _reference_gradients() -> torch.Tensor:
    """One process, the whole batch of 8: the mean loss's gradients."""
    from raydiff.model.diffusion import build_diffusion
    from raydiff.training.step import DenoisingLoss

    cfg = load_config("smoke", check_source=False)
    model = _smoke_model(cfg)
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


def _flat_or_ddp(rank: int, init_file: str, compression: str, channels_last: bool, out: str) -> None:
    import numpy as np
    import torch.distributed as dist

    from raydiff.config import TrainSection
    from raydiff.data.loader import MicroBatch
    from raydiff.model.diffusion import build_diffusion
    from raydiff.training.flat_allreduce import FlatGradients
    from raydiff.training.speed import for_training, plan_speed
    from raydiff.training.step import StepParts, make_optimizer, optimizer_step

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    all_reduces = []  # every dist.all_reduce of this process (DDP's reducer runs its own below Python)
    counted = dist.all_reduce
    dist.all_reduce = lambda *a, **k: all_reduces.append(a[0].dtype) or counted(*a, **k)
    cfg = load_config("smoke", ["model.dropout=0.1"], check_source=False)
    results: dict = {}
    for allreduce in ("ddp", "flat"):
        plan = plan_speed(TrainSection(allreduce=allreduce, grad_compression=compression), cpu, world_size=2)
        model = _smoke_model(cfg)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
        parts = StepParts.build(model, build_diffusion(cfg), optimizer, torch.amp.GradScaler("cpu", enabled=False),
                                device=cpu, autocast_dtype=None, seed=0, flip=True, global_batch=16, world_size=2,
                                grad_clip=1.0, dropout=True, channels_last=channels_last)
        parts.loss = for_training(parts.loss, plan, cpu, world_size=2)
        if plan.allreduce == "flat":
            parts.flat_grads = FlatGradients(list(model.parameters()), world_size=2, compression=compression)
            if rank == 1:  # weights that disagree are rank 0's after the broadcast, as DDP's wrapper makes them
                with torch.no_grad():
                    next(model.parameters()).add_(1.0)
            parts.flat_grads.broadcast_weights()
        all_reduces.clear()
        pointers = set()
        for step in range(3):  # this worker's 8 of each step's 16 images, in two micro-batches
            rng = np.random.default_rng(step)
            images = torch.from_numpy(rng.integers(0, 256, (16, 1, 8, 8), dtype=np.uint8))
            flips = torch.from_numpy(rng.random(16) < 0.5)
            batches = [MicroBatch(images=images[i:i + 4], flips=flips[i:i + 4], position=step * 16 + i,
                                  indices=np.arange(i, i + 4)) for i in (8 * rank, 8 * rank + 4)]
            optimizer_step(parts, batches, lr=1e-3)
            pointers.add(tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in model.parameters()))
        results[allreduce] = {"plan": plan.describe(), "all_reduces": [str(d) for d in all_reduces],
                              "same_grad_buffers": len(pointers) == 1,
                              "weights": [p.detach().flatten().tolist() for p in model.parameters()]}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    end_process_group()


@pytest.mark.parametrize("compression,channels_last", [("none", False), ("bf16", True)])
def test_the_flat_all_reduce_trains_the_weights_ddp_trains(tmp_path, compression, channels_last):
    """`train.allreduce: flat` (the step's own all-reduce, which CUDA graphs can replay around) against DDP on two
    gloo processes, two micro-batches each, three steps: bit-identical weights (DDP's arithmetic: divided by the
    world size, then summed; in bf16 with compression), one all-reduce per step (none after the first
    micro-batch), and the gradients in the same buffer every step, laid out like the parameters (NHWC too). Like
    DDP's wrapper, the flat all-reduce starts every worker from rank 0's weights."""
    out = tmp_path / "rank0.json"
    torch.multiprocessing.spawn(_flat_or_ddp, args=(str(tmp_path / "init"), compression, channels_last, str(out)),
                                nprocs=2)
    result = json.loads(out.read_text())
    ddp, flat = result["ddp"], result["flat"]
    assert "all-reduce ddp" in ddp["plan"] and "all-reduce flat" in flat["plan"]
    assert flat["all_reduces"] == ["torch.bfloat16" if compression == "bf16" else "torch.float32"] * 3
    assert flat["same_grad_buffers"]
    for i, (a, b) in enumerate(zip(ddp["weights"], flat["weights"], strict=True)):
        assert a == b, f"parameter {i} differs"


def _resumed_on_three(rank: int, init_file: str, out: str) -> None:
    """Rank `rank` of three CPU workers under `train.allreduce: auto`: 4 steps straight through, and 2 steps, a
    checkpoint, a fresh start restored from it (then wrapped, as a worker's set-up does) and the 2 steps left."""
    import io

    import numpy as np
    import torch.distributed as dist

    from raydiff.config.learning_rate import lr_at
    from raydiff.data.loader import BatchStream, ImageTable
    from raydiff.data.order import SampleOrder, rank_share
    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.weight_averages import EmaUpdater, ema_decay_at, make_ema
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state, restore
    from raydiff.training.flat_allreduce import FlatGradients
    from raydiff.training.speed import for_training, plan_speed
    from raydiff.training.step import StepParts, make_optimizer, optimizer_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    cfg, cpu = load_config("smoke", ["scaling.num_workers=3"], check_source=False), torch.device("cpu")
    t = cfg.train
    plan = plan_speed(t, cpu, world_size=3)
    table = ImageTable([np.random.default_rng(0).integers(0, 256, (60, 1, 8, 8), dtype=np.uint8)])

    def start(saved=None):
        model = _smoke_model(cfg)
        ema, optimizer = make_ema(model), make_optimizer(model, lr=t.lr, weight_decay=t.weight_decay)
        state = TrainingState(model, ema, optimizer, torch.amp.GradScaler("cpu", enabled=False))
        progress = restore(saved, state)[0] if saved is not None else Progress()
        parts = StepParts.build(model, build_diffusion(cfg), optimizer, state.scaler, device=cpu,
                                autocast_dtype=None, seed=t.seed, flip=True, global_batch=16, world_size=3,
                                grad_clip=t.grad_clip, dropout=False)
        parts.loss = for_training(parts.loss, plan, cpu, world_size=3)
        if plan.allreduce == "flat":
            parts.flat_grads = FlatGradients(list(model.parameters()), world_size=3, compression="none")
        return state, progress, parts, EmaUpdater(ema, model)

    def train(state, progress, parts, ema, until):
        stream = BatchStream(table=table, order=SampleOrder(60, t.seed), global_batch=16,
                             share=rank_share(16, 3, rank), micro_batch=16, start_step=progress.stream_step,
                             pin_memory=False, noise=(t.seed, cfg.diffusion.timesteps))
        while progress.step < until:
            optimizer_step(parts, next(stream), lr=lr_at(progress.step, t), ema=ema,
                           ema_decay=ema_decay_at(progress.step, t.ema_decay, t.ema_warmup_steps),
                           step=progress.step + 1)
            progress.step += 1
        stream.close()
        return state

    straight = train(*start(), until=4)
    first = start()
    train(*first, until=2)
    saved = io.BytesIO()
    torch.save(checkpoint_state(first[0], first[1], 16, cfg.to_dict()), saved)
    saved.seek(0)
    resumed = train(*start(torch.load(saved, weights_only=True)), until=4)
    differing = sum(int((a != b).sum()) for a, b in zip(straight.model.state_dict().values(),
                                                         resumed.model.state_dict().values(), strict=True))
    if rank == 0:
        Path(out).write_text(json.dumps({"plan": plan.describe(), "differing": differing}))
    end_process_group()


def test_a_run_resumed_on_three_cpu_workers_ends_with_the_uninterrupted_weights(tmp_path):
    """DDP's first step after each start all-reduces in its first-iteration bucket layout and later steps in the
    layout it rebuilds; with three or more gloo workers the sums then round otherwise, and a resumed run's weights
    differed from the uninterrupted run's (40,160 of the smoke model's 176,849). `auto` takes the flat all-reduce
    on CPUs with three or more workers: exact."""
    out = tmp_path / "rank0.json"
    torch.multiprocessing.spawn(_resumed_on_three, args=(str(tmp_path / "init"), str(out)), nprocs=3)
    result = json.loads(out.read_text())
    assert "all-reduce flat" in result["plan"] and result["differing"] == 0


def test_each_micro_batch_size_compiles_a_static_graph_of_its_own():
    """Three batch sizes in one process, three static graphs: torch's default makes the batch size symbolic at
    the second (slower kernels for all; a compiled backward then failed at a third size in a bench process)."""
    from raydiff.training.speed import compiled

    graphs: list[list[torch.Tensor]] = []

    def backend(graph, example_inputs):  # records what dynamo hands a backend, runs the graph as it is
        graphs.append(example_inputs)
        return graph.forward

    torch._dynamo.reset()
    try:
        module = compiled(torch.nn.Linear(4, 2), backend, fallback=False)
        for size in (16, 64, 32):
            assert module(torch.randn(size, 4)).shape == (size, 2)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 3
    assert not any(isinstance(x, torch.SymInt) for inputs in graphs for x in inputs)
