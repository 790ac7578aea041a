"""Which device a command computes on: `--device auto` (a CUDA GPU where there is one, else the CPU) or a name
checked against this machine. (Training workers get theirs from Ray Train; what they get of a node's CPUs, and
torch's threads from them, is `worker_cpus` and `torch_threads`.)"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import torch

from raydiff.cluster.errors import GpuNotVisible
from raydiff.config import ScalingSection

RAY_RESOURCE_UNITS = 10_000  # Ray counts a resource in 1/10,000ths (ray_option_utils' MIN_RESOURCE_GRANULARITY)
# How running out of memory reads where it is not torch's own error: the CUDA driver's and CPU allocator's text,
# and the libraries' failed allocations (cuDNN's while it autotunes near the limit, cuBLAS's workspace).
OUT_OF_MEMORY_TEXTS = ("out of memory", "DefaultCPUAllocator", "CUDNN_STATUS_ALLOC_FAILED",
                       "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "Unable to find a valid cuDNN algorithm",
                       "CUBLAS_STATUS_ALLOC_FAILED")


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says that memory ran out (a GPU's or the host's), in any of the forms torch and its libraries
    raise it: what another attempt, or a smaller batch, may not meet."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in OUT_OF_MEMORY_TEXTS)


def trains_on_gpus(scaling: ScalingSection, gpus: float) -> bool:
    """`scaling.use_gpu` made concrete for a cluster of `gpus` GPUs now: `auto` trains on GPUs where the cluster has
    one for each of the run's fewest workers (a fixed 2 on a one-GPU machine asked for 2 GPUs, and a cluster that
    cannot grow waited for ever), else on CPUs; `true` waits for GPUs."""
    if scaling.use_gpu != "auto":
        return scaling.use_gpu
    return gpus > 0 and gpus >= fewest_workers(scaling)


def fewest_workers(scaling: ScalingSection) -> int:
    """The fewest workers the run trains with: `num_workers`, an elastic range's low end, 1 for `auto`."""
    n = scaling.num_workers
    return 1 if n == "auto" else min(n) if isinstance(n, tuple) else n


def worker_cpus(scaling: ScalingSection, *, use_gpu: bool, cpus: float, node_cpus: Sequence[float] = ()) -> float:
    """The CPUs Ray reserves for each training worker: `scaling.cpus_per_worker`, else one beside a GPU, else the
    most, up to an even share of `cpus` (the run's part of the cluster's CPUs) over the most workers the run may
    have, of which the nodes (`node_cpus`: each alive node's CPUs; none known: one node of `cpus`) hold that many.

    A worker is placed on one node, so a share of the cluster's total that no node holds would never be placed,
    and Ray Train waits for it without a word. Whole CPUs where every worker can have one (torch's threads are
    whole), else a fraction, sized so that Ray's own arithmetic counts every worker (see `_ray_counts`)."""
    if scaling.cpus_per_worker is not None:
        return scaling.cpus_per_worker
    if use_gpu:
        return 1.0
    workers = scaling.max_workers
    nodes = [n for n in node_cpus if n > 0] or [cpus]
    share = max(cpus // workers, min(1.0, cpus / workers))
    for whole in range(int(min(share, max(nodes))), 0, -1):  # no worker holds more than a node
        if sum(n // whole for n in nodes) >= workers:  # exact: whole numbers
            return float(whole)
    # Fewer whole CPUs than workers: a fraction each, in Ray's units (it rounds amounts to the nearest 1e-4:
    # 2 CPUs over 3 workers at 0.6667 each would ask 2.0001, and the third would never be placed).
    units = [round(n * RAY_RESOURCE_UNITS) for n in nodes]
    low, high = 1, max(1, math.floor(min(share, 1.0) * RAY_RESOURCE_UNITS + 1e-6))  # (the 1e-6: 0.5 stays 0.5)
    while low < high:  # the most units of which the nodes hold `workers`, as Ray's scheduler counts (exactly)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if sum(u // mid for u in units) >= workers else (low, mid - 1)
    size = low
    while size > 1 and not _ray_counts(nodes, size / RAY_RESOURCE_UNITS, workers):
        size -= 1
    return size / RAY_RESOURCE_UNITS


def _ray_counts(nodes: Sequence[float], size: float, workers: int) -> bool:
    """Whether Ray, counting in floats, finds `workers` workers of `size` CPUs on `nodes`, whichever nodes it
    fills first. An elastic run's reservation takes one worker's CPUs after another from a node while what is
    left holds one more (filling a node before the next), adds them up as the node's reserved CPUs, and Train
    counts the workers those hold as `reserved // size`. Both drift in binary: 0.4 is a little more than 0.4, so
    2.0 // 0.4 is 4.0, and 0.1999 added five times holds only four; a run of up to 5 workers would never reach 5
    (nor start, were 5 its least). Each node must count what it may end up holding: all it holds, or, filled
    last, what the nodes filled before it left over."""
    holds, counts = [], []  # per node: the workers it holds, and whether Ray counts k of them as k (k = 0..holds)
    for node in nodes:
        left, reserved, counted = node, 0.0, [True]
        while len(counted) <= workers and left >= size:
            left, reserved = left - size, reserved + size
            counted.append(reserved // size >= len(counted))
        holds.append(len(counted) - 1)
        counts.append(counted)
    if sum(holds) < workers:
        return False
    for i, held in enumerate(holds):
        filled_before = 1  # bit s: the nodes other than this one can be filled to s workers in all
        for j, other in enumerate(holds):
            if j != i:
                filled_before |= filled_before << other
        last = {workers - s for s in range(workers + 1) if filled_before >> s & 1 and 0 < workers - s < held}
        if not all(counts[i][k] for k in {held, *last}):
            return False
    return True


def torch_threads(cpus_per_worker: float, environ: Mapping[str, str] = os.environ) -> int:
    """torch's intra-op threads in a worker with `cpus_per_worker` CPUs: their whole number, at least one, and at
    most the environment's OMP_NUM_THREADS. Ray sets that in a worker to the same whole number unless the worker's
    environment (the cluster's, the job's runtime env) sets it already: Ray's way to ask for fewer threads, where
    a node's cores are shared with other work. Oversubscribed threads wait for each other at every operation."""
    threads = max(1, math.floor(cpus_per_worker))
    cap = environ.get("OMP_NUM_THREADS", "").strip()
    return min(threads, int(cap)) if cap.isdigit() and int(cap) > 0 else threads


def device_name(device: torch.device) -> str:
    """The GPU's model name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def require_visible(device: torch.device) -> None:
    """A worker that Ray gave a GPU (`device` is CUDA) must see it, or say why not in one line before anything is
    placed on it: Ray assigns GPUs by the resources a node advertises, not by what its processes can open, and
    torch's own error (no NVIDIA driver) does not say that a container asked Docker for no GPU."""
    if device.type != "cuda" or torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) has no CUDA: install a CUDA build of torch on the GPU nodes"
    else:
        why = ("a container started without the node's GPU (a cluster-launcher node type needs docker: "
               "{worker_run_options: [--gpus all]}; python -m raydiff.cluster_check checks it), or no NVIDIA "
               f"driver on the node, or one too old for this torch's CUDA {torch.version.cuda} (CUDA 12.8 needs "
               f"driver 570 or newer, CUDA 13 580)")
    raise GpuNotVisible(f"Ray gave this worker a GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
                        f", but torch sees none: {why}")


def synchronize(device: torch.device) -> None:
    """Wait until `device` has done all the work issued to it (a GPU runs behind the host; a CPU never does)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as a device of this machine; ValueError (one line) for others."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # torch names more (mps, meta, xpu): raydiff runs two
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device
