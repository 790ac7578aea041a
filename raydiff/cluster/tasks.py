"""Starting a command's Ray tasks on what the cluster has free, and waiting for them so that stopping the command
stops them first.

Why free: a command's tasks (an evaluation's, beside a training run that holds every GPU) would otherwise queue
behind the busy resources, silently, for as long as they are held. Why waiting here: a command stopped while it
waits (Ctrl-C, SIGTERM) leaves Ray at once, and the cluster ends the tasks' processes with it. A task that ends so
counts as failed, and Ray retries it; the command's own connection, shutting down, can no longer report that
retry, and Ray's core worker logs an error line after the command's last one. A task cancelled first is never
retried.
"""

from __future__ import annotations

import time
from typing import Any

import ray

SETTLE_S = 2.0  # how long the cluster may take to count what tasks that just finished released


def results_of(futures: list[ray.ObjectRef]) -> list[Any]:
    """`ray.get(futures)`; if the wait ends in an exception (an interruption, or a task's error), the tasks still
    running are cancelled before it goes on up. Only those: Ray 2.60 aborts the whole process ("Check failed ...
    Tried to complete task that was not pending") where a task is cancelled as its failure comes in."""
    try:
        return ray.get(futures)
    except BaseException:
        _, running = ray.wait(futures, num_returns=len(futures), timeout=0, fetch_local=False)
        for future in running:
            ray.cancel(future)
        raise


def free_now(kind: str, enough: int, settle_s: float = SETTLE_S) -> int:
    """How many whole `kind` (GPU or CPU) the cluster has free now. Read again for up to `settle_s` while fewer
    than `enough` are: the cluster counts what finished tasks release a moment after they finish (a command's own
    tasks of a moment ago would otherwise look like another job's)."""
    deadline = time.monotonic() + settle_s
    while True:
        free = int(ray.available_resources().get(kind, 0))
        if free >= enough or time.monotonic() >= deadline:
            return free
        time.sleep(0.1)


def waiting_note(kind: str, total: int, free: int, tasks: int) -> str | None:
    """A line saying that some of `tasks` tasks of one `kind` each must wait for one (None where none need to)."""
    if free >= tasks:
        return None
    held = f"every {kind} of the cluster ({total})" if free == 0 else f"{total - free} of the cluster's {total} {kind}s"
    return (f"{held} in use (by a training run?): {tasks - free} of {tasks} Ray task(s) wait until one is free, or "
            f"until the autoscaler adds a node (Ctrl-C stops the command)")
