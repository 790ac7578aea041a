"""Waiting for a command's tasks: a wait that ends in an exception cancels the tasks still running, so that
leaving Ray next retries none of them (tests/test_evaluate.py stops an evaluation through the CLI)."""

from __future__ import annotations

import pytest

from raydiff.cluster.tasks import results_of

pytestmark = pytest.mark.ray


def test_a_wait_that_fails_cancels_the_tasks_still_running(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=1, max_retries=3)
    def sleeps() -> None:
        import time
        for _ in range(1200):  # a cancelled task stops between Python's steps, not inside one sleep
            time.sleep(0.1)

    @ray.remote(num_cpus=1)
    def fails() -> None:
        raise ValueError("a task's error")

    running = sleeps.remote()
    with pytest.raises(ray.exceptions.RayTaskError, match="a task's error"):
        results_of([running, fails.remote()])
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(running, timeout=60)


def test_a_wait_that_ends_well_returns_the_results_in_order(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=1)
    def square(x: int) -> int:
        return x * x

    assert results_of([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
