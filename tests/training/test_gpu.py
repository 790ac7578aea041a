"""The training step on a CUDA GPU: bf16 and fp16 autocast, the fp16 loss scaler, no host sync in the steady
state, torch.compile, channels_last, micro_batch=auto and pinned host buffers. Skipped where there is no GPU
(CI); run them on a GPU machine with `pytest -m gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raydiff.config import load_config
from raydiff.data.loader import BatchStream, ImageTable
from raydiff.data.noise import position_noise
from raydiff.data.on_device import DeviceBatchStream, DeviceImages, place_images
from raydiff.data.order import SampleOrder, rank_share
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.model.weight_averages import EmaUpdater, make_ema
from raydiff.training.flat_allreduce import FlatGradients
from raydiff.training.microbatch import measure_micro_batch
from raydiff.training.speed import SpeedPlan, for_training, unwrap
from raydiff.training.step import StepParts, StepResult, make_optimizer, optimizer_step
from raydiff.training.window import MetricsWindow, NonFiniteSteps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GLOBAL_BATCH = 16


@pytest.fixture(autouse=True)
def _compiled_afresh():
    """Each test compiles `DenoisingLoss.forward` in a setting of its own (dtype, layout, dropout, CUDA graphs), and
    torch keeps every compiled version on the function's code: past `recompile_limit` (8) it runs the function
    eagerly, so in one process (`pytest -m gpu` without -n) the last compiled tests would test the eager step."""
    torch._dynamo.reset()


def _setup(precision: str = "fp32", *, channels_last: bool = False, dropout: float = 0.0):
    cfg = load_config("smoke", [f"model.dropout={dropout}"])
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():  # leave the near-zero init: gradients everywhere
        torch.nn.init.normal_(p, std=0.05)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    dtype = DTYPES[precision]
    inputs = StepParts.build(model, build_diffusion(cfg), make_optimizer(model, lr=1e-3, weight_decay=0.0),
                              torch.amp.GradScaler("cuda", enabled=dtype == torch.float16), device=device,
                              autocast_dtype=dtype, seed=0, flip=True, global_batch=GLOBAL_BATCH, world_size=1,
                              grad_clip=1.0, dropout=dropout > 0, channels_last=channels_last)
    ema = make_ema(model)
    return inputs, ema, EmaUpdater(ema, model), cfg


def _apply(inputs: StepParts, *, compile_model: bool, cuda_graphs: bool = False, channels_last: bool = False,
           ddp: bool = False) -> None:
    """The step's loss as a worker runs it under this plan: one worker (no DDP), or `ddp` as one of several
    (DDP with bf16 gradient compression, in whatever process group is initialised)."""
    plan = SpeedPlan(compile=compile_model, compile_fallback=False, channels_last=channels_last,
                     cuda_graphs=cuda_graphs, tf32=True, grad_compression="bf16" if ddp else "none",
                     allreduce="ddp" if ddp else "none")
    inputs.loss = for_training(inputs.loss, plan, inputs.device, world_size=2 if ddp else 1)
    inputs.cuda_graphs = cuda_graphs


def _stream(cfg, micro_batch: int = 8) -> BatchStream:
    """The loop's own loader: pinned host buffers, noise drawn ahead on its thread."""
    images = np.random.default_rng(0).integers(0, 256, (64, 1, 8, 8), dtype=np.uint8)
    return BatchStream(table=ImageTable([images]), order=SampleOrder(64, seed=0), global_batch=GLOBAL_BATCH,
                       share=rank_share(GLOBAL_BATCH, 1, 0), micro_batch=micro_batch, start_step=0,
                       pin_memory=True, noise=(0, cfg.diffusion.timesteps), device_noise=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_steps_train(precision):
    inputs, _, ema_update, cfg = _setup(precision)
    before = [p.detach().clone() for p in unwrap(inputs.loss).parameters()]
    stream = _stream(cfg)
    try:
        results = [optimizer_step(inputs, next(stream), lr=1e-3, ema=ema_update, ema_decay=0.9) for _ in range(5)]
    finally:
        stream.close()
    assert all(bool(r.finite) for r in results) and all(torch.isfinite(r.loss_sum) for r in results)
    assert any(not torch.equal(a, b) for a, b in zip(before, unwrap(inputs.loss).parameters(), strict=True))
    assert inputs.scaler.is_enabled() == (precision == "fp16")
    if precision == "fp16":
        assert inputs.scaler.get_scale() > 0


def test_fp16_non_finite_step_is_skipped_and_the_scale_backs_off():
    inputs, _, ema_update, cfg = _setup("fp16")
    stream = _stream(cfg)
    try:
        optimizer_step(inputs, next(stream), lr=1e-3, ema=ema_update, ema_decay=0.5)
        weights = {k: v.clone() for k, v in unwrap(inputs.loss).state_dict().items()}
        scale = inputs.scaler.get_scale()
        result = optimizer_step(inputs, next(stream), lr=1e-3, ema=ema_update, ema_decay=0.5, fault=lambda b: True)
    finally:
        stream.close()
    assert not bool(result.finite)
    assert all(torch.equal(weights[k], v) for k, v in unwrap(inputs.loss).state_dict().items())
    assert inputs.scaler.get_scale() < scale


@pytest.mark.parametrize("precision,mode", [("fp32", "eager"), ("bf16", "eager"), ("fp16", "eager"),
                                            ("bf16", "compiled"), ("bf16", "compiled_nhwc"), ("bf16", "cuda_graphs")])
def test_the_steady_state_step_never_synchronises(precision, mode):
    """CUDA's sync debug mode raises on any host-device synchronisation inside the steps (with dropout, reseeded
    per micro-batch, as in the cifar10 preset; compiled in NHWC, as raydiff runs on a GPU; with CUDA graphs)."""
    nhwc = mode == "compiled_nhwc"
    inputs, _, ema_update, cfg = _setup(precision, dropout=0.1, channels_last=nhwc)
    _apply(inputs, compile_model=mode != "eager", cuda_graphs=mode == "cuda_graphs", channels_last=nhwc)
    window, nonfinite = MetricsWindow(inputs.device), NonFiniteSteps(inputs.device)
    stream = _stream(cfg)
    try:
        for _ in range(2):  # the optimizer's lazy state, cuDNN's first calls
            optimizer_step(inputs, next(stream), lr=1e-3, ema=ema_update, ema_decay=0.9)
        batches = [next(stream) for _ in range(3)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step_batches in batches:
                result = optimizer_step(inputs, step_batches, lr=1e-3, ema=ema_update, ema_decay=0.9)
                window.add(result, 0.0)
                nonfinite.add(result.finite)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        stream.close()
    assert nonfinite.skipped_steps() == 0


@pytest.mark.parametrize("mode", ["eager", "compiled", "cuda_graphs"])
def test_dropout_on_the_gpu_is_a_function_of_the_stream_position(mode):
    """The step seeds the generator CUDA dropout draws from (compiled dropout too): the same micro-batches give the
    same gradients whatever was drawn before, and unseeded they do not. The gradient of a residual block's second
    convolution, whose input is the dropout's output, is compared: another mask changes it everywhere, far beyond
    the rounding that separates two runs of the same mask (a summed loss hides the masks' difference)."""
    inputs, _, _, cfg = _setup(dropout=0.5)
    _apply(inputs, compile_model=mode != "eager", cuda_graphs=mode == "cuda_graphs")
    stream = _stream(cfg)
    try:
        batches = next(stream)
    finally:
        stream.close()
    watched = unwrap(inputs.loss).model.down[0][0].conv2.weight
    grads: list[torch.Tensor] = []
    watched.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad.detach().clone()))

    def gradient() -> torch.Tensor:
        grads.clear()
        torch.rand(4096, device="cuda")  # other draws from the device's generator in between
        optimizer_step(inputs, batches, lr=0.0)  # lr 0: the weights stay
        return grads[-1]  # accumulated over the step's micro-batches

    first, second = gradient(), gradient()
    inputs.dropout = False
    unseeded = gradient()
    rounding = (first - second).abs().max()
    assert rounding <= 1e-5 * first.abs().max()
    assert (first - unseeded).abs().mean() > 0.1 * first.abs().mean()


def _three_steps(*, compile_model: bool, channels_last: bool, cuda_graphs: bool, flat: bool = False,
                 ddp: bool = False):
    """Three steps of two micro-batches each under this plan: the losses, and how far each weight moved."""
    inputs, _, ema_update, cfg = _setup("fp32", channels_last=channels_last)
    start = [p.detach().clone() for p in unwrap(inputs.loss).parameters()]
    _apply(inputs, compile_model=compile_model, cuda_graphs=cuda_graphs, channels_last=channels_last, ddp=ddp)
    if flat:
        inputs.flat_grads = FlatGradients(list(unwrap(inputs.loss).parameters()), world_size=1, compression="none")
    stream = _stream(cfg)
    try:
        losses = [float(optimizer_step(inputs, next(stream), lr=1e-3, ema=ema_update, ema_decay=0.9).loss_sum)
                  for _ in range(3)]
    finally:
        stream.close()
    moved = torch.cat([(p.detach() - p0).flatten()
                       for p, p0 in zip(unwrap(inputs.loss).parameters(), start, strict=True)])
    return losses, moved


def _three_steps_in_a_one_process_nccl_group(tmp_path, **plan):
    """`_three_steps` as one worker of several runs it: in a process group (of one), over NCCL."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        return _three_steps(**plan)
    finally:
        dist.destroy_process_group()


def _assert_same_steps(losses: list[float], moved: torch.Tensor, eager_losses: list[float], eager_moved: torch.Tensor,
                       name: str) -> None:
    # TF32 convolutions and fused kernels change the last bits, not the steps; a gradient lost or counted twice
    # turns a large share of Adam's updates (about +-lr each) the other way.
    assert losses == pytest.approx(eager_losses, rel=1e-2), name
    assert (moved - eager_moved).abs().mean() < 0.1 * eager_moved.abs().mean(), name


@pytest.mark.parametrize("name, compile_model, channels_last, cuda_graphs", [
    ("compiled", True, False, False), ("channels_last", False, True, False), ("compiled_nhwc", True, True, False),
    ("cuda_graphs", True, False, True)], ids=["compiled", "channels_last", "compiled_nhwc", "cuda_graphs"])
def test_compiled_channels_last_and_cuda_graph_steps_match_eager(name, compile_model, channels_last, cuda_graphs):
    """Each way of running the step trains the same steps, two micro-batches each (under CUDA graphs their
    gradients must be summed outside the graphs' memory): the same losses, and weights that moved as eager's did.
    One test each: each compiles (its own process's time under `.ci/gpu`'s per-test limit)."""
    eager = _three_steps(compile_model=False, channels_last=False, cuda_graphs=False)
    _assert_same_steps(*_three_steps(compile_model=compile_model, channels_last=channels_last,
                                     cuda_graphs=cuda_graphs), *eager, name)


def test_the_flat_all_reduce_under_cuda_graphs_trains_as_eager(tmp_path):
    """`train.allreduce: flat` as several workers on one node run it, in a one-process NCCL group: compiled, NHWC,
    CUDA graphs, two micro-batches summed into the flat buffer's NHWC views, then its all-reduce, outside the
    graphs. The same losses, and weights that moved as eager's did."""
    eager = _three_steps(compile_model=False, channels_last=False, cuda_graphs=False)
    flat = _three_steps_in_a_one_process_nccl_group(tmp_path, compile_model=True, channels_last=True,
                                                    cuda_graphs=True, flat=True)
    _assert_same_steps(*flat, *eager, "flat all-reduce, CUDA graphs, NHWC")


def test_compiled_ddp_with_bf16_gradients_trains_as_eager(tmp_path):
    """DDP under torch.compile, as several workers run it without the flat all-reduce (across nodes, and the
    one-GPU-per-node presets), in a one-process NCCL group: that inductor, NHWC, DDP's bf16 comm hook and no_sync
    over two micro-batches compile and run on a GPU, and train as eager does (the same losses, weights that moved
    alike: bf16 rounds the gradients, not the steps). The smoke model fits DDP's first bucket, so dynamo's split of
    the graph at bucket boundaries (DDPOptimizer, which a full-size model meets) is not exercised here. With one
    process an all-reduce changes nothing, so what DDP sums across workers, and when, is the CPU suite's to check
    (two gloo processes, eager)."""
    eager = _three_steps(compile_model=False, channels_last=False, cuda_graphs=False)
    ddp = _three_steps_in_a_one_process_nccl_group(tmp_path, compile_model=True, channels_last=True,
                                                   cuda_graphs=False, ddp=True)
    _assert_same_steps(*ddp, *eager, "compiled DDP, bf16 gradients, NHWC")


def test_a_windows_rate_counts_the_gpus_time_to_finish_its_steps():
    """The host issues a window's steps long before the GPU has done them: the row's img/s is that of work done
    on the device (here a step followed by about half a second of GPU work, issued in microseconds)."""
    cuda = torch.device("cuda")
    losses = torch.ones(8, device=cuda)
    step = StepResult(finite=torch.tensor(True, device=cuda), grad_norm=torch.tensor(1.0, device=cuda),
                      loss_sum=losses.sum(), samples=8, quarter_sums=torch.ones((2, 4), device=cuda),
                      images=torch.zeros(1, dtype=torch.uint8, device=cuda), timesteps=torch.zeros(1, device=cuda),
                      losses=losses)
    torch.cuda.synchronize()
    window = MetricsWindow(cuda)
    window.add(step, 0.0)
    started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started.record()
    torch.cuda._sleep(1_000_000_000)  # GPU clock cycles
    ended.record()
    row = window.close(step=1, global_batch=8, lr=1e-3, ema_decay=0.9, world_size=1, skipped_steps=0)
    device_s = started.elapsed_time(ended) / 1e3
    assert device_s > 0.1 and row["images_per_s"] <= 8 / device_s


def test_a_profile_of_compiled_steps_replayed_as_cuda_graphs_counts_their_kernels():
    """`log.profile_steps` on a GPU: steps replayed as CUDA graphs (after the first, which compiles and records
    them) profiled as the worker profiles them, with the GPU's kernels' time and its busy share of the wall time."""
    import gzip
    import json

    from raydiff.training.profiling import StepProfile

    inputs, _, ema_update, cfg = _setup("bf16", channels_last=True)
    _apply(inputs, compile_model=True, cuda_graphs=True, channels_last=True)
    stream, profile = _stream(cfg, micro_batch=GLOBAL_BATCH), StepProfile(4, 6, torch.device("cuda"))
    try:
        for step in range(1, 7):
            profile.before_step(step)
            optimizer_step(inputs, next(stream), lr=1e-3, ema=ema_update, ema_decay=0.9)
        profiled = profile.end(6)
    finally:
        stream.close()
    figures = profiled.figures
    assert figures["steps"] == [4, 6] and figures["device_ms_per_step"] > 0 and figures["launches_per_step"] > 0
    assert 0 < figures["device_busy"] <= 1.05  # kernels' time against the wall time (streams may overlap a little)
    assert profiled.table.startswith("# raydiff's training loop on rank 0, steps 4-6 on ")
    names = {e.get("name") for e in json.loads(gzip.decompress(profiled.trace_gz))["traceEvents"]}
    assert {"ProfilerStep#4", "ProfilerStep#6", "cudaGraphLaunch"} <= names


def test_micro_batch_auto_measures_what_fits():
    inputs, *_ = _setup("bf16")
    loss = unwrap(inputs.loss)
    chosen = measure_micro_batch(loss.model, loss.diffusion, inputs.optimizer, share=64, shape=(1, 8, 8),
                                 device=inputs.device, autocast_dtype=torch.bfloat16)
    assert chosen == 64  # the smoke model at 8x8 fits whole shares on any GPU
    # The probe's peak is gone: the metrics rows' peak_memory_gb measures training from here.
    assert torch.cuda.max_memory_allocated(inputs.device) == torch.cuda.memory_allocated(inputs.device)


def test_the_ema_update_on_the_gpu_allocates_nothing_and_averages_as_on_a_cpu():
    """On a GPU the EMA is one buffer, lerped towards a copy of the weights kept for it: no allocation per update,
    and the average a CPU's one lerp per tensor gives."""
    inputs, ema, ema_update, _ = _setup("bf16", channels_last=True)
    model = unwrap(inputs.loss).model
    with torch.no_grad():
        for e in ema.parameters():  # an average that lags the weights
            e.mul_(0.5)
    cpu_model = [p.detach().cpu() for p in model.parameters()]
    cpu_ema = [e.detach().cpu() for e in ema.parameters()]
    finite = torch.tensor(True, device="cuda")
    skipped = ~finite
    ema_update(0.9, finite)
    for e, m in zip(cpu_ema, cpu_model, strict=True):
        e.lerp_(m, 0.1)
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(5):
        ema_update(0.9, finite)
        ema_update(0.9, skipped)  # unchanged
        for e, m in zip(cpu_ema, cpu_model, strict=True):
            e.lerp_(m, 0.1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    for e, expected in zip(ema.parameters(), cpu_ema, strict=True):
        torch.testing.assert_close(e.cpu(), expected, rtol=1e-6, atol=1e-6)


def test_loader_buffers_are_pinned_for_asynchronous_copies():
    _, _, _, cfg = _setup()
    stream = _stream(cfg)
    try:
        batches = next(stream)
    finally:
        stream.close()
    assert all(b.images.is_pinned() and b.flips.is_pinned() for b in batches)
    assert all(b.noise is None and b.timesteps is None for b in batches)  # the GPU draws them: nothing to copy


def test_batches_gathered_on_the_gpu_are_the_loader_threads_with_one_small_copy_each_and_no_sync():
    """`data.on_device` (`auto` on a GPU for data this small): the images kept on the GPU and each micro-batch
    gathered there are the loader thread's images, flips and class ids, with one copy from the host per
    micro-batch (its indices, flip bits and class ids); the steps on them never synchronise."""
    cuda = torch.device("cuda")
    inputs, _, ema_update, cfg = _setup("bf16", dropout=0.1)
    images = np.random.default_rng(0).integers(0, 256, (64, 1, 8, 8), dtype=np.uint8)
    table = ImageTable([images[:40], images[40:]], labels=(np.arange(64) % 5).astype(np.int32))
    on_gpu, phrase = place_images("auto", table, cuda)
    assert isinstance(on_gpu, DeviceImages) and phrase == "data on the GPU (0.0 MB)"
    share, order = rank_share(GLOBAL_BATCH, 1, 0), SampleOrder(64, seed=0)
    thread = BatchStream(table=table, order=order, global_batch=GLOBAL_BATCH, share=share, micro_batch=8,
                         start_step=2, pin_memory=True, noise=(0, cfg.diffusion.timesteps), device_noise=True,
                         labels=(0.5, 5))
    gathered = DeviceBatchStream(images=on_gpu, order=order, global_batch=GLOBAL_BATCH, share=share, micro_batch=8,
                                 start_step=2, seed=0, labels=(0.5, 5))
    try:
        with _HostCopies() as copies:
            steps = [next(gathered) for _ in range(3)]
        expected = [next(thread) for _ in range(3)]
    finally:
        thread.close()
    assert copies.count == 3 * 2  # two micro-batches a step
    for got, want in zip(steps, expected, strict=True):
        for g, e in zip(got, want, strict=True):
            assert g.images.device.type == g.flips.device.type == g.labels.device.type == "cuda"
            assert torch.equal(g.images.cpu(), e.images) and torch.equal(g.flips.cpu(), e.flips)
            assert torch.equal(g.labels.cpu(), e.labels) and g.position == e.position

    unconditional = DeviceBatchStream(images=on_gpu, order=order, global_batch=GLOBAL_BATCH, share=share,
                                      micro_batch=8, start_step=0, seed=0)
    for _ in range(2):  # the optimizer's lazy state, cuDNN's first calls
        optimizer_step(inputs, next(unconditional), lr=1e-3, ema=ema_update, ema_decay=0.9)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [optimizer_step(inputs, next(unconditional), lr=1e-3, ema=ema_update, ema_decay=0.9)
                   for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(bool(r.finite) for r in results)


def test_the_gpu_draws_the_noise_as_a_function_of_the_stream_position():
    """On a GPU the step draws timesteps and noise with the GPU's own generator, keyed by (seed, position) as on
    a CPU: the same for a sample whatever the split, standard normal, and without a host-to-GPU copy."""
    cuda = torch.device("cuda")
    t_all, noise_all = position_noise(3, 30, 40, timesteps=1000, shape=(3, 8, 8), device=cuda)
    assert noise_all.device.type == "cuda" and t_all.device.type == "cuda"
    with _HostCopies() as copies:
        for start, count in ((30, 1), (37, 5), (45, 25), (64, 6)):  # inside, across and at block boundaries
            t, noise = position_noise(3, start, count, timesteps=1000, shape=(3, 8, 8), device=cuda)
            part = slice(start - 30, start - 30 + count)
            assert torch.equal(noise, noise_all[part]) and torch.equal(t, t_all[part])
    assert copies.count == 0
    assert abs(noise_all.mean().item()) < 0.1 and abs(noise_all.std().item() - 1) < 0.05
    assert 0 <= t_all.min().item() and t_all.max().item() < 1000
    assert not torch.equal(position_noise(4, 30, 40, timesteps=1000, shape=(3, 8, 8), device=cuda)[1], noise_all)


class _HostCopies(TorchDispatchMode):
    """Counts the copies from host memory to the GPU dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sources = [a for a in args if isinstance(a, torch.Tensor)]
        if (func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_)
                and isinstance(out, torch.Tensor) and out.device.type == "cuda"
                and any(s.device.type == "cpu" and s.numel() > 1 for s in sources)):
            self.count += 1
        return out


@pytest.mark.parametrize("sampler", ["ddim", "ddpm", "dpmpp_2m_sde"])
def test_sampling_draws_its_noise_on_the_gpu(sampler):
    """Sample grids, in-run evaluation and FID generate on the GPU: no noise drawn on the host and copied over at
    every step, so the steps never wait on the host. Two warm calls of 5 and 20 steps copy alike (a first call
    also fills caches, such as the schedule's tables on the device)."""
    from raydiff.seeds import GRID_NOISE, image_generators

    _, ema, _, cfg = _setup()
    diffusion, device = build_diffusion(cfg), torch.device("cuda")

    def host_copies(steps: int) -> int:
        with _HostCopies() as copies:
            images = diffusion.sample(ema, (4, 1, 8, 8), sampler=sampler, steps=steps,
                                      generator=image_generators(0, range(4), device, GRID_NOISE), device=device)
        assert images.device.type == "cuda"
        return copies.count

    host_copies(3)  # warm
    assert host_copies(5) == host_copies(20)  # the step coefficients, once per call


def test_the_memory_bench_measures_the_peak_with_and_without_activation_checkpointing():
    """On CUDA `bench memory` reads torch's peak allocated memory: at 256x256 (a narrow model) checkpointing
    lowers it, and the peak holds at least the weights, gradients, AdamW state and EMA."""
    from raydiff.bench.memory import measure_step_memory

    cfg = load_config("celebahq256", ["model.base_channels=32", "model.norm_groups=8"], check_source=False)
    result = measure_step_memory(cfg, 2, torch.device("cuda"))
    fixed = sum(result[f"{part}_gb"] for part in ("weights", "gradients", "optimizer", "ema"))
    assert fixed <= result["peak_memory_gb_checkpointed"] < result["peak_memory_gb"]
    assert "max_memory_allocated" in result["method"]
