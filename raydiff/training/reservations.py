"""Releasing the resources a killed Ray Train run still has reserved, for the sweeps whose trials Tune kills.

Ray Train registers every run's workers with the cluster's autoscaling coordinator (requester `train-<run id>`,
renewed every 20 s, expiring 180 s after the last renewal), and the run's controller cancels that request when it
shuts down. Tune stops a trial, early or at its budget, by killing the trial's actor, and the Train controller
that actor owns dies with it without cancelling. For three minutes the coordinator then keeps those CPUs/GPUs for
a run that no longer exists: an elastic run waits on them ("ready resources for 0 workers") and Ray Data gets a
smaller share. A sweep therefore notes each trial's run and cancels its request once the trial's actor is dead
(no renewal can follow), and every one at the end.

A killed trial's controller may also be placing a new worker group as it dies: Tune removes the trial's own group
first, which kills the trial's workers, and the controller, marked dead but still running for a moment, starts a
new group. Ray keeps a group whose creator actor has died until the job ends, and one placed after its creator was
marked dead for ever (it misses that creator's death): such a group held the 2 CPUs of a test cluster, and the
sweep's next trial waited on them until the test timed out. So while a sweep runs it removes every placement group
of its job whose creator actor is dead (what Ray Train's own cleaner does for a group it was told of); and at its
end it waits until every actor it made is dead and its process gone, then removes the groups its job still holds.
A group placed still later (a dying controller's request the cluster granted after that) outlives its sweep: every
command that joins a cluster removes those, and a sweep looks again while it runs (`raydiff.cluster.leftovers`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Collection, Iterator

import ray
from ray.util.placement_group import placement_group_table

from raydiff.cluster.leftovers import (
    actor_ended,
    creator_actor,
    groups_made_by_dead_actors,
    live_rows,
    remove_groups,
    remove_groups_of_ended_jobs,
)
from raydiff.runs.run_plan import DRIVER_FILE
from raydiff.storage.rundir import RunDir

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # Ray's detached actor: (name, namespace)
CHECK_EVERY_S = 5.0
ACTORS_GONE_WAIT_S = 30.0  # for the processes of the actors a sweep made to end, once Tune has stopped its trials
STATE_LIMIT = 10_000  # the most rows the state API lists (its default, 100, is a few sweeps' actors)
logger = logging.getLogger("raydiff")


def requester_of(trainer) -> str:
    """The name under which `trainer`'s run reserves its resources with the coordinator."""
    return f"train-{trainer.train_run_context.run_id}"


@ray.remote(num_cpus=0)
class TrialRuns:
    """The Train runs of a sweep's trials: requester name -> the actor id of the trial that started it."""

    def __init__(self) -> None:
        self._runs: dict[str, str] = {}

    def add(self, requester: str, trial_actor_id: str) -> None:
        self._runs[requester] = trial_actor_id

    def all(self) -> dict[str, str]:
        return dict(self._runs)


def note_trial_run(runs, requester: str) -> None:
    """Called in a trial, before its run starts: record the run against the trial's actor."""
    ray.get(runs.add.remote(requester, ray.get_runtime_context().get_actor_id()))


def cancel_requests(requesters: list[str], timeout_s: float = 30) -> None:
    """Cancel these requesters' reservations (a no-op for any already cancelled or expired)."""
    try:
        coordinator = ray.get_actor(*COORDINATOR)
    except ValueError:  # never created: nothing on this cluster reserves anything
        return
    ray.get([coordinator.cancel_request.remote(requester_id=r) for r in requesters], timeout=timeout_s)


def cluster_address() -> str:
    """The address of the cluster this process is connected to, for the state API, which otherwise looks a cluster
    up and refuses where it finds two on one machine."""
    return ray.get_runtime_context().gcs_address


@contextlib.contextmanager
def releasing_killed_trials(runs, every_s: float = CHECK_EVERY_S) -> Iterator[None]:
    """While a sweep runs, cancel the reservation of each trial whose actor has died and remove the placement groups
    whose creator actor has; at the end (every trial stopped), cancel all of them and remove the groups the sweep's
    job still holds. Needs the state API, which sweeps require anyway."""
    released: set[str] = set()
    done = threading.Event()
    # The process's own, from before the sweep: never the sweep's to remove, nor to wait for.
    groups_before = set(placement_group_table())
    actors_before: set[str] | None = None
    try:
        actors_before = job_actor_ids()
    except Exception:  # without it the end cannot tell the sweep's actors: Ray removes the groups, all but a late one
        logger.debug("listing the job's actors failed", exc_info=True)

    def release(trials: dict[str, str], everything: bool) -> None:  # {requester: its trial's actor id}
        gone = [r for r, actor in trials.items() if everything or (r not in released and actor_ended(actor))]
        if gone:
            cancel_requests(gone)
            released.update(gone)

    def watch() -> None:
        while not done.wait(every_s):
            try:
                release(ray.get(runs.all.remote()), everything=False)
            except Exception:  # best effort while trials run; the final release retries
                logger.debug("releasing the reservations of killed trials failed", exc_info=True)
            try:
                rows = live_rows()  # one read of the table for both
                remove_orphaned_placement_groups(keep=groups_before, rows=rows)
                remove_groups_of_ended_jobs(rows)
            except Exception:  # best effort: the next check asks again, and the end removes every group
                logger.debug("removing the groups of killed trials' controllers failed", exc_info=True)

    watcher = threading.Thread(target=watch, name="raydiff-release-reservations", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        try:
            release(ray.get(runs.all.remote()), everything=True)
        except Exception as exc:  # noqa: BLE001 - the sweep's results stand; Ray expires the requests itself
            print(f"[raydiff] could not release the trials' resource reservations ({type(exc).__name__}: {exc}); "
                  f"Ray frees them within 3 minutes")
        try:
            if actors_before is not None:
                remove_leftover_placement_groups(keep_groups=groups_before, keep_actors=actors_before)
        except Exception:  # best effort: Ray removes the job's groups when it ends, all but a late one
            logger.debug("removing the trials' leftover placement groups failed", exc_info=True)


def _live_groups() -> dict[str, str | None]:
    """This job's live placement groups, but detached ones: id -> the id of the actor that created it (None: the
    driver or a task did)."""
    job = ray.get_runtime_context().get_job_id()
    return {row.placement_group_id.hex(): creator_actor(row) for row in live_rows()
            if row.creator_job_id.hex() == job}


def orphaned_placement_groups(keep: Collection[str] = (), rows=None) -> list[str]:
    """The ids of this job's live placement groups (but those in `keep`) whose creator actor is dead. In a sweep
    these are killed trials' Train controllers' worker groups: nothing else uses one, as its workers die with the
    controller. `rows`: the table's live rows, if just read (`live_rows`)."""
    job = ray.get_runtime_context().get_job_id()
    return groups_made_by_dead_actors(live_rows() if rows is None else rows,
                                      lambda row: row.creator_job_id.hex() == job
                                      and row.placement_group_id.hex() not in keep)


def remove_orphaned_placement_groups(keep: Collection[str] = (), rows=None) -> list[str]:
    """Remove `orphaned_placement_groups(keep, rows)`; returns their ids."""
    return remove_groups(orphaned_placement_groups(keep, rows))


def _job_actors(*, detail: bool = False, timeout_s: int = 10) -> list:
    """Every actor this job has made, in any state. (Ray's listings count a filter's misses as missing output:
    hence raise_on_missing_output=False, with a limit no cluster reaches.)"""
    from ray.util.state import list_actors

    return list_actors(address=cluster_address(), filters=[("job_id", "=", ray.get_runtime_context().get_job_id())],
                       detail=detail, limit=STATE_LIMIT, timeout=timeout_s, raise_on_missing_output=False)


def job_actor_ids() -> set[str]:
    """The ids of every actor this job has made, in any state."""
    return {a.actor_id for a in _job_actors(timeout_s=30)}


def _actors_gone(keep: Collection[str]) -> bool:
    """Whether every actor of this job but those in `keep` and the detached (which outlive it by design, such as
    Ray Train's placement-group cleaners) is dead and its process has ended."""
    from ray.util.state import list_workers

    actors = [a for a in _job_actors(detail=True) if a.actor_id not in keep and not a.is_detached]
    if any(a.state != "DEAD" for a in actors):
        return False
    workers = list_workers(address=cluster_address(), filters=[("is_alive", "=", "True")], limit=STATE_LIMIT,
                           timeout=10, raise_on_missing_output=False)
    running = {(w.node_id, w.pid) for w in workers}
    return not any((a.node_id, a.pid) in running for a in actors)


def remove_leftover_placement_groups(*, keep_groups: Collection[str] = (), keep_actors: Collection[str] = (),
                                     wait_s: float = ACTORS_GONE_WAIT_S) -> list[str]:
    """Once every actor this job made but those in `keep_actors` (alive before the sweep) is dead and its process
    ended (waiting up to `wait_s`), remove the groups the job still holds (not detached) but those in
    `keep_groups`: none of the sweep's is in use after it, and no process is left to place another. Returns their
    ids."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if _actors_gone(keep_actors):
                break
        except Exception:  # a slow state API on a busy cluster: ask again until the deadline
            logger.debug("listing the sweep's actors failed", exc_info=True)
        time.sleep(0.5)
    return remove_groups([group_id for group_id in _live_groups() if group_id not in keep_groups])


def cancel_previous_reservation(run_dir: RunDir, requester: str, previous_holder: dict | None = None) -> None:
    """Cancel the reservation that the run's previous driver left, if it was killed outright (SIGKILL, out of
    memory) and never cancelled it (Ray keeps it 3 minutes, and an elastic run would wait for CPUs/GPUs nobody
    uses). The lease it left names it (`previous_holder`: `Lease.previous`; a driver killed while Ray Train waited
    for room for its first worker group wrote nothing else), and `driver.json` does once a group ran. Call only
    while holding the run directory's lease: that driver has ended, so its run can no longer renew the
    reservation."""
    previous: dict = {}
    if run_dir.is_file(DRIVER_FILE):
        with contextlib.suppress(ValueError):
            previous = json.loads(run_dir.read_text(DRIVER_FILE))
    stale = {name for name in (previous.get("requester"), (previous_holder or {}).get("requester"))
             if isinstance(name, str) and name and name != requester}
    if stale:
        try:
            cancel_requests(sorted(stale))
        except Exception:  # Ray expires it within 3 minutes anyway
            logger.debug("cancelling the previous driver's reservation failed", exc_info=True)
