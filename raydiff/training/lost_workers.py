"""A worker that dies, hangs or is preempted: one line says which, and what happens next.

Why: Ray Train restarts the workers from the newest checkpoint when one is lost, which is what a long run needs,
but says nothing of it in a run that goes on. What reaches the terminal is what the loss sets off: the surviving
workers' tracebacks (their all-reduce lost its peer) and the controller's (it could not shut the lost worker's
process group down), dozens of lines that read as a crash. A hung worker shows nothing at all until a timeout, which
was Ray's own (10 minutes for a stopped process, 30 for a collective, none for `ray.train.report`).

So: `LostWorkers`, a Ray Train callback in the controller, says each failure in one line (the lost worker and
why, then a restart from the newest checkpoint or the end of the run, counted as Ray Train counts it against
`run.max_failures`), and from then on leaves out the controller's own warnings about the shutdown, which it
shortens (a hung worker cannot take part in it).
`quiet_tracebacks_said_in_a_line` leaves out, in a worker, the traceback of a collective that failed only because
a peer was lost, and that of an object store's error that outlasted the storage's retries (a 503, a timeout: the
line names it; its traceback shows pyarrow's insides), and that of a report whose checkpoint barrier died with the
run's controller (a sweep stopped, a run cancelled: the driver says so). Every other error, and its traceback,
still shows.
`scaling.hang_timeout_s` is the one time after which a silent worker counts as lost (`hang_timeouts`).

On GPUs (NCCL) a loss reads otherwise: Ray Train sets `TORCH_NCCL_ASYNC_ERROR_HANDLING`, so NCCL's watchdog ends
the process of a worker whose collective lost its peer or waited past the timeout, rather than raising in it. The
survivors' processes end too, and the worker that hung may be the one still running: the line says so, naming
all of the ended processes in one phrase, rather than blaming the first two as lost in their own right.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import ray.train
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.train.v2._internal.exceptions import (
    BroadcastCollectiveTimeoutError,
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)

from raydiff.cluster.worker_output import EXCEPTION_LINE
from raydiff.storage.errors import retryable_in

# Ray Train reads these in its controller (propagated from the driver's environment when a run starts).
HEALTH_CHECK_ENV = "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"  # a worker process that does not answer
TRAIN_COLLECTIVE_ENV = "RAY_TRAIN_COLLECTIVE_TIMEOUT_S"  # ray.train.report's barrier
# How long the controller waits for the workers to shut their process group down before it stops them: 30 s by
# default, all of it spent on a hung worker, which cannot answer. Once a worker is lost the rest need under that.
SHUTDOWN_ENV, SHUTDOWN_AFTER_A_LOSS_S = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "5"
# How often the controller asks each worker how it is (one small actor call): 2 s by default. Every worker group
# paid up to two of those waits after its workers returned before `fit` did, a lost worker was noticed as late,
# and a second `ray.train.report` within the interval waited for the first to be taken.
POLL_ENV, POLL_INTERVAL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"

# What a collective raises in a worker whose peer was lost, or never came (gloo; its source's file and line vary).
PEER_LOST = re.compile(r"^RuntimeError: \[\S*gloo\S*\] (?:Connection closed by peer|Read error \S*: Connection "
                       r"reset by peer|Timed out waiting \d+ms for (?:recv|send) operation to complete)")
# Where NCCL raises instead (a collective called after its communicator was aborted, or with blocking waits).
# In a traceback its last line may be NCCL's detail (a second line of the message, read as an exception's).
NCCL_PEER_LOST = re.compile(r"^(?:(?:[\w.]*\.)?DistBackendError: .*(?:remote process exited|NCCL communicator was "
                            r"aborted|Watchdog caught collective operation timeout)|ncclRemoteError: )")
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout")
_TRAINING_ERROR = "Error in training function:"  # Ray Train's record of a worker's exception, traceback included
# The controller's warnings when it shuts down a worker group that lost a worker (each with its own traceback).
_SHUTDOWN_WARNINGS = {"ray.train.v2._internal.callbacks.backend_setup": "Graceful shutdown of backend failed",
                      "ray.train.torch.config": "Torch process group shutdown timed out"}


def hang_timeouts(hang_timeout_s: float) -> tuple[int, dict[str, str]]:
    """`scaling.hang_timeout_s` as Ray Train takes it: the torch process group's timeout (every all-reduce and
    broadcast), and the environment of the driver that starts the run (a worker that stops answering,
    `ray.train.report`'s barrier), with the controller's poll of the workers."""
    seconds = f"{hang_timeout_s:g}"
    return math.ceil(hang_timeout_s), {HEALTH_CHECK_ENV: seconds, TRAIN_COLLECTIVE_ENV: seconds,
                                       POLL_ENV: os.environ.get(POLL_ENV, POLL_INTERVAL_S)}  # a user's own is kept


def lost_peer(traceback_text: str) -> bool:
    """Whether a worker's traceback ends in a collective that failed because another worker was lost."""
    last = _last_exception(traceback_text)
    return last is not None and (PEER_LOST.match(last) is not None or NCCL_PEER_LOST.match(last) is not None
                                 or last.split(":")[0].endswith(BroadcastCollectiveTimeoutError.__name__))


def storage_outlasted_retries(traceback_text: str) -> bool:
    """Whether a worker's traceback ends in an object store's error that a retry can fix (pyarrow raises OSError),
    which outlasted the storage filesystem's retries."""
    last = _last_exception(traceback_text)
    return last is not None and last.startswith("OSError: ") and retryable_in(last)


def barrier_died_with_the_controller(traceback_text: str) -> bool:
    """Whether a worker's traceback ends in `ray.train.report`'s barrier (Ray Train's SynchronizationActor) that
    died because its owner, the run's controller, did: the run was being stopped or had failed, which the driver
    says; the worker can say nothing more."""
    last = _last_exception(traceback_text)
    return (last is not None and last.split(":")[0].endswith(ActorDiedError.__name__)
            and "class_name: SynchronizationActor" in traceback_text and "because its owner has died" in traceback_text)


def _last_exception(traceback_text: str) -> str | None:
    lines = [line for line in traceback_text.splitlines() if EXCEPTION_LINE.match(line)]
    return lines[-1] if lines else None


class _DropRecords(logging.Filter):
    """Leaves out the records of one logger that `drop` says are aftermath."""

    def __init__(self, drop) -> None:
        super().__init__()
        self._drop = drop

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._drop(record.getMessage())


def _drop_records(logger_name: str, drop) -> None:
    """From now on in this process, the records of one logger that `drop` says are aftermath are left out (the
    filter installed once, however often this is called)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropRecords) for f in logger.filters):
        logger.addFilter(_DropRecords(drop))


def quiet_tracebacks_said_in_a_line() -> None:
    """In a worker: Ray Train's record of an exception whose traceback ends in a collective that lost its peer, or
    in an object store's error that outlasted its retries, is left out (the controller's line says which worker,
    and why), as is one whose report's barrier died with the controller (the driver's line says why the run
    ended). Any other exception's record shows."""
    _drop_records("ray.train.v2._internal.util",
                  lambda m: m.startswith(_TRAINING_ERROR) and (lost_peer(m) or storage_outlasted_retries(m)
                                                               or barrier_died_with_the_controller(m)))


def describe(rank: int, error: BaseException, hang_timeout_s: float) -> tuple[str, str]:
    """(kind, what happened to worker `rank`), from the error Ray Train's controller has for it: kind is `lost`
    (hung, preempted, unreachable), `ended` (its process ended: `ended_processes` says it), `raised` (an error of
    its own) or `aftermath` (a collective that failed because another worker was lost)."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        error = error.cause  # a task's error as Ray Train may pass it on (the broadcast of a report that timed out)
    if isinstance(error, WorkerHealthCheckTimeoutError):
        return "lost", f"worker {rank} stopped answering for {hang_timeout_s:g} s (scaling.hang_timeout_s)"
    if isinstance(error, WorkerHealthCheckFailedError):
        if _preempted(error):
            return "lost", f"worker {rank}'s node was preempted"
        if isinstance(error.health_check_failure, ActorUnavailableError):
            return "lost", f"worker {rank} could not be reached (its node or network)"
        return "ended", f"worker {rank}"
    first = (str(error).strip().splitlines() or [""])[0]
    said = f"{type(error).__name__}: {first}"
    if storage_outlasted_retries(said):
        return "raised", f"worker {rank}'s storage kept failing beyond its retries ({said})"
    if not lost_peer(said):
        return "raised", f"worker {rank} raised {said}"
    if isinstance(error, BroadcastCollectiveTimeoutError) or _TIMED_OUT.search(said):
        return "aftermath", (f"worker {rank} waited {hang_timeout_s:g} s (scaling.hang_timeout_s) for a worker that "
                             f"never joined its collective (a hung worker)")
    return "aftermath", f"worker {rank} lost its connection to another worker"


def ended_processes(ranks: list[int], hang_timeout_s: float, *, nccl: bool) -> str:
    """The workers whose processes ended, in one phrase. Under NCCL that is also what becomes of the survivors of a
    loss (its watchdog ends them), so it cannot say which of them, if any, went first."""
    if len(ranks) == 1:
        who, whose, node = f"worker {ranks[0]}", "process", "its node"
    else:
        who, whose, node = f"workers {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}", "processes", "their node"
    why = f"killed, out of memory, or {node} was lost"
    if nccl:
        why = (f"killed, out of memory or {node} lost; or ended by NCCL when a collective lost another worker or "
               f"waited {hang_timeout_s:g} s for a hung one, scaling.hang_timeout_s")
    return f"{who}'s {whose} ended ({why})"


def _preempted(error: BaseException) -> bool:
    """Whether a worker died because its node was preempted (Ray Train's own test)."""
    died = error.health_check_failure if isinstance(error, WorkerHealthCheckFailedError) else error
    return isinstance(died, RayActorError) and died.preempted


def _preempted_actor(error: BaseException) -> str | None:
    """The actor (hex id) of a preempted worker, where Ray's error names it."""
    died = error.health_check_failure if isinstance(error, WorkerHealthCheckFailedError) else error
    return getattr(died, "actor_id", None)


_ORDER = {"lost": 0, "raised": 0, "ended": 1, "aftermath": 2}  # ended processes may be the aftermath (NCCL)


def causes(worker_exceptions: Mapping[int, BaseException], hang_timeout_s: float, *, nccl: bool = False) -> list[str]:
    """What failed, worker by worker: the lost workers and those that raised errors of their own, not the
    collectives that failed because of them (unless nothing else is known); two at most, the workers whose
    processes ended counting as one. `nccl`: the workers' collectives are NCCL's (GPUs)."""
    said = [(rank, *describe(rank, error, hang_timeout_s)) for rank, error in sorted(worker_exceptions.items())]
    lines = [(kind, what) for _, kind, what in said if kind != "ended"]
    ended = [rank for rank, kind, _ in said if kind == "ended"]
    if ended:
        lines.append(("ended", ended_processes(ended, hang_timeout_s, nccl=nccl)))
    lines.sort(key=lambda line: _ORDER[line[0]])
    return ([what for kind, what in lines if kind != "aftermath"] or [what for _, what in lines])[:2]


class LostWorkers(ray.train.UserCallback):
    """Says, from Ray Train's controller, each failure of the worker group in one line, and what comes of it."""

    def __init__(self, *, max_failures: int, hang_timeout_s: float, nccl: bool = False) -> None:
        self.max_failures = max_failures
        self.hang_timeout_s = hang_timeout_s
        self.nccl = nccl
        self.failures = 0  # as Ray Train counts them against max_failures: preemptions apart
        # The preempted workers' actors already said: Ray Train polls them again, and calls this again with each
        # poll, while it waits out a preemption's grace window.
        self._preemptions_said: set[str] = set()

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        # As Ray Train counts: a preemption among the errors makes the failure a preemption's.
        preempted_actors = [_preempted_actor(error) for error in worker_exceptions.values() if _preempted(error)]
        preempted = bool(preempted_actors)
        if preempted and all(actor in self._preemptions_said for actor in preempted_actors) and all(
                _preempted(error) or describe(rank, error, self.hang_timeout_s)[0] == "aftermath"
                for rank, error in worker_exceptions.items()):
            return  # said at an earlier poll of the same wait, and nothing new beside it
        self._preemptions_said.update(actor for actor in preempted_actors if actor is not None)
        said = causes(worker_exceptions, self.hang_timeout_s, nccl=self.nccl)
        if not preempted:
            self.failures += 1
        if preempted:
            next_ = "restarting the workers from the newest checkpoint (preemptions do not count against " \
                    "run.max_failures)"
        elif self.max_failures == -1 or self.failures <= self.max_failures:
            next_ = (f"restarting the workers from the newest checkpoint (failure {self.failures} of at most "
                     f"{'any' if self.max_failures == -1 else self.max_failures}, run.max_failures)")
        else:
            next_ = f"no restarts left (run.max_failures = {self.max_failures}): the run ends"
        print(f"[raydiff] {'; '.join(said)}: {next_}", flush=True)
        _quiet_shutdown_warnings()
        os.environ.setdefault(SHUTDOWN_ENV, SHUTDOWN_AFTER_A_LOSS_S)  # read by the shutdown that follows


def _quiet_shutdown_warnings() -> None:
    """In the controller, once a failure is said: its warnings that it could not shut the lost group's process
    group down (the lost worker cannot answer) are left out, with their tracebacks."""
    for name, start in _SHUTDOWN_WARNINGS.items():
        _drop_records(name, lambda message, start=start: message.startswith(start))
