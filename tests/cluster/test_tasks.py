"""A command's tasks: how many of the cluster's resources are free for them, and the line that says some must wait
(tests/test_evaluate.py evaluates beside a job that holds every CPU, through the CLI); waiting for them: a wait
that ends in an exception cancels the tasks still running, so that leaving Ray next retries none of them
(tests/test_evaluate.py stops an evaluation through the CLI)."""

from __future__ import annotations

import time

import pytest

from raydiff.cluster.tasks import free_now, results_of, waiting_note

pytestmark = pytest.mark.ray


def test_a_wait_that_fails_cancels_the_tasks_still_running_and_only_those(ray_session, monkeypatch):
    """Not the task whose failure ended the wait: Ray 2.60 aborts the whole process ("Check failed ... Tried to
    complete task that was not pending") when a task is cancelled as its failure is being recorded, which
    crashed this test's process in two of the suite's runs on 2026-12-06."""
    ray = ray_session
    cancelled = []
    cancel = ray.cancel
    monkeypatch.setattr(ray, "cancel", lambda future, **kw: cancelled.append(future) or cancel(future, **kw))

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
    assert cancelled == [running]
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(running, timeout=60)


def test_a_wait_that_ends_well_returns_the_results_in_order(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=1)
    def square(x: int) -> int:
        return x * x

    assert results_of([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]


def test_the_free_resources_are_read_again_until_enough_are_or_the_cluster_has_settled(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=1)
    class Holder:
        def ready(self) -> bool:
            return True

    assert free_now("CPU", enough=2, settle_s=30) == 2  # what an earlier test held, released
    holder = Holder.remote()
    try:
        ray.get(holder.ready.remote(), timeout=120)
        started = time.monotonic()
        assert free_now("CPU", enough=2, settle_s=1.0) == 1  # one of the session cluster's two held
        assert time.monotonic() - started >= 1.0
    finally:
        ray.kill(holder)
    assert free_now("CPU", enough=2, settle_s=30) == 2  # released a moment after the kill, read again until then
    assert free_now("GPU", enough=0) == 0


def test_the_waiting_line_names_what_is_held_and_how_many_tasks_wait():
    assert waiting_note("GPU", 8, 8, 8) is None and waiting_note("GPU", 8, 3, 2) is None
    assert waiting_note("GPU", 8, 0, 8) == ("every GPU of the cluster (8) in use (by a training run?): 8 of 8 Ray "
                                            "task(s) wait until one is free, or until the autoscaler adds a node "
                                            "(Ctrl-C stops the command)")
    assert waiting_note("CPU", 4, 1, 3).startswith("3 of the cluster's 4 CPUs in use (by a training run?): 2 of 3 ")
