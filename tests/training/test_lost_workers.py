"""A lost worker is said in one line: which worker, how (died, hung, preempted, unreachable, or an error of its
own), and what comes of it, counted as Ray Train counts failures against run.max_failures; the tracebacks a loss
sets off (the survivors' collectives, the controller's shutdown warnings) and those of storage that kept failing
beyond its retries are left out, every other error's kept.
Through a real run (a killed and a stopped worker): tests/runs/test_fault_tolerance.py."""

from __future__ import annotations

import logging
import os

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.train.v2._internal.constants import get_env_vars_to_propagate
from ray.train.v2._internal.exceptions import (
    BroadcastCollectiveTimeoutError,
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)
from torch.distributed import DistBackendError

from raydiff.training.lost_workers import (
    HEALTH_CHECK_ENV,
    POLL_ENV,
    SHUTDOWN_ENV,
    TRAIN_COLLECTIVE_ENV,
    LostWorkers,
    causes,
    hang_timeouts,
    quiet_tracebacks_said_in_a_line,
)

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/{}]"
PEER_CLOSED = RuntimeError(GLOO.format("pair.cc:561") + " Connection closed by peer [127.0.0.1]:5047. This is "
                           "typically caused by a remote worker crashing.")
TIMED_OUT = RuntimeError(GLOO.format("unbound_buffer.cc:78") + " Timed out waiting 15000ms for recv operation to "
                         "complete")
THROTTLED = OSError("When getting information for key 'runs/smoke/checkpoint_00000015' in bucket 'flaky': AWS Error "
                    "UNKNOWN (HTTP status 503) during HeadObject operation: No response body.")
HUNG = WorkerHealthCheckTimeoutError("A worker health check has been hanging for 15.20 seconds.")
DIED = WorkerHealthCheckFailedError("poll failed", ActorDiedError())
# What NCCL raises where it raises at all (its own error text, in torch's DistBackendError).
NCCL_PEER_EXITED = DistBackendError("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, "
                                    "remote process exited or there was a network error, NCCL version 2.27.5\n"
                                    "ncclRemoteError: A call failed possibly due to a network error or a remote "
                                    "process exiting prematurely.")
NCCL_TIMED_OUT = DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
                                  "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=15000) ran for 15001 "
                                  "milliseconds before timing out.")


def test_the_lost_worker_is_named_not_the_collectives_it_broke():
    assert causes({0: PEER_CLOSED, 1: DIED}, 15) == [
        "worker 1's process ended (killed, out of memory, or its node was lost)"]
    assert causes({0: TIMED_OUT, 1: HUNG}, 15) == ["worker 1 stopped answering for 15 s (scaling.hang_timeout_s)"]
    assert causes({1: WorkerHealthCheckFailedError("poll failed", RayActorError(preempted=True))}, 15) == [
        "worker 1's node was preempted"]
    assert causes({2: WorkerHealthCheckFailedError("poll failed", ActorUnavailableError("x", b"a" * 16))}, 15) == [
        "worker 2 could not be reached (its node or network)"]


def test_a_collective_that_timed_out_alone_says_a_worker_hangs():
    # The hung worker's process still answers (its training thread waits on storage, say): only the collective
    # that it never joined times out.
    assert causes({0: TIMED_OUT}, 15) == [
        "worker 0 waited 15 s (scaling.hang_timeout_s) for a worker that never joined its collective (a hung "
        "worker)"]
    assert causes({0: BroadcastCollectiveTimeoutError(15.1, [1], 15)}, 15) == causes({0: TIMED_OUT}, 15)
    # As Ray Train sometimes passes it on: the error of the task that broadcast a report, wrapping the timeout.
    wrapped = RayTaskError("SynchronizationActor.broadcast_from_rank_zero", "Traceback ...",
                           BroadcastCollectiveTimeoutError(15.1, [1], 15))
    assert causes({0: wrapped}, 15) == causes({0: TIMED_OUT}, 15)
    assert causes({0: PEER_CLOSED}, 15) == ["worker 0 lost its connection to another worker"]


def test_under_nccl_the_ended_processes_are_one_phrase_that_says_nccl_may_have_ended_them():
    # NCCL's watchdog ends the process of each survivor whose collective lost its peer or timed out (Ray Train sets
    # TORCH_NCCL_ASYNC_ERROR_HANDLING): the worker that hung may be the one still running, so no rank is blamed.
    assert causes({0: DIED, 2: DIED, 3: DIED}, 15, nccl=True) == [
        "workers 0, 2 and 3's processes ended (killed, out of memory or their node lost; or ended by NCCL when a "
        "collective lost another worker or waited 15 s for a hung one, scaling.hang_timeout_s)"]
    assert causes({1: DIED}, 15, nccl=True) == [
        "worker 1's process ended (killed, out of memory or its node lost; or ended by NCCL when a collective lost "
        "another worker or waited 15 s for a hung one, scaling.hang_timeout_s)"]
    assert causes({0: DIED, 1: DIED}, 15) == [
        "workers 0 and 1's processes ended (killed, out of memory, or their node was lost)"]
    # A preempted node is named first, however many processes ended beside it and whatever their ranks.
    preempted = WorkerHealthCheckFailedError("poll failed", RayActorError(preempted=True))
    assert causes({0: DIED, 1: DIED, 5: preempted}, 15, nccl=True) == [
        "worker 5's node was preempted",
        "workers 0 and 1's processes ended (killed, out of memory or their node lost; or ended by NCCL when a "
        "collective lost another worker or waited 15 s for a hung one, scaling.hang_timeout_s)"]


def test_what_nccl_raises_when_a_peer_is_lost_is_the_aftermath_not_the_cause():
    assert causes({0: NCCL_PEER_EXITED, 1: DIED}, 15, nccl=True)[0].startswith("worker 1's process ended")
    assert causes({0: NCCL_PEER_EXITED}, 15, nccl=True) == ["worker 0 lost its connection to another worker"]
    assert causes({0: NCCL_TIMED_OUT}, 15, nccl=True) == causes({0: TIMED_OUT}, 15)
    aborted = DistBackendError("NCCL communicator was aborted on rank 3.")
    assert causes({3: aborted, 1: ValueError("bad pixel")}, 15, nccl=True) == ["worker 1 raised ValueError: bad pixel"]
    # Any other NCCL error is the worker's own.
    assert causes({0: DistBackendError("NCCL error in: x.cpp:1, invalid usage")}, 15, nccl=True) == [
        "worker 0 raised DistBackendError: NCCL error in: x.cpp:1, invalid usage"]


def test_an_error_of_a_workers_own_is_named_with_its_first_line():
    assert causes({0: ValueError("bad pixel\nmore"), 1: PEER_CLOSED}, 60) == ["worker 0 raised ValueError: bad pixel"]


def test_storage_that_kept_failing_beyond_its_retries_is_named_as_such_and_a_permanent_error_as_raised():
    assert causes({0: THROTTLED, 1: PEER_CLOSED}, 60) == [
        f"worker 0's storage kept failing beyond its retries (OSError: {THROTTLED})"]
    denied = OSError("When getting information for key 'runs/smoke' in bucket 'b': AWS Error ACCESS_DENIED during "
                     "HeadObject operation: HTTP status 503")  # what a retry cannot fix wins
    assert causes({0: denied}, 60) == [f"worker 0 raised OSError: {denied}"]
    assert causes({0: ValueError("HTTP status 503")}, 60) == ["worker 0 raised ValueError: HTTP status 503"]


def test_each_failure_says_what_comes_next_as_ray_train_counts_them(capsys):
    lost = LostWorkers(max_failures=1, hang_timeout_s=20)
    preempted = WorkerHealthCheckFailedError("poll failed", RayActorError(preempted=True))
    lost.after_exception(None, {0: PEER_CLOSED, 1: DIED})
    lost.after_exception(None, {0: ValueError("bad pixel"), 1: preempted})  # a preemption's, as Ray Train counts
    lost.after_exception(None, {0: TIMED_OUT, 1: HUNG})
    assert capsys.readouterr().out.splitlines() == [
        "[raydiff] worker 1's process ended (killed, out of memory, or its node was lost): restarting the workers "
        "from the newest checkpoint (failure 1 of at most 1, run.max_failures)",
        "[raydiff] worker 0 raised ValueError: bad pixel; worker 1's node was preempted: restarting the workers from "
        "the newest checkpoint (preemptions do not count against run.max_failures)",
        "[raydiff] worker 1 stopped answering for 20 s (scaling.hang_timeout_s): no restarts left (run.max_failures "
        "= 1): the run ends"]
    unlimited = LostWorkers(max_failures=-1, hang_timeout_s=20)
    unlimited.after_exception(None, {1: DIED})
    assert "(failure 1 of at most any, run.max_failures)" in capsys.readouterr().out


def test_a_preemption_is_said_once_while_ray_train_waits_it_out_and_each_new_one_again(capsys):
    """While Ray Train waits out a preemption's grace window it polls the workers again and again, and calls the
    callback with each poll's errors: the same preempted worker's actor each time."""
    def preempted(actor_id):
        return WorkerHealthCheckFailedError("poll failed", RayActorError(actor_id=actor_id, preempted=True))
    lost = LostWorkers(max_failures=0, hang_timeout_s=20)
    for _ in range(3):
        lost.after_exception(None, {1: preempted("a1")})
    lost.after_exception(None, {0: PEER_CLOSED, 1: preempted("a1")})  # a survivor's aftermath meanwhile
    lost.after_exception(None, {0: ValueError("bad pixel"), 1: preempted("a1")})  # an error of its own: said
    lost.after_exception(None, {1: preempted("b1")})  # the restarted group's worker 1, preempted too
    lost.after_exception(None, {0: preempted(None), 1: preempted("b1")})  # an actor Ray's error does not name
    lines = capsys.readouterr().out.splitlines()
    preemption = ("[raydiff] worker 1's node was preempted: restarting the workers from the newest checkpoint "
                  "(preemptions do not count against run.max_failures)")
    assert lines == [preemption, "[raydiff] worker 0 raised ValueError: bad pixel; worker 1's node was preempted: "
                     "restarting the workers from the newest checkpoint (preemptions do not count against "
                     "run.max_failures)", preemption,
                     "[raydiff] worker 0's node was preempted; worker 1's node was preempted: restarting the workers "
                     "from the newest checkpoint (preemptions do not count against run.max_failures)"]
    assert lost.failures == 0


def _shown(logger_name: str, message: str) -> bool:
    """Whether the filters of the logger pass a warning of `message` (its level aside: other tests, and Ray in
    this process, may have set it)."""
    record = logging.LogRecord(logger_name, logging.WARNING, __file__, 0, message, None, None)
    return bool(logging.getLogger(logger_name).filter(record))


def _training_error(last_line: str) -> str:
    return ("Error in training function:\nTraceback (most recent call last):\n  File \"loop.py\", line 48, in "
            f"train_worker\n    result = optimizer_step(...)\n{last_line}\n")


def test_a_workers_traceback_of_a_collective_that_lost_its_peer_is_left_out_and_any_other_shown():
    util = "ray.train.v2._internal.util"
    quiet_tracebacks_said_in_a_line()
    quiet_tracebacks_said_in_a_line()  # once per process, however often a worker starts
    assert len(logging.getLogger(util).filters) == 1
    assert not _shown(util, _training_error(f"RuntimeError: {PEER_CLOSED}"))
    assert not _shown(util, _training_error(f"RuntimeError: {TIMED_OUT}"))
    assert not _shown(util, _training_error(f"torch.distributed.DistBackendError: {NCCL_PEER_EXITED}"))
    assert not _shown(util, _training_error(f"torch.distributed.DistBackendError: {NCCL_TIMED_OUT}"))
    assert not _shown(util, _training_error("ray.train.v2._internal.exceptions.BroadcastCollectiveTimeoutError: "
                                            "The collective operation timed out after 15.10 seconds."))
    assert _shown(util, _training_error("ValueError: bad pixel"))
    # A peer's loss that caused another error, which is what the worker ended in: shown.
    assert _shown(util, _training_error(f"RuntimeError: {PEER_CLOSED}\n\nDuring handling of the above exception, "
                                        f"another exception occurred:\n\nKeyError: 'loss'"))
    assert _shown(util, "Something else: RuntimeError: Connection closed by peer")
    # An object store's error that outlasted its retries: the controller's line names it.
    assert not _shown(util, _training_error(f"OSError: {THROTTLED}"))
    assert not _shown(util, _training_error("OSError: When reading information for key 'runs/smoke/state.pt' in "
                                            "bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject operation: "
                                            "curlCode: 28, Timeout was reached"))
    assert _shown(util, _training_error("OSError: [Errno 28] No space left on device: '/runs/smoke'"))
    assert _shown(util, _training_error("ValueError: AWS Error UNKNOWN (HTTP status 503)"))
    # A report's barrier that died with the run's controller (a sweep stopped by SIGTERM, as CI once saw): the driver
    # says why the run ended. The same barrier dead for another reason, or another actor, shows.
    assert not _shown(util, _training_error(_BARRIER_DIED.format(actor="SynchronizationActor", why=_OWNER_DIED)))
    assert _shown(util, _training_error(_BARRIER_DIED.format(actor="SynchronizationActor", why="out of memory")))
    assert _shown(util, _training_error(_BARRIER_DIED.format(actor="StopFlag", why=_OWNER_DIED)))


_OWNER_DIED = ("The actor is dead because its owner has died. Owner Id: 0985d759 Owner Ip address: 127.0.0.1 Owner "
               "worker exit type: INTENDED_SYSTEM_EXIT Worker exit detail: Owner's worker process has crashed.")
_BARRIER_DIED = ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
                 "\tclass_name: {actor}\n\tactor_id: 5741c25b\n\tpid: 15092\n\tnamespace: 5e9d8a7f\n"
                 "\tip: 127.0.0.1\n{why}\n")


def test_the_controllers_shutdown_warnings_are_left_out_and_its_wait_cut_once_a_failure_is_said(capsys,
                                                                                                    monkeypatch):
    monkeypatch.delenv(SHUTDOWN_ENV, raising=False)
    backend, torch_config = "ray.train.v2._internal.callbacks.backend_setup", "ray.train.torch.config"
    graceful = "Graceful shutdown of backend failed. This is expected if one of the workers has crashed."
    for name in (backend, torch_config):
        for f in list(logging.getLogger(name).filters):
            logging.getLogger(name).removeFilter(f)
    assert _shown(backend, graceful)
    LostWorkers(max_failures=3, hang_timeout_s=20).after_exception(None, {1: DIED})
    assert not _shown(backend, graceful)
    assert not _shown(torch_config, "Torch process group shutdown timed out after 30 seconds")
    assert _shown(backend, "Another warning")
    assert os.environ[SHUTDOWN_ENV] == "5"  # Ray's 30 s, all of it spent waiting for a hung worker
    monkeypatch.setenv(SHUTDOWN_ENV, "60")
    LostWorkers(max_failures=3, hang_timeout_s=20).after_exception(None, {1: DIED})
    assert os.environ[SHUTDOWN_ENV] == "60"  # the cluster's own setting is kept


@pytest.mark.parametrize("seconds, torch_timeout_s, env", [(1800.0, 1800, "1800"), (12.5, 13, "12.5")])
def test_the_hang_timeout_is_every_timeout_ray_train_has(seconds, torch_timeout_s, env, monkeypatch):
    monkeypatch.delenv(POLL_ENV, raising=False)
    assert hang_timeouts(seconds) == (torch_timeout_s, {HEALTH_CHECK_ENV: env, TRAIN_COLLECTIVE_ENV: env,
                                                        POLL_ENV: "0.5"})


def test_the_controller_polls_its_workers_every_half_second_unless_the_command_says_otherwise(monkeypatch):
    """Ray Train's controller takes the interval from the environment of the driver that starts the run (its
    default, 2 s, is paid up to twice at the end of every worker group)."""
    monkeypatch.delenv(POLL_ENV, raising=False)
    for name, value in hang_timeouts(1800)[1].items():
        monkeypatch.setenv(name, value)  # as the driver sets them
    assert get_env_vars_to_propagate()[POLL_ENV] == "0.5"
    monkeypatch.setenv(POLL_ENV, "3")
    assert hang_timeouts(1800)[1][POLL_ENV] == "3"
