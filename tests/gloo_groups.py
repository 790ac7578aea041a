"""Ending the gloo process groups of the tests that run torch.distributed themselves (two spawned processes, or
one in-process rank), on every torch raydiff admits."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def end_process_group() -> None:
    """`dist.destroy_process_group()`. Before torch 2.8 a gloo group's destructor holds the GIL while it joins its
    worker threads, and a worker thread that is still freeing the last collective's tensors waits for the GIL: the
    process hangs (pytorch/pytorch#154976; a two-process test hung so on torch 2.6 in `.ci/compat`, 2026-11-30).
    A moment without the GIL first lets those threads finish. Ray Train destroys its group long after raydiff's last
    collective, so runs do not meet this."""
    if torch.__version__ < "2.8":
        time.sleep(0.2)
    dist.destroy_process_group()
