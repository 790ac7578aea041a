"""What a sweep releases of the placement groups Ray keeps: while it runs, those whose creator actor has died (a
killed trial's Train controller may place one as it dies, and Ray keeps it until the job ends, or for ever); at
its end, every one its job still holds, once no process of the sweep's actors runs; never another job's, nor what
its process held before the sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for

from raydiff.training import reservations
from raydiff.training.reservations import (
    cancel_previous_reservation,
    job_actor_ids,
    remove_leftover_placement_groups,
    remove_orphaned_placement_groups,
)

ANOTHER_JOBS_GROUP = """
import ray
from ray.util.placement_group import placement_group
ray.init(address="{address}", logging_level="ERROR")
group = placement_group([{{"CPU": 0.01}}], lifetime="detached")  # outlives its job
ray.get(group.ready())
print(group.id.hex())
"""


@pytest.mark.ray
def test_a_group_whose_creator_actor_died_is_removed_while_the_sweep_runs_and_no_other(ray_session):
    """Ray keeps it until the job ends, and the sweep's next trial would wait for the CPUs it holds."""
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
    from ray.util.state import get_actor

    @ray_session.remote(num_cpus=0)
    class Controller:  # as a Train controller places its worker group
        def place(self):
            group = placement_group([{"CPU": 0.01}])
            ray_session.get(group.ready())
            return group.id.hex()

    before = placement_group([{"CPU": 0.01}])
    controller, other = Controller.remote(), Controller.remote()
    orphan, kept, alive = ray_session.get([controller.place.remote(), controller.place.remote(), other.place.remote()],
                                          timeout=120)
    drivers = placement_group([{"CPU": 0.01}])  # as Tune's trial groups: the sweep's driver made it
    ray_session.get([before.ready(), drivers.ready()], timeout=60)
    try:
        assert remove_orphaned_placement_groups(keep={before.id.hex(), kept}) == []  # every creator alive
        ray_session.kill(controller)
        address = ray_session.get_runtime_context().gcs_address  # the state API finds two clusters here
        wait_for(lambda: get_actor(controller._actor_id.hex(), address=address).state == "DEAD",
                 what="the controller's death")
        assert placement_group_table()[orphan]["state"] == "CREATED"  # Ray keeps it
        assert remove_orphaned_placement_groups(keep={before.id.hex(), kept}) == [orphan]
        table = placement_group_table()
        assert table[orphan]["state"] == "REMOVED"
        assert {table[g]["state"] for g in (kept, alive, before.id.hex(), drivers.id.hex())} == {"CREATED"}
    finally:
        for group in (before, drivers, *(PlacementGroup(ray_session.PlacementGroupID(bytes.fromhex(g)))
                                         for g in (kept, alive))):
            remove_placement_group(group)
        ray_session.kill(other)


@pytest.mark.ray
def test_a_sweeps_end_removes_the_placement_groups_its_job_still_holds_and_no_other_jobs(ray_session, cluster):
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

    other = subprocess.run([sys.executable, "-c", ANOTHER_JOBS_GROUP.format(address=cluster.address)],
                           capture_output=True, text=True, check=True).stdout.split()[-1]
    before, ours = placement_group([{"CPU": 0.01}]), placement_group([{"CPU": 0.01}])
    ray_session.get([before.ready(), ours.ready()], timeout=60)
    try:
        assert remove_leftover_placement_groups(keep_groups={before.id.hex()}, keep_actors=job_actor_ids()) \
            == [ours.id.hex()]
        table = placement_group_table()
        assert table[ours.id.hex()]["state"] == "REMOVED"
        assert table[before.id.hex()]["state"] == table[other]["state"] == "CREATED"
    finally:
        remove_placement_group(before)
        remove_placement_group(PlacementGroup(ray_session.PlacementGroupID(bytes.fromhex(other))))


@pytest.mark.ray
def test_a_sweeps_end_waits_for_the_processes_of_its_dead_actors_before_removing_groups(ray_session):
    """Ray marks a killed trial's actors dead before their processes end; one still running can place a group after
    the removal. A trial's child whose process is stopped (as a busy machine's may lag) holds the end back."""
    from ray.util.placement_group import placement_group, placement_group_table

    @ray_session.remote(num_cpus=0)
    class Placer:  # a Train controller's part: it places a group
        def place(self):
            group = placement_group([{"CPU": 0.01}])
            ray_session.get(group.ready())
            return os.getpid(), group.id.hex()

    @ray_session.remote(num_cpus=0)
    class Trial:  # owns the placer, as a trial owns its Train controller
        def start(self):
            self.placer = Placer.remote()
            return ray_session.get(self.placer.place.remote())

    actors_before, groups_before = job_actor_ids(), set(placement_group_table())
    trial = Trial.remote()
    pid, group = ray_session.get(trial.start.remote(), timeout=120)
    result: dict[str, list[str]] = {}
    end = threading.Thread(target=lambda: result.update(left=remove_leftover_placement_groups(
        keep_groups=groups_before, keep_actors=actors_before, wait_s=60)))
    os.kill(pid, signal.SIGSTOP)
    try:
        ray_session.kill(trial)  # the placer dies with its owner
        end.start()
        end.join(3.0)
        assert end.is_alive(), "removed the groups while a dead actor's process still ran"
    finally:
        os.kill(pid, signal.SIGCONT)
    started = time.monotonic()
    end.join(60)
    assert not end.is_alive() and result["left"] == [group], (time.monotonic() - started, result)
    assert placement_group_table()[group]["state"] == "REMOVED"


def test_a_driver_killed_before_its_first_worker_group_has_its_reservation_cancelled_by_the_next(tmp_path,
                                                                                                 monkeypatch):
    """Killed while Ray Train waited for room, a driver wrote no driver.json (rank 0 writes it): the lease it left
    names its reservation, and the next driver cancels it at once, not after Ray's 3 minutes. driver.json's is
    cancelled too; the new driver's own never."""
    from raydiff.storage.lease import take, this_process
    from raydiff.storage.rundir import RunDir

    cancelled: list[list[str]] = []
    monkeypatch.setattr(reservations, "cancel_requests", lambda names, **kwargs: cancelled.append(names))
    run_dir = RunDir(tmp_path / "run")
    killed = take(run_dir, this_process(), stale_s=4, what="run directory")
    killed.update(requester="train-first")
    os.close(killed._store.fd)  # as SIGKILL would: the kernel lets the lock go, the file keeps what it said
    lease = take(run_dir, this_process(), stale_s=4, what="run directory")
    assert lease.previous["requester"] == "train-first"
    cancel_previous_reservation(run_dir, "train-second", lease.previous)
    assert cancelled == [["train-first"]]
    (tmp_path / "run").mkdir()
    run_dir.write_text("driver.json", '{"requester": "train-older"}')
    cancel_previous_reservation(run_dir, "train-second", {"requester": "train-second"})
    assert cancelled[-1] == ["train-older"]
    lease.release()
    after_release = take(run_dir, this_process(), stale_s=4, what="run directory")
    assert after_release.previous is None  # released: no one to name
    after_release.release()
