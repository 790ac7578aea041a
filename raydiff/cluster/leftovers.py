"""What ended jobs left on a cluster that nothing can use: placement groups Ray placed after their creators ended.

A Ray Train controller that dies as it places a worker group (Tune stopping a trial, a driver killed) can have its
request reach the cluster after its job has ended. Ray removes a group once it has marked both its creator job and
its creator actor ended, and it marks only the groups registered when each ends: a group registered after is never
marked, so never removed. On 2026-12-06 one held a test cluster's 2 CPUs after its job had ended, and every later
sweep and run waited on them. The row's own flags say nothing of such a group (the first version of this check read
them, and could never find one); the GCS's job and actor tables say whether its creators ended. Only groups that an
actor created are judged: a detached actor's task may create one after its job ended, and use it. Every raydiff command
that joins a cluster removes these groups, saying so in a line (they held resources another job may wait on), and a
sweep looks again while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ray import PlacementGroupID
from ray.util.placement_group import PlacementGroup, remove_placement_group


def live_rows() -> list:
    """The cluster's live placement groups, but detached ones, as rows of the GCS's placement group table (which
    actor and job created a group, and whether they have ended, are there, in no public API)."""
    from ray._private.state import state as gcs_state
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData  # type: ignore[attr-defined]  # generated, no stubs

    live = (PlacementGroupTableData.PENDING, PlacementGroupTableData.PREPARED, PlacementGroupTableData.CREATED,
            PlacementGroupTableData.RESCHEDULING)
    return [row for row in map(PlacementGroupTableData.FromString,
                               gcs_state._connect_and_get_accessor().get_placement_group_table())
            if row.state in live and not row.is_detached]


def creator_actor(row) -> str | None:
    """The id of the actor that created the group of this row, or None where a driver or task did."""
    creator = row.creator_actor_id  # the nil actor id (all ones), or none, where no actor made it
    return creator.hex() if creator.strip(b"\xff") else None


def _ended_jobs() -> set[str]:
    """The ids of the cluster's jobs that have ended, from the GCS's job table."""
    from ray._private.state import state as gcs_state

    return {job["JobID"] for job in gcs_state.job_table() if job["IsDead"]}


def actor_ended(actor_id: str) -> bool:
    """Whether the actor is dead, from the GCS's actor table (an actor missing from it is dead: the table forgets
    only dead ones)."""
    from ray._private.state import state as gcs_state

    info = gcs_state.actor_table(actor_id)
    return not info or info["State"] == "DEAD"


def groups_made_by_dead_actors(rows, which: Callable[[Any], bool],
                               dead: Callable[[str], bool] = actor_ended) -> list[str]:
    """The ids of the groups of `rows` (`live_rows`) that an actor created, that `which(row)` accepts and whose
    actor is dead: nothing can use them, as their workers die with that actor."""
    return [row.placement_group_id.hex() for row in rows
            if (actor := creator_actor(row)) and which(row) and (row.creator_actor_dead or dead(actor))]


def groups_of_ended_jobs(rows=None, *, ended_jobs: Collection[str] | None = None,
                         actor_ended: Callable[[str], bool] = actor_ended) -> list[str]:
    """The ids of the live groups (not detached) that an actor created, whose job has ended and which is dead
    itself. The row's own flags are not enough: Ray sets them only on the groups registered when a job or actor
    ends, and removes a group as soon as both are set. (A group a task created is left alone: a detached actor's
    task may make one after its job ended, and use it.) `rows`, `ended_jobs`, `actor_ended`: the table's live rows
    (`live_rows`), the ended jobs' ids and an actor's fate, for tests."""
    rows = live_rows() if rows is None else rows
    if not any(creator_actor(row) for row in rows):
        return []
    ended = _ended_jobs() if ended_jobs is None else set(ended_jobs)
    return groups_made_by_dead_actors(rows, lambda row: row.creator_job_dead or row.creator_job_id.hex() in ended,
                                      actor_ended)


def remove_groups_of_ended_jobs(rows=None) -> list[str]:
    """Remove `groups_of_ended_jobs(rows)`, saying so in one line with what they held (another job may have waited
    on it); returns their ids."""
    rows = live_rows() if rows is None else rows
    found = set(groups_of_ended_jobs(rows))
    held: dict[str, float] = {}
    for row in rows:
        if row.placement_group_id.hex() in found:
            for bundle in row.bundles:
                for name, amount in bundle.unit_resources.items():
                    held[name] = held.get(name, 0.0) + amount
    removed = remove_groups(sorted(found))
    if removed:
        what = ", ".join(f"{amount:g} {name}" for name, amount in sorted(held.items()) if name in ("CPU", "GPU"))
        print(f"[raydiff] removed {len(removed)} placement group(s) that ended jobs had left holding "
              f"{what or 'resources'} (Ray keeps a group placed after its creators ended)", flush=True)
    return removed


def remove_groups(group_ids: list[str]) -> list[str]:
    for group_id in group_ids:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
    return group_ids
