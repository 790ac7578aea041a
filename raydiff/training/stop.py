"""Stopping a run cleanly: SIGTERM (`ray job stop`, a scheduler) or Ctrl-C ends it with a final checkpoint, or,
before training has started (decoding, preparing streamed data), at once (`raydiff.training.interrupts`).

During training the driver's signal handler raises a flag in a small Ray actor; the workers look at it every few
steps (rank 0 asks, all ranks agree through an all-reduce), write a checkpoint, and return. A second Ctrl-C
interrupts at once. While no worker group runs (Ray Train's controller waits for room on the cluster for it,
or restarts it after a failure or a resize), no worker would look at the flag until there is room, which on
an autoscaling cluster may be never: the stop is at once then (the controller tells the flag its state). A run
whose lease another driver took over stops the same way, writing nothing more.
Ray Train's `fit()`, called in the main thread, would replace the SIGINT handler with its own, which aborts the
run without a checkpoint: `beside_the_handlers` calls it from a helper thread instead.

A sweep keeps Ray Tune's own SIGINT handler, which saves Tune's state and ends the sweep (its trials continue from
their checkpoints when the command runs again), and SIGTERM is passed on to it: `noting_tune_interrupt` tells the
command that it happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback

from raydiff.storage.atomic import process_runs
from raydiff.storage.lease import Lease
from raydiff.training.interrupts import SAME_SIGTERM_S, in_main_thread, raise_interrupted, signal_handlers

logger = logging.getLogger("raydiff")
T = TypeVar("T")
TUNE_INTERRUPTED = "Experiment has been interrupted"  # how Tune's warning after a Ctrl-C begins (ray.tune.tune)


LEASE_LOST = "the run's lease was taken over"  # a stop that writes nothing more: another driver holds the run


def taken_over(run_dir: Any, when: str, unrenewed_s: float | None = None) -> str:
    """The one line of a run whose lease another driver took over, or (`unrenewed_s`, `Lease.unrenewed_s`) that
    gave its lease up, unrenewed for that long: `when` says when, and what was not written."""
    if unrenewed_s is not None:
        return (f"this run could not renew its lease on the run directory {run_dir} for {unrenewed_s:.0f} s (the "
                f"store did not answer){when}: another raydiff run may take it over (run.lease_stale_s); the same "
                f"command continues the run once the store answers")
    return (f"another raydiff run took over the run directory {run_dir} (this one's lease was not renewed within "
            f"run.lease_stale_s){when}; the other run continues it")
# Ray Train's controller states in which no worker group runs, so none could write a final checkpoint (None: the
# controller has said nothing yet). PREEMPTING drains a group that may still write one; later states end the run.
NO_WORKERS = frozenset({None, "INITIALIZING", "SCHEDULING", "RESCHEDULING", "RESTARTING", "RESIZING"})
WORKERS_END_WAIT_S = 10.0  # how long a stop at once waits for the workers to end before it lets the run's lease go
RAY_TRAIN_WORKER = "RayTrainWorker"  # the class of Ray Train's worker actors (the actor table gives its qualified name)
STATE_POLL_S = 1.0  # how often, once a stop is asked for, the driver looks whether a worker group still runs
_WAITING = "is waiting for room on the cluster for one"
_PLACING = {"SCHEDULING": _WAITING, "RESCHEDULING": _WAITING, "RESTARTING": "is restarting it",
            "RESIZING": "is resizing it"}


@ray.remote(num_cpus=0)
class StopFlag:
    """Holds the reason the driver was asked to stop, if it was (a lost lease over any other)."""

    def __init__(self) -> None:
        # The flag keeps nothing to save. Ray's SIGTERM handler raises SystemExit, which, landing while the process
        # finalizes the controller's handle (at a job's end), Python prints as a traceback into the run's output:
        # here a SIGTERM ends the process at once, as Ray's would, without one. (This actor's calls run in the main
        # thread, where handlers are set.)
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(1))
        self._reason: str | None = None
        self._controller: str | None = None  # Ray Train's controller's state, as it last said (`ControllerState`)
        self._ran = False  # whether a worker group has run in this fit (then a stop at once is not before training)
        self._controller_actor: Any = None  # the controller itself, for the driver to end it when it stops at once

    def request(self, reason: str) -> None:
        if self._reason is None or reason == LEASE_LOST:
            self._reason = reason

    def reason(self) -> str | None:
        return self._reason

    def note_controller(self, state: str) -> None:
        self._controller = state
        self._ran = self._ran or state == "RUNNING"

    def workers(self) -> tuple[str | None, bool]:
        """(the controller's state, whether a worker group has run)."""
        return self._controller, self._ran

    def note_controller_actor(self, actor: Any) -> None:
        self._controller_actor = actor

    def controller_actor(self) -> Any:
        return self._controller_actor


class ControllerState(ControllerCallback):
    """Tells the stop flag each new state of Ray Train's controller (run in the controller's process): the driver
    asks it once a stop comes, to tell a worker group that will see the flag from one that is not there."""

    def __init__(self, flag) -> None:
        self.flag = flag
        self._sent: str | None = None

    def after_controller_start(self, train_run_context: Any) -> None:
        with contextlib.suppress(Exception):  # never raises: a raising hook fails the run
            self.flag.note_controller_actor.remote(ray.get_runtime_context().current_actor)

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        # Ray calls this on every pass of its control loop, which spins while an elastic run waits for room: only
        # a change from what was sent last is sent (Ray may change the state without calling this, where another
        # callback raised). A Ray release without `_state_type`: "unknown", and a stop is as asked.
        name = getattr(getattr(current_state, "_state_type", None), "name", "unknown")
        if name == self._sent:
            return
        self._sent = name
        with contextlib.suppress(Exception):  # never raises: a raising hook fails the run
            self.flag.note_controller.remote(name)


def _ask(flag, method: str, default: T) -> T:
    """What the stop flag's `method` answers, or `default` where the flag does not answer in seconds (the driver is
    gone, its job ends anyway, or it is busy): whoever asks goes on as it would without an answer."""
    try:
        return ray.get(getattr(flag, method).remote(), timeout=5)
    except Exception:  # noqa: BLE001
        return default


def end_controller(flag) -> None:
    """End Ray Train's controller of a run stopped at once (best effort, in seconds): it would keep asking the
    autoscaler for the run's resources until the job ends, and start a group if room came meanwhile. Its workers
    end with it (their owner)."""
    actor = _ask(flag, "controller_actor", None)
    if actor is not None:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


def keep_lease_until_workers_end(lease: Lease, stale_s: float, wait_s: float = WORKERS_END_WAIT_S) -> None:
    """After a stop at once: the run's lease goes (at the end of `hold`) once Ray Train's workers have ended. Where
    they are not seen to end (in `wait_s`, or the wait cut by another Ctrl-C, or the cluster not answering), the
    lease is left rather than freed: an object store's expires in `stale_s`, so that no other run writes beside
    workers that may still write (a local lock is the kernel's to free as the process ends)."""
    try:
        ended = workers_ended(wait_s)
    except KeyboardInterrupt:  # another Ctrl-C: not waited for
        ended = False
    if ended:
        return
    left = lease.leave()
    print(f"[raydiff] the run's workers were not seen to end (waited up to {wait_s:g} s)"
          + (f": its lease is left to expire (run.lease_stale_s = {stale_s:g} s) so that no other run writes beside "
             f"them" if left else ": they may still write to the run directory for a moment"), flush=True)


def workers_ended(wait_s: float = WORKERS_END_WAIT_S) -> bool:
    """Whether this job's Ray Train workers have all ended, waiting up to `wait_s` (after `end_controller`): until
    then rank 0 may still be writing a checkpoint, and the run's lease must not go to another driver. For a job
    of one run (a sweep's trials share theirs)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            running = workers_running()
        except Exception:  # noqa: BLE001 - the cluster does not answer: nothing says the workers have ended
            return False
        if not running or time.monotonic() > deadline:
            return not running
        time.sleep(0.1)


def workers_running() -> list[int]:
    """The process ids of this job's Ray Train workers that have not ended: alive in the cluster's actor table, or
    marked dead there in the last minute while their process, on this machine, still runs (a kill takes a moment
    to land; an older one's pid may be another process's by now)."""
    from ray._private.state import state as gcs_state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    here, now_ms = ray.get_runtime_context().get_node_id(), time.time() * 1000

    def running(actor: dict[str, Any]) -> bool:
        if actor["State"] != "DEAD":
            return True
        return actor["Address"]["NodeID"] == here and now_ms - actor["EndTime"] < 60_000 and process_runs(actor["Pid"])

    return [actor["Pid"] for actor in gcs_state.actor_table(None, job_id=job).values()
            if actor["ActorClassName"].rsplit(".", 1)[-1] == RAY_TRAIN_WORKER and running(actor)]


def stop_reason(flag) -> str | None:
    """The stop request the driver received, or None (also when the flag cannot be reached: keep training)."""
    return None if flag is None else _ask(flag, "reason", None)


def _workers(flag) -> tuple[str | None, bool]:
    """The flag's (controller state, whether a group has run); ("unknown", True) where it does not answer: the stop
    goes on as asked."""
    return _ask(flag, "workers", ("unknown", True))


@contextlib.contextmanager
def stop_on_signals(flag, lease: Lease | None = None) -> Iterator[dict[str, Any]]:
    """While active, SIGTERM and the first SIGINT ask the run to stop with a final checkpoint (the yielded dict
    gets the signal's name, "signal"); a second SIGINT raises KeyboardInterrupt. While no worker group runs
    (`NO_WORKERS`: when the signal comes, or later, a group lost before it wrote the checkpoint) the dict gets
    "at_once" (whether that is before training), and `stop_at_once` raises in the main thread. The loss of `lease`
    (another driver took the run over, now or before) is such a stop too, without a checkpoint: the workers stop
    at their next look at the flag, and while none runs, at once ("lease_lost"). Only in the main thread (a Tune
    trial runs elsewhere and is stopped by Tune)."""
    received: dict[str, Any] = {"signal": None, "at_once": None, "lease_lost": False}
    if not in_main_thread():
        yield received
        return
    wake, closed = threading.Event(), threading.Event()

    def forward() -> None:  # Ray calls from a helper thread, not from inside the signal handler
        wake.wait()
        name = received["signal"]
        if closed.is_set():
            return
        if name:
            flag.request.remote(name)  # also for a group placed after all, before the command has ended
        state, ran = _workers(flag)
        if name and not received["lease_lost"] and state not in NO_WORKERS:
            again = " (Ctrl-C again to stop at once)" if name == "SIGINT" else ""  # a SIGTERM's stop is kept
            print(f"[raydiff] {name}: stopping after a final checkpoint{again}", flush=True)
        while state not in NO_WORKERS:  # a group that goes (a preemption comes with a SIGTERM) writes nothing
            if closed.wait(STATE_POLL_S):
                return
            state, ran = _workers(flag)
        placing = _PLACING.get(state or "", "is placing one")
        why = "the run's lease was taken over" if received["lease_lost"] else name
        said = "stopping at once" if received["lease_lost"] else "nothing to checkpoint, stopping at once"
        print(f"[raydiff] {why}: no worker group runs (Ray Train {placing}): {said}", flush=True)
        received["at_once"] = not ran

    def handler(signum, frame) -> None:
        name = signal.Signals(signum).name
        if received["signal"] == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if received["signal"] is not None:  # the stop already asked for: nothing new to say
            return
        received["signal"] = name
        wake.set()

    def lost() -> None:  # from the lease's heartbeat thread, or as it is set where it was lost before
        flag.request.remote(LEASE_LOST)
        received["lease_lost"] = True
        wake.set()

    forwarder = threading.Thread(target=forward, daemon=True, name="raydiff-stop")
    forwarder.start()
    if lease is not None:
        lease.on_lost = lost  # it still tells the flag after the block (the driver asks it then)
    try:
        with signal_handlers({signal.SIGTERM: handler, signal.SIGINT: handler}):
            yield received
    finally:
        closed.set()
        wake.set()


def stop_at_once(received: dict[str, Any]) -> None:
    """In the main thread, within `stop_on_signals`: raise `Interrupted` where its watcher found no worker group
    to stop (before training, or with the newest checkpoint to continue from). A lost lease is the caller's to
    raise (`received["lease_lost"]`): it names the run."""
    if received["at_once"] is None or received["lease_lost"]:
        return
    note = "" if received["at_once"] else "no worker group was running: the same command continues the run, from " \
                                           "its newest checkpoint"
    raise_interrupted(signal.Signals[received["signal"]].value, received["at_once"], note=note)


def beside_the_handlers(call: Callable[[], T], poll: Callable[[], None] | None = None) -> T:
    """`call()`, run in a helper thread while the main thread waits, so that it cannot replace the main thread's
    signal handlers (only the main thread can install one). Ray Train's `fit()` installs a SIGINT handler of its
    own that aborts the run: the workers are killed without a final checkpoint and the command exits 1 with
    nothing printed. The main thread's wait is interrupted by signals, so raydiff's handlers still run, and a
    second Ctrl-C still stops at once (the helper thread is a daemon: it does not hold the process). `poll`, called
    in the main thread every STATE_POLL_S / 5 while it waits, may raise to stop waiting (`stop_at_once`)."""
    if not in_main_thread():
        return call()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # re-raised in the main thread  # noqa: BLE001
            outcome["error"] = exc

    helper = threading.Thread(target=run, daemon=True, name="raydiff-fit")
    helper.start()
    while helper.is_alive():
        helper.join(STATE_POLL_S / 5)
        if poll is not None and helper.is_alive():  # a result that came meanwhile stands
            poll()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def noting_tune_interrupt() -> Iterator[dict[str, str | None]]:
    """While active, a Ctrl-C or SIGTERM that ends a Ray Tune sweep is noted in the yielded dict ("signal").
    Tune's SIGINT handler saves its state and ends the sweep, then warns "... Resume experiment with:
    Tuner.restore(...)", a Python call where running the same command again is what continues it: that warning
    is noted and dropped (the command says what to do). Tune has no SIGTERM handler (`ray job stop`, schedulers):
    SIGTERM is passed on to Tune's as a SIGINT, so that Tune saves its state too; a second SIGTERM (after
    SAME_SIGTERM_S) stops at once (`Interrupted`), as a second Ctrl-C does. Tune leaves its handler installed after
    a sweep; the ones before come back."""
    received: dict[str, str | None] = {"signal": None}
    terminated_at: float | None = None  # when the first SIGTERM came
    tune_log = logging.getLogger("ray.tune.tune")

    def note(record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(TUNE_INTERRUPTED):
            received["signal"] = "SIGTERM" if terminated_at is not None else "SIGINT"
            return False
        return True

    def as_ctrl_c(signum, frame) -> None:
        nonlocal terminated_at
        if terminated_at is not None:
            if time.monotonic() - terminated_at < SAME_SIGTERM_S:  # the same request, to the command and its group
                return
            raise_interrupted(signum, before_training=False)  # as a second Ctrl-C does, naming the signal
        terminated_at = time.monotonic()
        if signal.getsignal(signal.SIGINT) is keep_sigint:  # Tune's fit() has not installed its handler yet
            raise_interrupted(signum, before_training=False)  # as the command's own SIGTERM handler does
            return  # the same request as a SIGTERM that raised just before
        signal.raise_signal(signal.SIGINT)  # Tune's handler

    # SIGINT keeps its handler until Tune replaces it, and gets it back after.
    keep_sigint = signal.getsignal(signal.SIGINT) if in_main_thread() else None
    tune_log.addFilter(note)
    try:
        with signal_handlers({signal.SIGTERM: as_ctrl_c, signal.SIGINT: keep_sigint}):
            yield received
    finally:
        tune_log.removeFilter(note)
