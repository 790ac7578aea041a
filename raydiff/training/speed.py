"""What makes the training step fast on this device, decided once per worker start: torch.compile (and how many
processes compile), the memory format, CUDA graphs, TF32, how the workers all-reduce their gradients (DDP or one
flat all-reduce) and in what precision, whether the worker's process keeps its freed host memory; and wrapping the
step's forward module accordingly.

Why a module of its own: each choice is a trade-off that differs by device and was settled by measurement
(docs/benchmarks.md#gpu-throughput), not by the step's arithmetic: the step (`raydiff.training.step`) computes the
same numbers whatever is chosen here, up to floating-point rounding. `auto` values are resolved here and nowhere
else, and the start line prints what was chosen and why (`SpeedPlan.describe`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from raydiff.cluster.host_memory import host_memory_kept
from raydiff.model.diffusion import CudnnFlags, cudnn_tf32_flags, restore_tf32_flags, tf32_flags

if TYPE_CHECKING:
    from raydiff.config import TrainSection


@dataclass(frozen=True)
class SpeedPlan:
    """How this worker runs its training step."""

    compile: bool | str  # False, True (inductor) or the name of a torch.compile backend
    compile_fallback: bool  # `train.compile: auto`: an unsupported setup trains in eager mode instead of failing
    channels_last: bool  # NHWC weights and activations (compiled: every activation around a convolution too)
    cuda_graphs: bool  # torch.compile's reduce-overhead mode: the forward and backward replayed as CUDA graphs
    tf32: bool  # TF32 tensor cores for fp32 convolutions and matmuls (training only; sampling stays IEEE fp32)
    grad_compression: str  # "none" or "bf16": the all-reduce in bf16 (only where there is one: world size > 1)
    allreduce: str = "none"  # "ddp", "flat" (`raydiff.training.flat_allreduce`), or "none" with one worker
    host_memory_kept: bool = False  # this process's allocator keeps freed memory for reuse (HOST_MEMORY_ENV)
    compile_threads: int | None = None  # inductor's compile processes, where fewer than torch's own choice
    reasons: tuple[str, ...] = ()  # why each `auto` came out as it did, for the start line

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """Inductor's options for the step. CUDA graphs are what torch.compile's `reduce-overhead` mode sets. NHWC
        is forced through the graph: inductor's own heuristic keeps a UNet's activations NCHW (its convolutions
        that halve the channels, where the skip connections join, are slower in NHWC on some benchmarks), and NHWC
        weights meeting NCHW activations cost a layout conversion at nearly every convolution."""
        options: dict[str, Any] = {"triton.cudagraphs": True} if self.cuda_graphs else {}
        if self.channels_last:
            options["force_layout_optimization"] = True
        return options or None

    def describe(self) -> str:
        """One phrase for the start line: every choice, and why for the ones `auto` made."""
        compiled = "off" if self.compile is False else "on" if self.compile is True else f"on ({self.compile})"
        parts = [f"compile {compiled}", f"channels_last {'on' if self.channels_last else 'off'}",
                 f"CUDA graphs {'on' if self.cuda_graphs else 'off'}", f"TF32 {'on' if self.tf32 else 'off'}",
                 f"all-reduce {self.allreduce}", f"gradient compression {self.grad_compression}",
                 f"host memory {'kept' if self.host_memory_kept else 'returned'}"]
        return ", ".join(parts) + (f" ({'; '.join(self.reasons)})" if self.reasons else "")


def plan_speed(t: TrainSection, device: torch.device, world_size: int, *, one_node: bool = True,
               node_cpus: float | None = None, workers_on_node: int = 1) -> SpeedPlan:
    """`train.compile`, `train.channels_last`, `train.cuda_graphs`, `train.tf32`, `train.allreduce` and
    `train.grad_compression` made concrete for this device and world size (`one_node`: all workers on this node;
    `node_cpus`: the CPUs Ray counts on it, which `workers_on_node` training workers share while compiling).

    The rules for `auto` follow the GPU measurements in docs/benchmarks.md: compiled, this UNet trains fastest in
    NHWC on CUDA (cuDNN's NHWC convolutions, with GroupNorm and SiLU fused around them by inductor), while in eager
    mode NHWC GroupNorm is slower than NCHW; so channels_last follows compile on CUDA. Nothing is compiled on CPUs:
    the compiled `default` step is no faster there than eager (docs/benchmarks.md#training-throughput), after
    minutes of compilation. Compiled on CUDA the step is bound by the host launching its kernels, not by the GPU,
    so `auto` replays it as CUDA graphs there. DDP cannot be replayed (pytorch#128218): with several workers the
    graphs need the flat all-reduce after the backward pass, which `auto` chooses where the workers share a node
    (its links make the all-reduce short); across nodes DDP's overlap of the all-reduce with the backward pass is
    kept unless CUDA graphs are asked for. On CPUs with three or more workers `auto` takes the flat all-reduce too,
    for exact resume (DDP's first step after a start sums in another bucket layout than its later ones)."""
    cuda = device.type == "cuda"
    reasons = []
    chosen_compile: bool | str = cuda if t.compile == "auto" else t.compile
    if t.compile == "auto":
        reasons.append(f"compile auto: {'on CUDA' if cuda else 'not on ' + device.type}")
    if t.channels_last == "auto":
        channels_last = cuda and chosen_compile is not False
        reasons.append(f"channels_last auto: {'compiled on CUDA' if channels_last else 'eager or not CUDA'}")
    else:
        channels_last = bool(t.channels_last)
    graphable = cuda and chosen_compile is True  # reduce-overhead is inductor's
    allreduce = "none" if world_size == 1 else t.allreduce
    if allreduce == "auto":
        want_graphs = graphable and (t.cuda_graphs is True or (t.cuda_graphs == "auto" and one_node))
        # DDP's first step after each start all-reduces in its first-iteration bucket layout, later ones in the
        # layout it rebuilds: with three or more workers gloo then sums in another order, so a resumed CPU run
        # would not end with the uninterrupted one's weights (exact on CPU is a promise; on GPUs it is not).
        exact = not cuda and world_size >= 3
        allreduce = "flat" if want_graphs or exact else "ddp"
        reasons.append(f"all-reduce auto: {allreduce}, " + (
            "for CUDA graphs" + (" on one node" if one_node else "") if want_graphs
            else "exact resume on 3 or more CPU workers" if exact
            else "no CUDA graphs" if not graphable or t.cuda_graphs is False
            else "overlapping the backward pass across nodes"))
    graphs_possible = graphable and allreduce != "ddp"
    why_not = ("not CUDA" if not cuda else "needs inductor" if not graphable
               else "DDP, pytorch#128218; train.allreduce=flat replays them")
    if t.cuda_graphs == "auto":
        cuda_graphs = graphs_possible
        on = "on, compiled on " + ("one CUDA worker" if world_size == 1 else "CUDA with the flat all-reduce")
        reasons.append(f"CUDA graphs auto: {on if cuda_graphs else 'off, ' + why_not}")
    else:
        cuda_graphs = bool(t.cuda_graphs) and graphs_possible
        if t.cuda_graphs and not cuda_graphs:
            reasons.append(f"CUDA graphs off ({why_not})")
    threads = None
    if chosen_compile is True and node_cpus:
        threads = compile_threads(node_cpus, workers_on_node)
        if threads is not None:
            reasons.append(f"{threads} compile process(es): the node's {node_cpus:g} CPUs over its "
                           f"{workers_on_node} worker(s)")
    return SpeedPlan(compile=chosen_compile, compile_fallback=t.compile == "auto", channels_last=channels_last,
                     cuda_graphs=cuda_graphs, tf32=t.tf32 and cuda,
                     grad_compression=t.grad_compression if world_size > 1 else "none", allreduce=allreduce,
                     host_memory_kept=host_memory_kept(), compile_threads=threads, reasons=tuple(reasons))


def compile_threads(node_cpus: float, workers_on_node: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """How many processes inductor compiles with in one worker, where torch's own choice is too many: each
    worker's even share of its node's CPUs as Ray counts them (a container's CPU limit included). torch starts
    one per CPU the process may run on, at most 32, in every process that compiles: 8 workers on a node each
    start up to 32, and a Kubernetes pod limited to a few of a large node's CPUs sees them all. None: torch's
    own choice (at most the share, or set by TORCHINDUCTOR_COMPILE_THREADS, which torch reads)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in environ:
        return None
    share = max(1, int(node_cpus // max(1, workers_on_node)))
    return share if share < min(32, visible_cpus()) else None


def visible_cpus() -> int:
    """The CPUs this process may run on, as torch counts them for its compile processes."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_compile_threads(threads: int | None) -> None:
    """Inductor's compile processes for this process's compilations to come (None: as torch decided)."""
    if threads is not None:
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = threads


def apply_training_flags(plan: SpeedPlan, device: torch.device) -> None:
    """The backend settings a worker trains with: TF32 as planned, and cuDNN's autotuning on CUDA (fixed shapes:
    each convolution's fastest algorithm is measured once)."""
    set_tf32(plan.tf32)
    torch.backends.cudnn.benchmark = device.type == "cuda"


def backend_flags() -> tuple[tuple[str, CudnnFlags], bool]:
    """The settings `apply_training_flags` changes, as they are now (for `restore_backend_flags`)."""
    return tf32_flags(), torch.backends.cudnn.benchmark


def restore_backend_flags(saved: tuple[tuple[str, CudnnFlags], bool]) -> None:
    """Put back what `backend_flags` read (a bench's loops, one after another in one process, each as it is set)."""
    tf32, torch.backends.cudnn.benchmark = saved
    restore_tf32_flags(tf32)


def set_tf32(on: bool) -> None:
    """TF32 tensor cores for fp32 convolutions and matmuls on (training) or off (`restore_tf32_flags`); sampling
    turns it off for its own block (`raydiff.model.diffusion.full_fp32`)."""
    restore_tf32_flags(("high" if on else "highest", cudnn_tf32_flags(on)))


def for_training(module: nn.Module, plan: SpeedPlan, device: torch.device, world_size: int) -> nn.Module:
    """`module` (the step's forward module, on `device`) as the step runs it: under DDP when several workers
    all-reduce with it (DDP's gradient buckets double as the .grad tensors: no copy after each all-reduce;
    optionally averaged in bf16), then under torch.compile. At world size 1, and under the flat all-reduce (which
    the step does itself: `raydiff.training.flat_allreduce`), there is no DDP wrapper. (The model is converted to
    channels_last where it is built, before the optimizer and the EMA copy its layout.)"""
    if world_size > 1 and plan.allreduce == "ddp":
        ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        if plan.grad_compression == "bf16":
            ddp.register_comm_hook(state=None, hook=bf16_compress_hook)  # averages in bf16, as the default in fp32
        module = ddp
    return compiled(module, plan.compile, fallback=plan.compile_fallback, options=plan.compile_options)


def compiled(module: nn.Module, option: bool | str, *, fallback: bool,
             options: dict[str, Any] | None = None) -> nn.Module:
    """`module` under torch.compile (option True = inductor, with `options`; a string = that backend), or as it
    is. Static shapes: each micro-batch size compiles a graph of its own (a share's last, smaller micro-batch; a
    bench's next batch), where torch's default would make the batch size symbolic at the second size: slower
    kernels for every size, and in a process that met a third size, a compiled backward that failed."""
    if option is False:
        return module
    if fallback:
        from torch import _dynamo

        _dynamo.config.suppress_errors = True  # auto: an unsupported setup trains in eager mode instead
    wrapped = (torch.compile(module, dynamic=False, options=options) if option is True else
               torch.compile(module, dynamic=False, backend=option))
    return cast(nn.Module, wrapped)  # an OptimizedModule


def unwrap(module: nn.Module) -> nn.Module:
    """The module under torch.compile's and DDP's wrappers."""
    module = getattr(module, "_orig_mod", module)
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def ddp_of(module: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DDP wrapper of a module the step runs, if it has one (under torch.compile or not)."""
    module = getattr(module, "_orig_mod", module)
    return module if isinstance(module, nn.parallel.DistributedDataParallel) else None
