"""Stopping cleanly: before training a signal stops the command at once; during training the first SIGTERM or
Ctrl-C asks the run for a final checkpoint (once, said once, whatever follows) and a second Ctrl-C stops at once;
a sweep stops at once on a second SIGTERM, not on the same one sent twice (`timeout`); the handlers that were
there before come back; Ray Train's fit() runs beside them, where it cannot replace them. The whole path, through
a real run: tests/test_jobs.py (SIGTERM), tests/test_train.py (Ctrl-C) and tests/cluster/test_start.py (SIGTERM to
a local run's process group)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from raydiff.storage.lease import Lease
from raydiff.storage.rundir import RunInUse
from raydiff.training import interrupts
from raydiff.training.interrupts import Interrupted, interrupt_on_signals
from raydiff.training.stop import (
    LEASE_LOST,
    SAME_SIGTERM_S,
    StopFlag,
    beside_the_handlers,
    end_controller,
    keep_lease_until_workers_end,
    noting_tune_interrupt,
    stop_at_once,
    stop_on_signals,
    taken_over,
    workers_ended,
)

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers live in the main thread")


class RecordingFlag:
    """The driver's StopFlag actor as the handler sees it: `flag.request.remote(reason)`."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.request = self
        self.remote = self.requests.append


def _handlers() -> tuple:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_a_signal_before_training_interrupts_at_once_and_the_old_handlers_come_back():
    before = _handlers()
    with pytest.raises(Interrupted) as stopped, interrupt_on_signals():
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)  # never reached
    assert stopped.value.signal == "SIGTERM"
    assert _handlers() == before


def test_the_first_signal_asks_for_one_final_checkpoint(capsys):
    flag, before = RecordingFlag(), _handlers()
    with stop_on_signals(flag) as received:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)  # after a SIGTERM: still the one stop already asked for
        deadline = time.monotonic() + 10
        while not flag.requests and time.monotonic() < deadline:
            time.sleep(0.01)
    assert received["signal"] == "SIGTERM" and flag.requests == ["SIGTERM"]
    assert capsys.readouterr().out.splitlines() == [
        "[raydiff] SIGTERM: stopping after a final checkpoint"]  # said once, and no Ctrl-C changes it
    assert _handlers() == before


def test_a_second_ctrl_c_stops_at_once():
    flag = RecordingFlag()
    with pytest.raises(KeyboardInterrupt), stop_on_signals(flag) as received:
        signal.raise_signal(signal.SIGINT)
        assert received["signal"] == "SIGINT"
        signal.raise_signal(signal.SIGINT)
        time.sleep(5)  # never reached


def test_a_sweep_passes_the_first_sigterm_to_tune_as_ctrl_c_and_stops_at_the_second():
    before, tune_saw = _handlers(), []
    with pytest.raises(Interrupted) as stopped, noting_tune_interrupt():
        signal.signal(signal.SIGINT, lambda signum, frame: tune_saw.append(signum))  # as Tune's fit() installs it
        signal.raise_signal(signal.SIGTERM)
        assert tune_saw == [signal.SIGINT]  # Tune saves its state and ends the sweep
        signal.raise_signal(signal.SIGTERM)  # at once: `timeout` signals the command, then its process group
        assert tune_saw == [signal.SIGINT]
        time.sleep(SAME_SIGTERM_S)
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)  # never reached
    assert stopped.value.signal == "SIGTERM" and not stopped.value.before_training  # "stopped by SIGTERM", 143
    assert tune_saw == [signal.SIGINT] and _handlers() == before


def test_a_sigterm_before_tune_s_handler_is_in_place_stops_the_sweep_command_as_a_sigterm(monkeypatch):
    """Passed on as a Ctrl-C to the handler before Tune's, it ended the command as "interrupted", exit 130."""
    monkeypatch.setattr(interrupts, "_raised", [])  # not the same request as another test's SIGTERM just before
    before = _handlers()
    with pytest.raises(Interrupted) as stopped, noting_tune_interrupt():
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)  # never reached
    assert stopped.value.signal == "SIGTERM" and not stopped.value.before_training  # "stopped by SIGTERM", 143
    assert _handlers() == before


def test_a_call_beside_the_handlers_runs_off_the_main_thread_and_signals_still_reach_them():
    """Ray Train's fit() replaces SIGINT's handler when it runs in the main thread; beside them it cannot, and a
    signal that arrives while the main thread waits for it still reaches raydiff's handler at once."""
    flag = RecordingFlag()

    def fit() -> str:
        assert threading.current_thread() is not threading.main_thread()
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while not flag.requests and time.monotonic() < deadline:  # the handler runs while the main thread waits
            time.sleep(0.01)
        return "result"

    with stop_on_signals(flag) as received:
        assert beside_the_handlers(fit) == "result"
    assert received["signal"] == "SIGINT" and flag.requests == ["SIGINT"]
    with pytest.raises(ZeroDivisionError):
        beside_the_handlers(lambda: 1 / 0)


def test_a_worker_group_lost_after_the_stop_was_asked_for_stops_the_run_at_once(monkeypatch, capsys):
    """A SIGTERM during training asks for a final checkpoint; if the group goes before it writes one (a preemption
    often comes with the SIGTERM), Ray Train waits for room for another, which would never see the request: the
    driver stops waiting at once, and says the newest checkpoint is where the same command continues."""
    from raydiff.training import stop

    states = iter([("RUNNING", True), ("RUNNING", True), ("RESTARTING", True)])
    monkeypatch.setattr(stop, "_workers", lambda flag: next(states, ("SCHEDULING", True)))
    monkeypatch.setattr(stop, "STATE_POLL_S", 0.05)
    flag = RecordingFlag()

    def fit() -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # Ray Train waiting for room
        return "never"

    with pytest.raises(Interrupted) as stopped, stop_on_signals(flag) as received:
        beside_the_handlers(fit, poll=lambda: stop.stop_at_once(received))
    assert flag.requests == ["SIGTERM"] and stopped.value.signal == "SIGTERM"
    assert not stopped.value.before_training and "continues the run, from its newest checkpoint" in stopped.value.note
    assert capsys.readouterr().out.splitlines() == [
        "[raydiff] SIGTERM: stopping after a final checkpoint",
        "[raydiff] SIGTERM: no worker group runs (Ray Train is restarting it): nothing to checkpoint, stopping at "
        "once"]


def test_a_stop_before_any_worker_group_ran_is_at_once_and_before_training(monkeypatch):
    from raydiff.training import stop

    monkeypatch.setattr(stop, "_workers", lambda flag: ("SCHEDULING", False))
    flag = RecordingFlag()

    def fit() -> str:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        return "never"

    with pytest.raises(Interrupted) as stopped, stop_on_signals(flag) as received:
        beside_the_handlers(fit, poll=lambda: stop.stop_at_once(received))
    assert stopped.value.before_training and flag.requests == ["SIGINT"]  # for a group placed all the same


def _as_the_driver_polls(received) -> None:
    """The driver's poll while fit runs: a lost lease it raises itself, naming the run; `stop_at_once` does not."""
    stop_at_once(received)
    if received["at_once"] is not None and received["lease_lost"]:
        raise RunInUse("taken over")


def test_a_lease_lost_while_no_worker_group_runs_stops_the_run_at_once(monkeypatch, capsys):
    """Another driver took the run over while Ray Train waited for room for the workers: none would look at the
    flag before there is room, so the driver stops at once, without a checkpoint or a signal's exit."""
    from raydiff.training import stop

    monkeypatch.setattr(stop, "_workers", lambda flag: ("SCHEDULING", True))
    flag, lease = RecordingFlag(), Lease(store=None, holder={})  # type: ignore[arg-type]  # never renewed here

    def fit() -> str:
        lease.lose()  # the heartbeat thread's call
        time.sleep(30)  # Ray Train waiting for room
        return "never"

    with pytest.raises(RunInUse), stop_on_signals(flag, lease) as received:
        beside_the_handlers(fit, poll=lambda: _as_the_driver_polls(received))
    assert flag.requests == [LEASE_LOST] and received["lease_lost"] and received["signal"] is None
    assert capsys.readouterr().out.splitlines() == [
        "[raydiff] the run's lease was taken over: no worker group runs (Ray Train is waiting for room on the cluster "
        "for one): stopping at once"]


def test_a_lease_lost_before_training_reaches_the_workers_who_stop_themselves(monkeypatch, capsys):
    """Lost before the stop watch began (while the driver decoded the data): the flag is told as it begins. Where
    no group runs then (as a fit that starts does), the run stops at once; where one runs, as here, the group stops
    at its next look at the flag (the driver then refuses to write a summary), and nothing stops at once."""
    from raydiff.training import stop

    monkeypatch.setattr(stop, "_workers", lambda flag: ("RUNNING", True))
    monkeypatch.setattr(stop, "STATE_POLL_S", 0.05)
    flag, lease = RecordingFlag(), Lease(store=None, holder={})  # type: ignore[arg-type]
    lease.lose()
    with stop_on_signals(flag, lease) as received:
        assert beside_the_handlers(lambda: time.sleep(0.5) or "returned",
                                   poll=lambda: _as_the_driver_polls(received)) == "returned"
    assert flag.requests == [LEASE_LOST] and received["lease_lost"] and received["at_once"] is None
    assert capsys.readouterr().out == ""


def test_a_run_that_gave_its_lease_up_unrenewed_says_so_and_not_that_another_run_took_it():
    """Given up (no renewal confirmed for half the stale time) is not taken over: the line says what happened
    and that the same command continues the run."""
    when = ": stopped at step 120 without writing more"
    assert taken_over("s3://b/runs/smoke", when, 31.4) == (
        "this run could not renew its lease on the run directory s3://b/runs/smoke for 31 s (the store did not "
        "answer): stopped at step 120 without writing more: another raydiff run may take it over "
        "(run.lease_stale_s); the same command continues the run once the store answers")
    assert taken_over("s3://b/runs/smoke", when).startswith("another raydiff run took over the run directory")



@pytest.mark.ray
def test_a_sigterm_ends_the_stop_flag_at_once_without_a_traceback_even_amid_a_finalizer(ray_session, cluster):
    """Ray's own handler raised SystemExit, which Python swallows inside a finalizer, printing a traceback into the
    run's output (a sweep's) and going on."""
    from raydiff.training.stop import StopFlag

    def terminated_amid_a_finalizer(flag) -> str:
        """Run in the flag's process (`__ray_call__`; defined here, so that it travels by value): a SIGTERM lands
        while an object is finalized, as one that ends a job may land while the flag's handle of Ray Train's
        controller is."""

        class Finalized:
            def __del__(self) -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs here

        Finalized()  # dropped at once: its finalizer runs in this line
        return "the process went on"

    flag = StopFlag.remote()  # type: ignore[attr-defined]
    pid = ray_session.get(flag.__ray_call__.remote(lambda actor: os.getpid()))
    with pytest.raises(ray_session.exceptions.RayActorError):
        ray_session.get(flag.__ray_call__.remote(terminated_amid_a_finalizer), timeout=60)
    logs = list(Path(cluster.head_node.get_logs_dir_path()).glob(f"worker-*-{pid}.err"))
    assert logs, f"no log of the flag's process {pid}"
    assert "Traceback" not in "".join(log.read_text() for log in logs)


def _runs(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.ray
def test_a_stop_at_once_lets_the_run_go_only_once_its_workers_have_ended_with_their_controller(ray_session):
    """A second Ctrl-C ends Ray Train's controller; its workers end with it (their owner) a moment later, and until
    then rank 0 may still be writing a checkpoint: the driver keeps the run's lease until they have ended (here a
    controller and a worker of the classes' names, in this test's job), or says that they have not."""
    import ray

    @ray.remote(num_cpus=0)
    class RayTrainWorker:  # the name Ray Train's workers have in the cluster's actor table
        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class TrainController:
        def start(self) -> int:
            self.worker = RayTrainWorker.remote()
            return ray.get(self.worker.pid.remote())

    controller = TrainController.remote()
    worker_pid = ray.get(controller.start.remote())
    flag = StopFlag.remote()
    ray.get(flag.note_controller_actor.remote(controller))
    assert not workers_ended(wait_s=0.5)  # a worker runs: not said to have ended
    end_controller(flag)
    assert workers_ended(wait_s=30)
    assert not _runs(worker_pid)  # ended: its process, not only the table's row


@pytest.mark.parametrize("wait", ["ended", "cut by another Ctrl-C", "the cluster does not answer"])
def test_a_lease_is_left_to_expire_where_the_workers_are_not_seen_to_end(monkeypatch, capsys, wait):
    """A third Ctrl-C in the wait for the workers skipped the lease's `leave`: `hold` then freed it with workers that
    may still write."""
    from raydiff.training import stop

    def running():
        if wait == "cut by another Ctrl-C":
            raise KeyboardInterrupt
        if wait == "the cluster does not answer":
            raise ConnectionError("GCS unreachable")
        return []
    monkeypatch.setattr(stop, "workers_running", running)
    left = []

    class ObjectLease:
        def leave(self) -> bool:
            left.append(True)
            return True
    keep_lease_until_workers_end(ObjectLease(), stale_s=60.0, wait_s=5)
    said = capsys.readouterr().out
    if wait == "ended":
        assert left == [] and said == ""
    else:
        assert left == [True] and said == ("[raydiff] the run's workers were not seen to end (waited up to 5 s): its "
                                           "lease is left to expire (run.lease_stale_s = 60 s) so that no other run "
                                           "writes beside them\n")
