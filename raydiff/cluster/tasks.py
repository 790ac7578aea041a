"""Waiting for the Ray tasks a command started, so that stopping the command stops them first.

Why: a command stopped while it waits (Ctrl-C, SIGTERM) leaves Ray at once, and the cluster ends the tasks'
processes with it. A task that ends so counts as failed, and Ray retries it; the command's own connection, shutting
down, can no longer report that retry, and Ray's core worker logs an error line after the command's last one. A
task cancelled first is never retried.
"""

from __future__ import annotations

from typing import Any

import ray


def results_of(futures: list[ray.ObjectRef]) -> list[Any]:
    """`ray.get(futures)`; if the wait ends in an exception (an interruption, or a task's error), the tasks still
    running are cancelled before it goes on up."""
    try:
        return ray.get(futures)
    except BaseException:
        for future in futures:
            ray.cancel(future)
        raise
