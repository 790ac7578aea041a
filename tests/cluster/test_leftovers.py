"""Placement groups Ray placed after their creators ended, which it never removes: found by the GCS's job and actor
tables (not the row's flags, which Ray never sets on them) and removed; never a running job's, nor a live actor's."""

from __future__ import annotations

import time

import pytest
from conftest import ended_jobs_actors, kill_named, plant_late_group

from raydiff.cluster.leftovers import groups_of_ended_jobs, remove_groups_of_ended_jobs


@pytest.mark.ray
def test_a_group_placed_after_its_job_and_creator_ended_is_removed_and_no_other(ray_session):
    """Ray never removes a group registered after its creator job and actor ended (a dying Train controller's: one
    held a test cluster's 2 CPUs on 2026-12-06, and the next sweeps waited on it until their tests timed out); a
    command that joins the cluster does. A group of a running job, or one a live (detached) actor of an ended job
    created, stays."""
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

    job, dead, alive = ended_jobs_actors(ray_session, "test-late-groups")
    planted: list[str] = []
    running = placement_group([{"CPU": 0.01}])  # this job's, which runs
    try:
        late = plant_late_group(ray_session, job=job, creator_actor=dead, cpus=0.5)
        planted.append(late)
        kept = plant_late_group(ray_session, job=job, creator_actor=alive, cpus=0.01)
        planted.append(kept)
        ray_session.get(running.ready(), timeout=60)
        time.sleep(1.0)
        assert placement_group_table()[late]["state"] == "CREATED"  # Ray keeps it
        found = groups_of_ended_jobs()
        assert late in found and kept not in found and running.id.hex() not in found
        assert late in remove_groups_of_ended_jobs()
        table = placement_group_table()
        assert table[late]["state"] == "REMOVED"
        assert table[kept]["state"] == table[running.id.hex()]["state"] == "CREATED"
    finally:
        for group in planted:  # Ray would keep them: their job ended before they were registered
            if placement_group_table()[group]["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(ray_session.PlacementGroupID(bytes.fromhex(group))))
        remove_placement_group(running)
        kill_named(ray_session, "test-late-groups")


def test_the_live_groups_of_ended_jobs_are_found_by_the_job_and_actor_tables_not_the_rows_flags():
    """Ray sets a row's flags only on the groups registered when its job or actor ends, and removes a group once
    both are set: the groups left behind have them unset, and the tables say whether their creators ended."""
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    nil_actor = b"\xff" * 16
    ended_job, running_job = b"\x01" * 4, b"\x02" * 4

    def row(group: int, job: bytes, actor: bytes = nil_actor):
        return PlacementGroupTableData(placement_group_id=bytes([group]) * 18, creator_job_id=job,
                                       creator_actor_id=actor)

    dead_actors = {(b"\x01" * 16).hex(), (b"\x02" * 16).hex()}
    rows = [row(1, ended_job, b"\x01" * 16),  # a dead controller's late group
            row(2, ended_job),  # a task's (a detached actor's task may make one after its job ended): left alone
            row(3, running_job, b"\x02" * 16),  # a running job's: its own sweep removes it
            row(4, ended_job, b"\x03" * 16)]  # a detached actor's, alive
    assert groups_of_ended_jobs(rows, ended_jobs={ended_job.hex()}, actor_ended=dead_actors.__contains__) == [
        (bytes([1]) * 18).hex()]
