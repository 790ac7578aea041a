"""Running a Ray Tune sweep: every trial a full raydiff run (a Ray Train TorchTrainer launched from a Tune function
trainable) on images decoded once, ASHA stopping the worse trials, and what the sweep leaves (results.csv,
best.yaml, sweep.png, summary.json). A trial that fails as a raydiff run does (one line: a full disk, bad data) is
told in that line, not in Tune's traceback.

Why a module of its own: `raydiff.tune` is the command (its arguments and lines); this is the library it runs,
with the plan of `raydiff.training.sweep_plan`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydiff.config import Config, ConfigError
from raydiff.data.errors import DataError
from raydiff.quality.errors import QualityError
from raydiff.runs.errors import Unresumable
from raydiff.storage.errors import (
    StorageFailure,
    failure_message,
    free_bytes,
    megabytes,
    permanent_reason,
    permanent_reason_in,
)
from raydiff.storage.rundir import RunInUse
from raydiff.training.sweep_plan import Sweep, concurrent_trials, trial_config, trial_name

# A trial only waits on its TorchTrainer, so it asks Ray for no CPU: one byte of memory, as Tune refuses a trial that
# asks for nothing. Its workers hold the real CPUs and take the trial's share whole: a fraction of a CPU held by each
# waiting trial would leave a share of 1.998 of 2 CPUs, where an explicit scaling.cpus_per_worker = 2 never fits
# and the sweep waits forever. Every trial's waiting actor may be up at once (a re-run resumes the failed
# trials all together: Tune's max_concurrent_trials applies only when it creates trials); they hold nothing the
# workers need, so a running trial's workers always fit, and the others' wait for them to finish.
TRIAL_RESOURCES: dict[str, float] = {"CPU": 0, "memory": 1}
LAYOUT_FILE = "data.json"  # the sweep's data layout, kept by a re-run
# Each trial's Ray Train controller ends with the trial (finished, or stopped by ASHA) and the run's placement-group
# cleaner warns that it found it dead: routine in a sweep (in a single run it would signal a fault, and shows).
TRIAL_CONTROLLER_GONE = re.compile(r"Detected that the Ray Train controller actor \(\w+\) is dead")
# What a raydiff run refuses or stops with in one line (a disk without room, data it cannot read): the user's to fix.
ONE_LINE_ERRORS = (ConfigError, DataError, StorageFailure, QualityError, Unresumable, RunInUse)


class TrialFailed(RuntimeError):
    """A trial's run refused or stopped with one of raydiff's one-line errors; the message is that line, with the
    trial's name (or, from the command, how many trials failed)."""


def _run_trial(params: dict[str, Any], *, base: Config, sweep: Sweep, runs_dir: str, images,
               cpus_per_trial: float, trial_runs) -> None:
    """A Tune function trainable: one raydiff run whose every report reaches Tune."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raydiff.training.cadence import ray_report
    from raydiff.training.driver import run_training
    from raydiff.training.reservations import note_trial_run

    name = trial_name(params, sweep.lr_digits)
    try:
        cfg = trial_config(base, params, sweep, runs_dir)
        summary = run_training(cfg, images=images, cpus=cpus_per_trial, callbacks=[TuneReportCallback()],
                               note_run=lambda requester: note_trial_run(trial_runs, requester))
    except ONE_LINE_ERRORS as exc:
        raise TrialFailed(f"trial {name} failed: {exc}") from None
    if summary["status"] == "diverged":  # a result of the sweep (too high a learning rate), not a failure to retry
        print(f"[raydiff] trial {name} diverged: {summary.get('error')}", file=sys.stderr)
        return
    # A trial Tune runs again whose run had nothing left to train (Tune's state set aside, or a sweep driver
    # killed after the trial's last checkpoint): its final measurements, restored, count again.
    nothing_left = summary.get("already_finished") or summary.get("resumed_from_step") == summary.get("steps")
    if summary["status"] == "finished" and nothing_left:
        val_loss = summary["final_val_loss"]
        if val_loss is None and cfg.data.val_images:  # measured, and not finite (summary.json has it as null)
            val_loss = math.inf
        tune.report(ray_report(summary["steps"], cfg.train.global_batch, summary["quality"], val_loss))
    if summary["status"] not in ("finished",):
        raise RuntimeError(f"trial {cfg.run.name} {summary['status']}: {summary.get('error', 'unknown error')}")


def _require_state_api() -> None:
    """ASHA stops a trial by killing it, and with it the trial's Ray Train controller; Ray then frees that run's
    placement group through its state API (served by the dashboard). Without it the freed CPUs/GPUs stay
    reserved and the next trial waits forever, so refuse up front."""
    from ray.util.state import list_actors

    from raydiff.training.reservations import cluster_address

    try:
        list_actors(address=cluster_address(), limit=1, timeout=10, raise_on_missing_output=False)
    except Exception:
        raise ConfigError("this Ray cluster has no state API (started without the dashboard): sweeps need it to "
                          "free the resources of stopped trials; start Ray with the dashboard (the default of "
                          "`ray start --head`, or pip install 'ray[default]')") from None


def run_sweep(cfg: Config, sweep: Sweep) -> dict[str, Any]:
    import ray
    from ray import tune

    from raydiff.cluster.nodes import wait_for_worker_node
    from raydiff.cluster.start import environment_variable, init_ray
    from raydiff.cluster.worker_output import drop_worker_lines
    from raydiff.runs.sweep_state import set_aside_unusable_tune_state
    from raydiff.storage.rundir import unwritable
    from raydiff.training.driver import with_held_out
    from raydiff.training.reservations import TrialRuns, releasing_killed_trials
    from raydiff.training.stop import noting_tune_interrupt
    from raydiff.training.sweep_scheduler import GroupedASHA

    sweep_dir = Path(cfg.run.storage) / sweep.name
    spec_file = sweep_dir / "sweep.json"
    spec = {**sweep.__dict__, "config": cfg.to_dict()}
    spec = json.loads(json.dumps(spec))  # tuples -> lists, as read back
    if spec_file.exists() and _read_json(spec_file) != spec:
        raise ConfigError(f"--name {sweep.name}: {sweep_dir} holds a sweep with other arguments or config; "
                          f"use --name NEW for a new sweep")
    reason = unwritable(sweep_dir)
    if reason:
        raise ConfigError(f"run.storage = {cfg.run.storage!r}: cannot write the sweep directory {sweep_dir} ({reason})")

    init_ray()
    _require_state_api()
    joined = wait_for_worker_node(cfg.scaling.use_gpu, cfg.scaling.node_wait_s)
    if joined:
        print(f"[raydiff] {joined}")
    resources = ray.cluster_resources()
    cpus = resources.get("CPU", 1)
    # No more shares than trials: two trials on a cluster that fits eight take half of it each, not an eighth.
    concurrent = min(sweep.max_concurrent or concurrent_trials(cfg, cpus, resources.get("GPU", 0)), sweep.trials)
    check_sweep_room(cfg, sweep, sweep_dir, concurrent)
    images, cache = sweep_images(cfg, sweep_dir, concurrent)
    if cfg.data.val_images >= images.num_good:
        raise ConfigError(f"data.val_images = {cfg.data.val_images}: must be below the {images.num_good} images")
    images = with_held_out(cfg, images)  # once for every trial: they all hold out the same images
    print(f"[raydiff] sweep {sweep.name}: {len(sweep.base_lrs)} base LR(s) x {len(sweep.batches)} batch size(s) x "
          f"{len(sweep.rules)} rule(s) = {sweep.trials} trials of "
          f"{sweep.budget_images:,} images, validation every {sweep.interval_images:,} images on "
          f"{cfg.data.val_images} held-out images, {concurrent} at a time; {cache}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _keep_json(spec_file, spec)
    _keep_json(sweep_dir / LAYOUT_FILE, {"layout": images.layout()})

    trial_runs = TrialRuns.remote()  # type: ignore[attr-defined]  # @ray.remote adds .remote
    trainable = tune.with_resources(
        tune.with_parameters(_run_trial, base=cfg, sweep=sweep, runs_dir=str(sweep_dir / "runs"),
                             images=images, cpus_per_trial=cpus / concurrent, trial_runs=trial_runs),
        TRIAL_RESOURCES,
    )
    experiment = str(sweep_dir / "tune")
    set_aside = set_aside_unusable_tune_state(Path(experiment))
    if set_aside:
        print(f"[raydiff] {set_aside}")
    if tune.Tuner.can_restore(experiment):
        print(f"[raydiff] continuing the sweep in {sweep_dir}")
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_errored=True)
    else:
        scheduler = GroupedASHA(time_attr="images_seen", max_t=sweep.budget_images,
                                grace_period=sweep.grace_images, reduction_factor=2)
        tuner = tune.Tuner(
            trainable,
            param_space={"base_lr": tune.grid_search(list(sweep.base_lrs)),
                         "batch": tune.grid_search(list(sweep.batches)),
                         "rule": tune.grid_search(list(sweep.rules))},
            tune_config=tune.TuneConfig(metric=sweep.metric, mode="min", scheduler=scheduler,
                                        max_concurrent_trials=concurrent),
            run_config=tune.RunConfig(name="tune", storage_path=str(sweep_dir), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=1)),
        )
    drop_worker_lines(TRIAL_CONTROLLER_GONE)  # the last trial's cleaner may speak after fit() has returned
    # RAY_AIR_NEW_OUTPUT=0: Tune's legacy output engine, silent at verbose=0, where the current one still prints a
    # banner (its scheduler table, and a `tensorboard` command for a folder of the Ray session) beside raydiff's
    # own lines; read when the sweep starts. Tune's log messages (a trial's error, its interruption) are unchanged.
    with releasing_killed_trials(trial_runs), noting_tune_interrupt() as interrupt, \
            environment_variable("RAY_AIR_NEW_OUTPUT", "0"), telling_tune_failures() as failures:
        try:
            grid = tuner.fit()
        except Exception:
            if failures.state_unsaved is None:
                raise
            # Tune fails reading back a file it could not write whole (a trial's error): the full disk is the news.
            raise StorageFailure(failure_message(str(sweep_dir), "saving the sweep's state",
                                                 failures.state_unsaved)) from None
    if interrupt["signal"]:  # Tune saved its state; the results so far are not the sweep's
        return {"interrupted": interrupt["signal"], "dir": str(sweep_dir)}
    rows = [_result_row(grid[i], cfg, sweep, sweep_dir) for i in range(len(grid))]
    return {"rows": rows, "dir": str(sweep_dir), "failed": still_failed(failures.trials, rows)}


def still_failed(told: dict[str, str], rows: list[dict[str, Any]]) -> dict[str, str]:
    """The lines told of failed trials (by trial) that ended failed: not those that Tune's one retry finished."""
    errors = {row["trial"] for row in rows if row["status"] == "error"}
    return {trial: line for trial, line in told.items() if trial in errors}


def _keep_json(path: Path, content: dict[str, Any]) -> None:
    """Write `content` to `path` whole (a kill or a full disk leaves the old file or none), where it differs."""
    from raydiff.storage.atomic import new_file

    if path.is_file() and _read_json(path) == content:
        return
    with new_file(path) as tmp:
        tmp.write_text(json.dumps(content, indent=2) + "\n")


def _read_json(path: Path) -> Any:
    """A sweep file as written, or one line that says what to do with it."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not the JSON a sweep writes (cut short, or edited): restore it, or use --name "
                          f"NEW for a new sweep") from None


@dataclass
class TuneFailures:
    """What `telling_tune_failures` told or noted: each failed trial's line, by trial, and why Tune could not save
    the sweep's state (None if it could)."""

    trials: dict[str, str] = field(default_factory=dict)
    state_unsaved: str | None = None


@contextmanager
def telling_tune_failures() -> Iterator[TuneFailures]:
    """While active, Tune's traceback for a trial that failed with `TrialFailed` is raydiff's line instead, once per
    trial (Tune runs a failed trial once more), and Tune's closing "Trials did not complete" is left out; a failure
    to save the sweep's state (its own saves, or its upload of the trials' files) that no retry can fix (a full
    disk) is noted, not shown. Any other failure keeps its traceback (a bug should be seen)."""
    told = TuneFailures()
    controller_log = logging.getLogger("ray.tune.execution.tune_controller")
    state_log = logging.getLogger("ray.tune.execution.experiment_state")
    sync_log = logging.getLogger("ray.train._internal.syncer")
    tune_log = logging.getLogger("ray.tune.tune")

    def trial_failed(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, TrialFailed):  # Ray's task error is an instance of its cause's class too
            return True
        line = str(getattr(error, "cause", error))
        trial = line.split(" failed: ", 1)[0].removeprefix("trial ")
        if trial not in told.trials:
            told.trials[trial] = line
            print(f"[raydiff] {line}", file=sys.stderr)
        return False

    def state_unsaved(record: logging.LogRecord) -> bool:
        # The syncer (Tune's upload of its files to the sweep's storage) puts the traceback in the message.
        error = record.exc_info[1] if record.exc_info else None
        reason = permanent_reason(error) if error else permanent_reason_in(record.getMessage())
        told.state_unsaved = told.state_unsaved or reason
        return reason is None

    def incomplete(record: logging.LogRecord) -> bool:
        return not (told.trials and record.getMessage().startswith("Trials did not complete"))

    filters = ((controller_log, trial_failed), (state_log, state_unsaved), (sync_log, state_unsaved),
               (tune_log, incomplete))
    for log, keep in filters:
        log.addFilter(keep)
    try:
        yield told
    finally:
        for log, keep in filters:
            log.removeFilter(keep)


def check_sweep_room(cfg: Config, sweep: Sweep, sweep_dir: Path, concurrent: int) -> None:
    """On a local or mounted file system, room for the checkpoints the sweep keeps at its fullest: one per trial
    (run.keep_checkpoints 1) and the next one of each trial running; those a re-run finds are there already.
    Refused in one line otherwise, before anything is written: a disk that fills halfway through fails the trials
    that remain, one after another."""
    from raydiff.runs.checkpoint import checkpoint_bytes  # torch: imported once a sweep runs

    free = free_bytes(str(sweep_dir))
    if free is None:
        return
    trials, running = sweep.trials, min(concurrent, sweep.trials)
    kept = sum(1 for trial in (sweep_dir / "runs").glob("*") for _ in trial.glob("checkpoint_*"))
    each = checkpoint_bytes(trial_config(cfg, {"base_lr": sweep.base_lrs[0], "batch": sweep.batches[0],
                                               "rule": sweep.rules[0]}, sweep, str(sweep_dir / "runs")))
    needed = max(trials + running - kept, 0) * each
    if free < needed:
        raise ConfigError(f"run.storage = {cfg.run.storage!r}: {megabytes(free)} free on its file system, and the "
                          f"sweep's {trials} trials ({running} at a time) need room for "
                          f"{needed // each} more checkpoints of about {megabytes(each)} ({megabytes(needed)}); free "
                          f"space there, set another run.storage or sweep fewer trials")


def sweep_images(cfg: Config, sweep_dir: Path, concurrent: int):
    """The images every trial trains on, decoded once: `open_images` with two sweep rules. Streamed, the K trials
    that run at once on a node split `data.stream_buffer_gb` (each node cache holds a K-th of it, so the node
    holds what the key says, not K times that). A re-run of the sweep keeps the layout it began with (the
    sweep's data.json), so that its trials continue in their sample order."""
    from raydiff.data.run_images import open_images
    from raydiff.data.sources import source_of

    layout_file = sweep_dir / LAYOUT_FILE
    keep = _read_json(layout_file)["layout"] if layout_file.is_file() else None
    images, cache = open_images(cfg.data, source_of(cfg.data), storage=cfg.run.storage, endpoint=cfg.run.endpoint,
                                keep=keep, buffer_share=1 / concurrent, lease_stale_s=cfg.run.lease_stale_s,
                                use_gpu=cfg.scaling.use_gpu, for_training=True)
    if images.layout()["cache"] == "stream" and concurrent > 1:
        cache += f" (each trial's node cache holds 1/{concurrent} of data.stream_buffer_gb: {concurrent} at a time)"
    return images, cache


def _result_row(result, cfg: Config, sweep: Sweep, sweep_dir: Path) -> dict[str, Any]:
    params = result.config
    metrics = result.metrics or {}
    images_seen = metrics.get("images_seen", 0)
    trial = trial_config(cfg, params, sweep, str(sweep_dir / "runs"))
    if result.error is not None:
        status = "error"
    elif _run_status(Path(trial.run.storage) / trial.run.name) == "diverged":
        status = "diverged"  # its metrics: the last validation point before
    else:
        status = "finished" if images_seen >= sweep.budget_images else "stopped"
    return {"trial": trial.run.name, "rule": params["rule"], "batch": params["batch"], "base_lr": params["base_lr"],
            "lr": trial.train.lr, "images_seen": images_seen, "val_loss": metrics.get("val_loss"),
            **({sweep.metric: metrics.get(sweep.metric)} if sweep.metric != "val_loss" else {}), "status": status}


def _run_status(run_dir: Path) -> str | None:
    """How a trial's run last ended, as its summary says (None: it has none, as a trial that ASHA stopped)."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        return None
