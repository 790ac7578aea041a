"""What a sweep releases at its end: the placement groups its job still holds (a killed trial's controller may be
placing one as it dies, and Ray misses a group placed just after the job ends), and nothing of another job's nor
what its process held before the sweep."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raydiff.training.reservations import remove_leftover_placement_groups

ANOTHER_JOBS_GROUP = """
import ray
from ray.util.placement_group import placement_group
ray.init(address="{address}", logging_level="ERROR")
group = placement_group([{{"CPU": 0.01}}], lifetime="detached")  # outlives its job
ray.get(group.ready())
print(group.id.hex())
"""


@pytest.mark.ray
def test_a_sweeps_end_removes_the_placement_groups_its_job_still_holds_and_no_other_jobs(ray_session, cluster):
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

    other = subprocess.run([sys.executable, "-c", ANOTHER_JOBS_GROUP.format(address=cluster.address)],
                           capture_output=True, text=True, check=True).stdout.split()[-1]
    before, ours = placement_group([{"CPU": 0.01}]), placement_group([{"CPU": 0.01}])
    ray_session.get([before.ready(), ours.ready()], timeout=60)
    try:
        assert remove_leftover_placement_groups([], keep={before.id.hex()}) == [ours.id.hex()]
        table = placement_group_table()
        assert table[ours.id.hex()]["state"] == "REMOVED"
        assert table[before.id.hex()]["state"] == table[other]["state"] == "CREATED"
    finally:
        remove_placement_group(before)
        remove_placement_group(PlacementGroup(ray_session.PlacementGroupID(bytes.fromhex(other))))
