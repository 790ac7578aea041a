"""One optimizer step: no host sync, device-side skipping of non-finite steps, and the EMA weighted by it."""

from __future__ import annotations

import dataclasses
import traceback

import numpy as np
import pytest
import torch
from gloo_groups import end_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from raydiff.config import TrainSection, load_config
from raydiff.data.loader import MicroBatch
from raydiff.data.noise import position_noise
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.model.weight_averages import EmaUpdater, PowerEma, exponent_of, make_ema
from raydiff.training import speed
from raydiff.training.flat_allreduce import FlatGradients
from raydiff.training.speed import compiled, for_training, plan_speed, set_compile_threads, unwrap
from raydiff.training.step import DenoisingLoss, StepParts, make_optimizer, optimizer_step
from raydiff.training.window import MetricsWindow, NonFiniteSteps

SYNC_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy")
# What waits for a GPU below Python: a value read back (also a tensor passed where an op takes a number, such as
# lerp's weight) or an output whose size depends on the data (torch.unique dispatches as _unique2 or unique_dim).
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique", "_unique2",
            "unique_dim", "unique_consecutive")


class DeviceReads(TorchDispatchMode):
    """Records the operators that would make the host wait for a GPU, with the line of raydiff that ran them."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name == "index" and _has_bool_index(args)):  # x[mask] sizes its output by the mask
            self.reads.append(f"{func} at {_raydiff_caller()}")
        return func(*args, **(kwargs or {}))


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _raydiff_caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/raydiff/" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _setup(precision_fp16: bool = False):
    cfg = load_config("smoke", ["model.dropout=0.1"])
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():  # leave the near-zero init: gradients everywhere
        torch.nn.init.normal_(p, std=0.05)
    inputs = StepParts.build(model, build_diffusion(cfg), make_optimizer(model, lr=1e-3, weight_decay=0.0),
                              torch.amp.GradScaler("cpu", enabled=precision_fp16), device=torch.device("cpu"),
                              autocast_dtype=torch.float16 if precision_fp16 else None, seed=0, flip=True,
                              global_batch=8, world_size=1, grad_clip=1.0, dropout=True)
    ema = make_ema(model)
    return inputs, ema, EmaUpdater(ema, model)


def _batches(step: int) -> list[MicroBatch]:
    rng = np.random.default_rng(step)
    images = torch.from_numpy(rng.integers(0, 256, (8, 1, 8, 8), dtype=np.uint8))
    flips = torch.from_numpy(rng.random(8) < 0.5)
    return [MicroBatch(images=images[:4], flips=flips[:4], position=step * 8, indices=np.arange(4)),
            MicroBatch(images=images[4:], flips=flips[4:], position=step * 8 + 4, indices=np.arange(4, 8))]


@pytest.fixture
def flat_allreduce(tmp_path):
    """`with_flat(inputs)`: the step under `train.allreduce: flat`, in a one-process gloo group (left after)."""
    import torch.distributed as dist

    def with_flat(inputs: StepParts) -> StepParts:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
        inputs.flat_grads = FlatGradients([p for g in inputs.optimizer.param_groups for p in g["params"]],
                                          world_size=1, compression="none")
        return inputs
    yield with_flat
    if dist.is_initialized():
        end_process_group()


@pytest.mark.parametrize("fp16,flat", [(False, False), (True, False), (False, True)])
def test_the_steady_state_step_never_reads_a_device_value(monkeypatch, flat_allreduce, fp16, flat):
    inputs, _, ema_update = _setup(fp16)
    if flat:
        flat_allreduce(inputs)
    window, nonfinite = MetricsWindow(inputs.device), NonFiniteSteps(inputs.device)
    optimizer_step(inputs, _batches(0), lr=1e-3, ema=ema_update, ema_decay=0.9)  # the optimizer's lazy state
    calls: list[str] = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    # Nor reseeds every generator per micro-batch: dropout's own is seeded by stream position.
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append("manual_seed"))
    with DeviceReads() as device_reads:
        for step in range(1, 4):
            result = optimizer_step(inputs, _batches(step), lr=1e-3, ema=ema_update, ema_decay=0.9)
            window.add(result, 0.0)
            nonfinite.add(result.finite)
    assert calls == [] and device_reads.reads == []
    monkeypatch.undo()
    assert nonfinite.skipped_steps() == 0 and window.close(step=4, global_batch=8, lr=1e-3, ema_decay=0.9,
                                                            world_size=1, skipped_steps=0)["loss"] > 0


@pytest.mark.parametrize("fp16,flat", [(False, False), (True, False), (False, True)])
def test_a_non_finite_step_changes_nothing_and_is_counted(flat_allreduce, fp16, flat):
    inputs, ema, ema_update = _setup(fp16)
    if flat:
        flat_allreduce(inputs)
    optimizer_step(inputs, _batches(0), lr=1e-3, ema=ema_update, ema_decay=0.5)
    model_before = {k: v.clone() for k, v in unwrap(inputs.loss).model.state_dict().items()}
    ema_before = {k: v.clone() for k, v in ema.state_dict().items()}
    moments_before = [s["exp_avg"].clone() for s in inputs.optimizer.state.values()]
    nonfinite = NonFiniteSteps(inputs.device)
    for step in (1, 2):
        result = optimizer_step(inputs, _batches(step), lr=1e-3, ema=ema_update, ema_decay=0.5,
                                fault=lambda batch: batch.position % 8 == 4)
        nonfinite.add(result.finite)
        assert not bool(result.finite)
    assert all(torch.equal(model_before[k], v) for k, v in unwrap(inputs.loss).model.state_dict().items())
    assert all(torch.equal(ema_before[k], v) for k, v in ema.state_dict().items())
    moments_after = [s["exp_avg"] for s in inputs.optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(moments_before, moments_after, strict=True))
    assert nonfinite.skipped_steps() == 2 and nonfinite.longest_streak() == 2

    result = optimizer_step(inputs, _batches(3), lr=1e-3, ema=ema_update, ema_decay=0.5)
    nonfinite.add(result.finite)
    assert bool(result.finite) and not torch.equal(model_before["conv_in.weight"],
                                                   unwrap(inputs.loss).model.conv_in.weight)
    assert nonfinite.longest_streak() == 2  # the streak was still running at the last read
    assert nonfinite.longest_streak() == 0  # and ended since


class _HugeGradients(torch.nn.Module):
    """A loss whose gradients are finite, element by element, and whose norm is not (beyond float32's range)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, images, flips, timesteps, noise, labels=None):
        return self.w.sum() * 5e17 * images.float().mean(dim=(1, 2, 3)) + 0 * noise.sum()


def test_a_skipped_step_still_counts_in_the_post_hoc_averages():
    """The post-hoc averages take a skipped step's unchanged weights in: their rebuild (`raydiff.ema`) holds each
    to the power-function profile t^gamma over every step, which an average that left steps out would not have."""
    inputs, _, ema_update = _setup()
    model = unwrap(inputs.loss).model
    tracker = PowerEma(model, [0.05], staged_by=ema_update)
    seen = []
    steps, skipped = range(1, 31), (20, 21)  # skipped late: early in a run the average is the newest weights
    for step in steps:
        result = optimizer_step(inputs, _batches(step), lr=1e-2, ema=ema_update, ema_decay=0.5, posthoc=tracker,
                                step=step, fault=(lambda batch: True) if step in skipped else None)
        assert bool(result.finite) == (step not in skipped)
        seen.append(model.conv_in.weight.detach().double().clone())
    assert torch.equal(seen[18], seen[20]) and not torch.equal(seen[17], seen[18])  # skipped steps changed nothing
    g = exponent_of(0.05)
    shares = [(i ** (g + 1) - (i - 1) ** (g + 1)) / len(steps) ** (g + 1) for i in steps]
    expected = sum(share * weights for share, weights in zip(shares, seen, strict=True))
    torch.testing.assert_close(tracker.profiles[0].conv_in.weight.double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_a_step_whose_gradient_norm_overflows_changes_nothing_in_fp16_too(fp16, grad_clip):
    """fp16's scaler checks the gradients' elements only: the step's own verdict (the norm) must decide."""
    model = _HugeGradients()
    optimizer = make_optimizer(model, lr=0.1, weight_decay=0.1)
    inputs = StepParts(loss=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", enabled=fp16),
                       device=torch.device("cpu"), seed=0, global_batch=4, world_size=1, grad_clip=grad_clip,
                       timesteps=1000, dropout=False)
    batch = MicroBatch(images=torch.full((4, 1, 2, 2), 200, dtype=torch.uint8), flips=torch.zeros(4, dtype=torch.bool),
                       position=0, indices=np.arange(4))
    result = optimizer_step(inputs, [batch], lr=0.1)
    assert not bool(result.finite)
    assert torch.equal(model.w.detach(), torch.ones(4))  # neither NaN (no clipping) nor decayed (clipped to zero)
    assert all(float(state["step"]) == 0 for state in optimizer.state.values())


def test_a_step_is_a_function_of_its_stream_positions():
    """The same micro-batches give the same update, whatever else ran before (noise and dropout keyed by position)."""
    a, _, _ = _setup()
    b, _, _ = _setup()
    optimizer_step(b, _batches(7), lr=0.0)  # lr 0: b's weights unchanged, but its random streams advanced
    ra, rb = (optimizer_step(x, _batches(1), lr=1e-3) for x in (a, b))
    assert torch.equal(ra.loss_sum, rb.loss_sum)


def test_under_cuda_graphs_gradients_of_several_micro_batches_accumulate_in_buffers_of_their_own():
    """A CUDA-graph replay overwrites the previous replay's outputs, so the gradients summed over micro-batches live
    in buffers the graphs do not own: allocated before the first backward, zeroed (not freed) after each step,
    the same buffers every step; the update is exactly the one without (checked on the CPU: same arithmetic)."""
    plain, _, _ = _setup()
    graphs, _, _ = _setup()
    graphs.cuda_graphs = True  # the step's bookkeeping for graphs; the loss itself stays eager on a CPU
    params = [p for g in graphs.optimizer.param_groups for p in g["params"]]
    buffers = None
    for step in range(3):
        a = optimizer_step(plain, _batches(step), lr=1e-3)
        b = optimizer_step(graphs, _batches(step), lr=1e-3)
        assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(a.grad_norm, b.grad_norm)
        assert all(p.grad is not None and not p.grad.any() for p in params)
        pointers = [p.grad.data_ptr() for p in params]
        assert buffers is None or pointers == buffers
        buffers = pointers
    assert all(p.grad is None for g in plain.optimizer.param_groups for p in g["params"])
    for p, q in zip(unwrap(plain.loss).parameters(), unwrap(graphs.loss).parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_compiled_model_trains_the_same_step():
    """train.compile with a CPU backend: the compiled model computes the same losses and update as eager."""
    eager, _, _ = _setup()
    compiled_inputs, _, _ = _setup()
    compiled_inputs.loss = compiled(compiled_inputs.loss, "aot_eager", fallback=False)
    for step in range(2):
        a = optimizer_step(eager, _batches(step), lr=1e-3)
        b = optimizer_step(compiled_inputs, _batches(step), lr=1e-3)
        assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-5) and torch.allclose(a.grad_norm, b.grad_norm, rtol=1e-4)
    bare = unwrap(compiled_inputs.loss).model
    for (name, p), q in zip(unwrap(eager.loss).model.named_parameters(), bare.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


def test_the_speed_plan_per_device_and_world_size():
    """auto: compiled, channels_last and CUDA graphs on CUDA (NHWC is faster only compiled; CUDA graphs never under
    DDP, so several workers on one node all-reduce flat, and across nodes keep DDP's overlap), eager NCHW on CPUs;
    gradient compression only where there is an all-reduce."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    auto = TrainSection()
    on_cpu, on_gpu = plan_speed(auto, cpu, 1), plan_speed(auto, gpu, 1)
    assert (on_cpu.compile, on_cpu.channels_last, on_cpu.cuda_graphs, on_cpu.tf32) == (False, False, False, False)
    assert (on_gpu.compile, on_gpu.channels_last, on_gpu.cuda_graphs, on_gpu.tf32) == (True, True, True, True)
    assert on_gpu.compile_fallback
    assert on_gpu.compile_options == {"triton.cudagraphs": True, "force_layout_optimization": True}
    assert "channels_last auto: compiled on CUDA" in on_gpu.describe()
    assert "CUDA graphs auto: on, compiled on one CUDA worker" in on_gpu.describe()
    assert on_gpu.allreduce == "none" and "all-reduce none" in on_gpu.describe()
    on_gpus = plan_speed(auto, gpu, 8)  # one node
    assert on_gpus.compile and on_gpus.cuda_graphs and on_gpus.allreduce == "flat"
    assert "all-reduce auto: flat, for CUDA graphs on one node" in on_gpus.describe()
    on_nodes = plan_speed(auto, gpu, 8, one_node=False)
    assert on_nodes.compile and not on_nodes.cuda_graphs and on_nodes.allreduce == "ddp"
    assert on_nodes.compile_options == {"force_layout_optimization": True}
    assert "all-reduce auto: ddp, overlapping the backward pass across nodes" in on_nodes.describe()
    assert "CUDA graphs auto: off, DDP" in on_nodes.describe()
    assert plan_speed(auto, cpu, 2).allreduce == "ddp" and "all-reduce auto: ddp, no CUDA graphs" in plan_speed(
        auto, cpu, 2).describe()
    assert plan_speed(auto, cpu, 3).allreduce == "flat" and "all-reduce auto: flat, exact resume on 3 or more CPU " \
        "workers" in plan_speed(auto, cpu, 3).describe()
    asked = plan_speed(TrainSection(cuda_graphs=True), gpu, 8, one_node=False)  # graphs asked for: flat
    assert asked.cuda_graphs and asked.allreduce == "flat"
    assert plan_speed(TrainSection(cuda_graphs=False), gpu, 8).allreduce == "ddp"
    assert plan_speed(TrainSection(allreduce="flat"), cpu, 2).allreduce == "flat"  # also without graphs
    eager_gpu = plan_speed(TrainSection(compile=False), gpu, 1)
    assert not eager_gpu.channels_last and not eager_gpu.cuda_graphs and "compile off" in eager_gpu.describe()
    assert not plan_speed(TrainSection(compile="aot_eager"), gpu, 1).cuda_graphs  # reduce-overhead is inductor's
    graphs = TrainSection(cuda_graphs=True)
    assert plan_speed(TrainSection(cuda_graphs=True, channels_last=False), gpu, 1).compile_options == {
        "triton.cudagraphs": True}
    assert plan_speed(TrainSection(cuda_graphs=False, channels_last=False), gpu, 1).compile_options is None
    # inductor accepts the options (it checks their names when torch.compile wraps the module, before compiling)
    strict = dataclasses.replace(on_gpu, compile_fallback=False)  # (the fallback would set a process-wide flag)
    assert for_training(torch.nn.Linear(2, 2), strict, cpu, world_size=1) is not None
    with_ddp = plan_speed(dataclasses.replace(graphs, allreduce="ddp"), gpu, 2)
    assert not with_ddp.cuda_graphs and "pytorch#128218" in with_ddp.describe()
    assert not plan_speed(graphs, cpu, 1).cuda_graphs
    assert plan_speed(TrainSection(compile="aot_eager"), cpu, 1).compile == "aot_eager"
    compressed = TrainSection(grad_compression="bf16")
    assert plan_speed(compressed, gpu, 1).grad_compression == "none"  # no DDP at world size 1
    assert plan_speed(compressed, gpu, 4).grad_compression == "bf16"
    assert not plan_speed(TrainSection(tf32=False), gpu, 1).tf32


def test_workers_sharing_a_node_compile_with_their_share_of_its_cpus(monkeypatch):
    """torch starts a compile process per CPU it may run on (at most 32) in every worker: the plan caps that at
    each worker's share of the node's CPUs as Ray counts them, and says so on the start line."""
    from torch._inductor import config as inductor_config

    gpu = torch.device("cuda")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(speed, "visible_cpus", lambda: 96)  # a large node's cores
    eight = plan_speed(TrainSection(), gpu, 8, node_cpus=96, workers_on_node=8)
    assert eight.compile_threads == 12
    assert "12 compile process(es): the node's 96 CPUs over its 8 worker(s)" in eight.describe()
    pod = plan_speed(TrainSection(), gpu, 2, one_node=False, node_cpus=7, workers_on_node=1)  # a pod limited to 7
    assert pod.compile_threads == 7 and "7 compile process(es)" in pod.describe()
    assert plan_speed(TrainSection(), gpu, 1, node_cpus=96, workers_on_node=1).compile_threads is None  # torch: 32
    assert plan_speed(TrainSection(), gpu, 8, node_cpus=3, workers_on_node=8).compile_threads == 1  # none in parallel
    assert plan_speed(TrainSection(compile=False), gpu, 8, node_cpus=96, workers_on_node=8).compile_threads is None
    assert plan_speed(TrainSection(), gpu, 8).compile_threads is None  # the node's CPUs unknown (the benchmarks)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")  # the user's choice, which torch reads
    assert plan_speed(TrainSection(), gpu, 8, node_cpus=96, workers_on_node=8).compile_threads is None

    monkeypatch.setattr(inductor_config, "compile_threads", inductor_config.compile_threads)  # restored after
    set_compile_threads(12)
    assert inductor_config.compile_threads == 12
    set_compile_threads(None)
    assert inductor_config.compile_threads == 12


@pytest.mark.parametrize("options", [
    [],
    ["train.loss_weighting=min_snr", "diffusion.prediction=v", "model.dropout=0.1", "model.num_classes=10",
     "data.labels=auto"],
])
def test_the_training_loss_compiles_as_one_graph(options):
    """What torch.compile gets (uint8 scaling, flips, the forward process, the network, the target, the weighted
    error) traces as one graph, with every option the step can have: a graph break would split the fusion around
    the network and bring back a host round trip per micro-batch."""
    cfg = load_config("cifar10", ["model.base_channels=32", "data.resolution=16", "data.source=builtin:digits",
                                  *options])
    conditional = cfg.model.num_classes != 0
    channels_last = bool(options)  # with autocast, as the speed plan runs it on a GPU
    model = build_model(cfg).to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    loss = DenoisingLoss(model, build_diffusion(cfg), device=torch.device("cpu"), flip=True,
                         channels_last=channels_last, autocast_dtype=torch.bfloat16 if channels_last else None)
    timesteps, noise = position_noise(0, 0, 4, timesteps=cfg.diffusion.timesteps, shape=(3, 16, 16))
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(4) if conditional else None
    torch._dynamo.reset()
    traced = torch._dynamo.explain(loss)(images, torch.tensor([True, False, True, False]), timesteps, noise, labels)
    assert (traced.graph_count, traced.graph_break_count) == (1, 0), traced.break_reasons


@pytest.mark.parametrize("variant", ["fp32", "fp16", "compiled"])
def test_activation_checkpointing_trains_the_same_steps(variant):
    """train.activation_checkpointing: the same losses, gradient norms and updates as keeping the activations, with
    dropout on, under fp16 autocast with its loss scaler, and under torch.compile (a CPU backend)."""
    plain, _, _ = _setup(precision_fp16=variant == "fp16")
    recomputed, _, _ = _setup(precision_fp16=variant == "fp16")
    unwrap(recomputed.loss).model.activation_checkpointing = True
    if variant == "compiled":
        recomputed.loss = compiled(recomputed.loss, "aot_eager", fallback=False)
    for step in range(2):
        a = optimizer_step(plain, _batches(step), lr=1e-3)
        b = optimizer_step(recomputed, _batches(step), lr=1e-3)
        assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-5) and torch.allclose(a.grad_norm, b.grad_norm, rtol=1e-4)
    bare = unwrap(recomputed.loss).model
    for (name, p), q in zip(unwrap(plain.loss).model.named_parameters(), bare.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize(("capability", "expected"), [((7, 5), None), ((7, 0), None), ((8, 0), torch.bfloat16),
                                                      ((9, 0), torch.bfloat16)])
def test_auto_precision_is_bf16_only_on_gpus_that_compute_in_it(monkeypatch, capability, expected):
    """A T4 (7.5) or V100 (7.0) emulates bf16, slowly: torch.cuda.is_bf16_supported() says yes there."""
    from raydiff.training.step import resolve_precision

    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", torch.device("cuda", 1)) == expected
    assert asked == [torch.device("cuda", 1)]  # the worker's device, not the current one
    assert resolve_precision("auto", torch.device("cpu")) is None and resolve_precision("bf16", torch.device("cpu"))
