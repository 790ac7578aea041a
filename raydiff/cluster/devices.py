"""Which device a command computes on: `--device auto` (a CUDA GPU where there is one, else the CPU) or a name
checked against this machine. (Training workers get theirs from Ray Train; what they get of a node's CPUs, and
torch's threads from them, is `worker_cpus` and `torch_threads`.)"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

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


def worker_cpus(scaling: ScalingSection, *, use_gpu: bool, cpus: float) -> float:
    """The CPUs Ray reserves for each training worker: `scaling.cpus_per_worker`, else one beside a GPU, else an
    even share of `cpus` (the run's part of the cluster's CPUs) over the most workers the run may have."""
    if scaling.cpus_per_worker is not None:
        return scaling.cpus_per_worker
    if use_gpu:
        return 1.0
    share = max(cpus // scaling.max_workers, min(1.0, cpus / scaling.max_workers))
    # Ray counts resources in 1/RAY_RESOURCE_UNITS, rounding to the nearest: 2 CPUs over 3 workers would ask
    # 0.6667 each, 2.0001 together, more than there are, and the third would never be placed. Rounded down.
    return math.floor(share * RAY_RESOURCE_UNITS + 1e-6) / RAY_RESOURCE_UNITS  # (the 1e-6: 0.5 stays 0.5)


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
               "driver on the node")
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
