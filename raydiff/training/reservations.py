"""Releasing the resources a killed Ray Train run still has reserved, for the sweeps whose trials Tune kills.

Ray Train registers every run's workers with the cluster's autoscaling coordinator (requester `train-<run id>`,
renewed every 20 s, expiring 180 s after the last renewal), and the run's controller cancels that request when it
shuts down. Tune stops a trial, early or at its budget, by killing the trial's actor, and the Train controller
that actor owns dies with it without cancelling. For three minutes the coordinator then keeps those CPUs/GPUs for
a run that no longer exists: an elastic run waits on them ("ready resources for 0 workers") and Ray Data gets a
smaller share. A sweep therefore notes each trial's run and cancels its request once the trial's actor is dead
(no renewal can follow), and every one at the end.

A killed trial's controller may also be placing a new worker group as it dies (it saw its workers die first). Ray
removes a job's placement groups when the job ends, but not one whose placement completes just after: a sweep
stopped by Ctrl-C once left such a group holding the cluster's CPUs until the cluster stopped. So at the end the
sweep waits for its trials' actors to be gone and removes the placement groups its job still holds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Collection, Iterator

import ray
from ray import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

from raydiff.runs.run_plan import DRIVER_FILE
from raydiff.storage.rundir import RunDir

COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # Ray's detached actor: (name, namespace)
CHECK_EVERY_S = 5.0
TRIALS_GONE_WAIT_S = 30.0  # for the actors of trials Tune has killed to be dead
LIVE_GROUP_STATES = ("PENDING", "CREATED", "RESCHEDULING")
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


def cancel_requests(requesters: list[str]) -> None:
    """Cancel these requesters' reservations (a no-op for any already cancelled or expired)."""
    try:
        coordinator = ray.get_actor(*COORDINATOR)
    except ValueError:  # never created: nothing on this cluster reserves anything
        return
    ray.get([coordinator.cancel_request.remote(requester_id=r) for r in requesters], timeout=30)


def _dead(actor_id: str) -> bool:
    from ray.util.state import get_actor

    state = get_actor(actor_id, timeout=10)
    return state is not None and state.state == "DEAD"  # unknown: leave it to the release at the end


@contextlib.contextmanager
def releasing_killed_trials(runs, every_s: float = CHECK_EVERY_S) -> Iterator[None]:
    """While a sweep runs, cancel the reservation of each trial whose actor has died; at the end (every trial
    stopped), of all of them. Needs the state API, which sweeps require anyway."""
    released: set[str] = set()
    done = threading.Event()
    others = set(placement_group_table())  # the process's own, from before the sweep: never the sweep's to remove

    def release(trials: dict[str, str], everything: bool) -> None:  # {requester: its trial's actor id}
        gone = [r for r, actor in trials.items() if everything or (r not in released and _dead(actor))]
        if gone:
            cancel_requests(gone)
            released.update(gone)

    def watch() -> None:
        while not done.wait(every_s):
            try:
                release(ray.get(runs.all.remote()), everything=False)
            except Exception:  # best effort while trials run; the final release retries
                logger.debug("releasing the reservations of killed trials failed", exc_info=True)

    watcher = threading.Thread(target=watch, name="raydiff-release-reservations", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        trials: dict[str, str] | None = None
        try:
            trials = ray.get(runs.all.remote())
            release(trials, everything=True)
        except Exception as exc:  # noqa: BLE001 - the sweep's results stand; Ray expires the requests itself
            print(f"[raydiff] could not release the trials' resource reservations ({type(exc).__name__}: {exc}); "
                  f"Ray frees them within 3 minutes")
        try:
            if trials is not None:
                remove_leftover_placement_groups(list(trials.values()), keep=others)
        except Exception:  # best effort: Ray removes the job's groups when it ends, all but a late one
            logger.debug("removing the trials' leftover placement groups failed", exc_info=True)


def remove_leftover_placement_groups(trial_actor_ids: list[str], *, keep: Collection[str] = (),
                                     wait_s: float = TRIALS_GONE_WAIT_S) -> list[str]:
    """Once the trials' actors are dead (waiting up to `wait_s`), remove the placement groups this job still holds
    but those in `keep` (made before the sweep): none of the sweep's is in use after it. Returns their ids."""
    deadline = time.monotonic() + wait_s
    while trial_actor_ids and time.monotonic() < deadline and not all(_dead(a) for a in trial_actor_ids):
        time.sleep(0.5)
    job = ray.get_runtime_context().get_job_id()
    # A placement group's id ends with its creator job's.
    left = [group_id for group_id, group in placement_group_table().items()
            if group_id.endswith(job) and group_id not in keep and group["state"] in LIVE_GROUP_STATES]
    for group_id in left:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
    return left


def cancel_previous_reservation(run_dir: RunDir, requester: str) -> None:
    """Cancel the reservation that the run's previous driver left, if it was killed outright (SIGKILL, out of
    memory) and never cancelled it (Ray keeps it 3 minutes, and an elastic run would wait for CPUs/GPUs nobody
    uses). `driver.json` names it. Call only while holding the run directory's lease: that driver has ended, so
    its run can no longer renew the reservation."""
    previous: dict = {}
    if run_dir.is_file(DRIVER_FILE):
        with contextlib.suppress(ValueError):
            previous = json.loads(run_dir.read_text(DRIVER_FILE))
    stale = previous.get("requester")
    if stale and stale != requester:
        try:
            cancel_requests([stale])
        except Exception:  # Ray expires it within 3 minutes anyway
            logger.debug("cancelling the previous driver's reservation failed", exc_info=True)
