"""Whether a process that computes on CPUs keeps the host memory it frees (`train.keep_host_memory`).

Why a module of its own: by default glibc hands freed memory back to the system: large blocks are mapped and
unmapped one by one, and the heaps of a thread's own arena (Ray Train runs the loop in a thread of its own) are
unmapped once empty, so each training step's or sampling pass's activations come back as fresh pages that the
kernel faults in and zeroes, thousands a step (docs/benchmarks.md#training-throughput). One arena (the main heap),
never trimmed, with large blocks taken from it too, keeps freed memory for the next step. Every kind of process
that computes on CPUs needs it, set in one of two ways:

- a process Ray starts for raydiff (a Train worker, an evaluation task): `HOST_MEMORY_ENV` in its runtime
  environment, which glibc reads as the process starts, before any thread has an arena of its own;
- the command's own process (`lr_find`, `sample`): `keep_host_memory_here`, glibc's `mallopt`, before its heavy
  work. It sets the thresholds of every arena and how many arenas threads started later may make; arenas that
  threads already have stay, but the command computes in its main thread, on the main heap.

Other allocators ignore both.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from typing import Literal

HOST_MEMORY_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                   "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
_MALLOPT_OPTION = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}  # malloc.h


def keep_host_memory(setting: Literal["auto"] | bool, *, use_gpu: bool) -> bool:
    """`train.keep_host_memory` made concrete for processes about to compute (before they start, for those Ray
    starts): `auto` keeps it where they compute on CPUs, whose activations live in host memory."""
    return not use_gpu if setting == "auto" else setting


def host_memory_kept() -> bool:
    """Whether this process started with HOST_MEMORY_ENV under glibc (what `keep_host_memory` asked of it)."""
    env_set = all(os.environ.get(name) == value for name, value in HOST_MEMORY_ENV.items())
    return env_set and _glibc()


def keep_host_memory_here() -> bool:
    """HOST_MEMORY_ENV's settings for this process, already running, through glibc's `mallopt`; whether they took
    (not under another C library)."""
    if not _glibc():
        return False
    libc = ctypes.CDLL(None)  # the C library this process runs on
    return all(libc.mallopt(_MALLOPT_OPTION[name], int(value)) == 1 for name, value in HOST_MEMORY_ENV.items())


@functools.cache
def _glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"  # read from the Python binary: once
