"""The driver: decide start/continue, start or join Ray, decode the data once, run the TorchTrainer, summarise."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import ray
import ray.train
import yaml
from ray.train.torch import TorchConfig, TorchTrainer

from raydiff.cluster.devices import fewest_workers, trains_on_gpus, worker_cpus
from raydiff.cluster.host_memory import HOST_MEMORY_ENV, keep_host_memory
from raydiff.cluster.nodes import wait_for_worker_node
from raydiff.cluster.start import check_ray_address, init_ray, warn_without_dashboard
from raydiff.cluster.storage import check_shared_storage
from raydiff.config import Config, ConfigError
from raydiff.config.learning_rate import describe_lr
from raydiff.data.run_images import RunImages, open_images
from raydiff.data.sharded import ShardedImages
from raydiff.data.sources import DataError, source_of
from raydiff.quality.features import features_for, metric_names, require_metrics_package
from raydiff.quality.reference_stats import reference_for
from raydiff.runs.checkpoint import (
    checkpoint_bytes,
    drop_unusable_ray_checkpoint_list,
    remove_checkpoints_ray_never_kept,
    remove_partial_writes,
)
from raydiff.runs.dashboards import dashboards_for
from raydiff.runs.ema_snapshots import remove_snapshots_after, removed_note
from raydiff.runs.errors import Unresumable
from raydiff.runs.init_from import InitWeights, load_init_weights
from raydiff.runs.run_plan import DATA_FILE, DRIVER_FILE, RunPlan, move_aside, plan_run
from raydiff.runs.runlog import JsonlLog, json_safe
from raydiff.storage.errors import (
    StorageFailure,
    failure_message,
    free_bytes,
    megabytes,
    permanent_reason_in,
    storage_failure,
)
from raydiff.storage.lease import Lease, hold, this_process
from raydiff.storage.rundir import RunDir, RunInUse, unwritable
from raydiff.training.in_run_quality import InRunQuality
from raydiff.training.interrupts import SignalStage, interrupt_on_signals
from raydiff.training.loop import train_worker
from raydiff.training.lost_workers import LostWorkers, causes, hang_timeouts
from raydiff.training.reservations import cancel_previous_reservation, cancel_requests, requester_of
from raydiff.training.resolve import resolve_run
from raydiff.training.stop import (
    LEASE_LOST,
    ControllerState,
    StopFlag,
    beside_the_handlers,
    end_controller,
    keep_lease_until_workers_end,
    stop_at_once,
    stop_on_signals,
    stop_reason,
    taken_over,
)
from raydiff.training.validation import check_holdout, holdout_split
from raydiff.training.worker_io import WorkerArgs, WorkerResult, WorkerStatus

BAD_FILE = "bad_images.json"  # every sample of the source that could not be used, and why


def run_dir_of(cfg: Config) -> RunDir:
    """`<run.storage>/<run.name>`: a local or NFS folder, or an s3:// / gs:// prefix."""
    return RunDir(cfg.run.storage, endpoint=cfg.run.endpoint) / cfg.run.name


def check_room(cfg: Config, run_dir: RunDir) -> str | None:
    """On a local or mounted file system, room for at least two checkpoints of this model (its size follows from
    the model); refused in one line otherwise. Returns a warning where what is free now falls short of what the
    run adds at its fullest (`room_at_fullest`): it may fill the disk before it ends (the disk may also be freed
    meanwhile: not refused). Object stores have no such limit to check."""
    if run_dir.remote:
        return None
    free, needed = free_bytes(run_dir.path), checkpoint_bytes(cfg)
    if free is None:
        return None
    if free < 2 * needed:
        raise ConfigError(f"run.storage = {cfg.run.storage!r}: {megabytes(free)} free on its file system, and a "
                          f"checkpoint of this model takes about {megabytes(needed)}: a run needs room for at least "
                          f"two ({megabytes(2 * needed)}); free space there or set another run.storage")
    fullest, what = room_at_fullest(cfg, run_dir, needed)
    if free >= fullest:
        return None
    return (f"run.storage = {cfg.run.storage!r} has {megabytes(free)} free, and the run adds up to "
            f"{megabytes(fullest)} ({what}): it may fill before the run ends (then it stops in one line, and the "
            f"same command continues it once there is room)")


def room_at_fullest(cfg: Config, run_dir: RunDir, checkpoint: int) -> tuple[int, str]:
    """(bytes, what they are) that the run adds to its storage at its fullest, beyond what is there now: the
    checkpoints it keeps at once (`run.keep_checkpoints`, and the next one written before Ray removes the oldest;
    fewer where the run writes fewer) and, with `train.ema: posthoc`, the snapshots still to come (kept for the
    whole run)."""
    from raydiff.runs.checkpoint import checkpoint_order, list_checkpoints
    from raydiff.runs.ema_snapshots import list_snapshots, snapshot_size

    t = cfg.train
    found = [checkpoint_order(c)[0] for c in list_checkpoints(run_dir)] if run_dir.exists() else []
    newest = max(found, default=0)
    to_write = t.total_steps // t.checkpoint_every - newest // t.checkpoint_every + int(
        t.total_steps % t.checkpoint_every != 0 and newest < t.total_steps)  # the end's, off the schedule
    checkpoints = max(min(cfg.run.keep_checkpoints + 1, len(found) + to_write) - len(found), 0)
    fullest, what = checkpoints * checkpoint, f"{checkpoints} checkpoint(s) of about {megabytes(checkpoint)}"
    if t.ema == "posthoc":
        size, count = snapshot_size(cfg)
        snapshots = max(count - len(list_snapshots(run_dir) if run_dir.exists() else []), 0)
        fullest += snapshots * size
        what += f" and {snapshots} post-hoc EMA snapshot(s) of {megabytes(size)}"
    return fullest, what


def plan_scaling(cfg: Config, cpus: float | None = None) -> tuple[ray.train.ScalingConfig, float]:
    """Workers, devices and CPUs per worker; returns Ray's ScalingConfig and the CPUs of each worker.

    Ray Data decodes (or, for streamed data, prepares) the dataset before training starts (see
    `raydiff.data.image_store`), and streamed shards are read by zero-CPU actors, so training may use every CPU
    without starving the data pipeline: the two never compete, and nothing can deadlock.
    `cpus` is this run's part of the cluster's CPUs (a Tune sweep runs several runs at once); default all.
    CPU workers are sized to fit the nodes alive now: each worker is placed on one node.
    """
    s = cfg.scaling
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0), cpus or resources.get("CPU", 1)
    use_gpu = trains_on_gpus(s, gpus)
    if use_gpu and gpus == 0:
        print("[raydiff] scaling.use_gpu is true but the cluster has no GPU now: waiting for one to be added")
    elif gpus and not use_gpu and s.use_gpu == "auto":
        fewest = f"{'at least ' if isinstance(s.num_workers, tuple) else ''}{fewest_workers(s)}"
        print(f"[raydiff] scaling.use_gpu auto: the cluster has {gpus:g} GPU(s), fewer than the run's {fewest} "
              f"workers: training on CPUs (scaling.num_workers={int(gpus)} trains on the GPUs; "
              f"scaling.use_gpu=true waits for more)")
    node_cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]]
    cpus_per_worker = worker_cpus(s, use_gpu=use_gpu, cpus=cpus, node_cpus=node_cpus)
    assert s.num_workers != "auto", "auto_workers resolves it first"
    # ray.train names Train V2's classes at run time; type checkers see V1's, which lack the elastic options.
    options: dict[str, Any] = {"num_workers": s.num_workers, "use_gpu": use_gpu,
                               "resources_per_worker": {"CPU": cpus_per_worker},
                               "elastic_resize_monitor_interval_s": s.resize_check_s}
    scaling = ray.train.ScalingConfig(**options)
    return scaling, cpus_per_worker


def run_training(cfg: Config, *, images: RunImages | None = None, cpus: float | None = None,
                 callbacks: list | None = None, note_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train to `cfg.train.total_steps`, continuing the run's newest checkpoint; return the summary.

    :param images: the source already decoded (a sweep decodes once for all its trials).
    :param cpus: this run's part of the cluster's CPUs (default all).
    :param callbacks: Ray Train callbacks, e.g. Tune's report callback.
    :param note_run: called with the name the run reserves its resources under, before it starts (a sweep
        releases them if Tune kills the trial).
    """
    started = time.perf_counter()
    run_dir = run_dir_of(cfg)
    if cfg.eval.every or cfg.eval.at_end:
        require_metrics_package("eval.every / eval.at_end")
    # Storage the run cannot write to, or without room for two checkpoints, is the user's to fix: say so before
    # anything else.
    reason = unwritable(run_dir)
    if reason:
        raise ConfigError(f"run.storage = {cfg.run.storage!r}: cannot write the run directory {run_dir} ({reason})")
    short = check_room(cfg, run_dir)
    if short:
        print(f"[raydiff] warning: {short}", flush=True)
    if not ray.is_initialized():
        check_ray_address()  # a cluster that does not answer, before the run directory is touched
    source = source_of(cfg.data)
    identity = source.identity()
    # What this command means for the run directory, read first, so that a refusal (a changed identity key, a
    # model.init_from that does not fit) writes nothing at all. model.init_from starts a new run; a continuing
    # run restores its checkpoint and never reads it.
    plan = plan_run(cfg, run_dir, identity)
    init = load_init_weights(cfg) if cfg.model.init_from and plan.action == "start" else None

    # Hold the run directory where it lives before changing anything in it: from here on this driver alone
    # writes to it, whichever machine or Ray cluster another driver of it runs on. Until training starts, a
    # SIGTERM or Ctrl-C stops at once (nothing to save yet).
    driver = {**this_process(), "invocation": uuid.uuid4().hex}
    with interrupt_on_signals() as stage, hold(run_dir, driver, stale_s=cfg.run.lease_stale_s,
                                               what="run directory") as lease:
        plan = plan_run(cfg, run_dir, identity)  # again: another driver may have run in between
        notes = list(plan.notes)
        removed = [] if plan.replace else remove_partial_writes(run_dir)  # (a run moved aside keeps its own)
        if removed:
            notes.append(f"removed {len(removed)} incomplete checkpoint(s) or file(s) that interrupted writes left: "
                         f"{', '.join(removed)}")
        for note in notes:
            print(f"[raydiff] {note}")
        if plan.action == "finished":
            _forget_work_after(run_dir, plan.step)
            summary = json.loads(run_dir.read_text("summary.json"))
            return {**summary, "already_finished": True, "run_dir": str(run_dir)}
        if plan.action != "start":
            init = None
        elif cfg.model.init_from and init is None:
            init = load_init_weights(cfg)

        init_ray()
        warn_without_dashboard()
        lease.update(ray_job=ray.get_runtime_context().get_job_id())
        stop_flag = StopFlag.remote()  # type: ignore[attr-defined]  # @ray.remote adds .remote
        lease.on_lost = lambda: stop_flag.request.remote(LEASE_LOST)  # at once, if it was lost already
        return _train(cfg, run_dir, plan, source, identity, init, lease, stop_flag, stage, started,
                      images=images, cpus=cpus, callbacks=callbacks, note_run=note_run)


def _train(requested: Config, run_dir: RunDir, plan: RunPlan, source, identity: dict[str, Any],
           init: InitWeights | None, lease: Lease, stop_flag, stage: SignalStage, started: float, *, images, cpus,
           callbacks, note_run) -> dict[str, Any]:
    """run_training, once the run directory is held: decode, train, summarise."""
    driver = lease.holder
    invocation = driver["invocation"]
    # Decide for the nodes the run will train on: on an autoscaling cluster, the first of them may still be to come.
    joined = wait_for_worker_node(requested.scaling.use_gpu, requested.scaling.node_wait_s)
    if joined:
        print(f"[raydiff] {joined}")
    # Decode the data once with Ray Data.
    check_shared_storage(requested.run.storage)
    init_ref = None
    if init is not None:
        init_ref = ray.put(init.weights)
        print(f"[raydiff] model.init_from: starting from {requested.model.init_from}"
              + (f" ({init.described})" if init.described else ""))
    elif requested.model.init_from:
        print(f"[raydiff] model.init_from: continuing at step {plan.step}, not read ({requested.model.init_from})")
    decode_start = time.perf_counter()
    decoded = "decoded earlier"
    if images is None:  # a continuing run keeps the layout it began with: the same samples in the same order
        images, cache = open_images(requested.data, source, storage=requested.run.storage,
                                    endpoint=requested.run.endpoint,
                                    keep=plan.layout, lease_stale_s=requested.run.lease_stale_s,
                                    use_gpu=requested.scaling.use_gpu, for_training=True)
        decoded = f"{cache}; ready in {time.perf_counter() - decode_start:.1f} s"
    elif plan.layout is not None and plan.layout != images.layout():
        raise DataError(f"run {requested.run.name!r} was trained on data laid out as {plan.layout} (data.json), now "
                        f"{images.layout()}: the sample order would change; use run.name=NEW for a new run")
    check_holdout(requested.data.val_images, images.num_good)
    if requested.data.on_device is True and isinstance(images, ShardedImages):
        raise DataError(f"data.on_device = true: needs the images in memory, and this run streams them "
                        f"(data.cache {requested.data.cache}: stream): use data.on_device=auto or data.cache=memory")
    images = with_held_out(requested, images)
    # The config the workers get: what the cluster and the data decide, resolved once.
    resolved, classes = resolve_run(requested, gpus=ray.cluster_resources().get("GPU", 0), images=images,
                                    init_weights=None if init is None else init.weights)
    unusable = images.bad_report()["count"]
    skipped = f", {unusable} skipped as unusable (see summary.json)" if unusable else ""
    scaling, cpus_per_worker = plan_scaling(resolved, cpus)
    s = resolved.scaling
    elastic_range = s.num_workers if isinstance(s.num_workers, tuple) and not requested.scaling.auto else None
    workers = "-".join(map(str, elastic_range)) if elastic_range else s.max_workers
    workers = f"{workers} (scaling.num_workers=auto)" if requested.scaling.auto else workers
    conditional = (f"class-conditional on {len(classes['names'])} classes (label dropout "
                   f"{requested.train.label_dropout:g}); " if classes else "")
    print(f"[raydiff] {images.num_good} images from {source.describe()} at {requested.data.resolution}px ({decoded}"
          f"{skipped}); "
          f"{'continuing at step ' + str(plan.step) if plan.step else 'training'}"
          f" on {workers} {'GPU' if scaling.use_gpu else 'CPU'} worker(s); {conditional}"
          f"{describe_lr(requested.train)}; "
          f"run directory "
          f"{run_dir}")

    quality = _prepare_quality(requested, images, classes)

    args = WorkerArgs(config=resolved, images=images, run_dir=run_dir, cpus_per_worker=cpus_per_worker,
                      invocation=invocation, stop_flag=stop_flag, init_weights=init_ref, quality=quality,
                      classes=classes)
    # Once nothing can refuse the run any more: the run it replaces moved aside (a refusal before this leaves it
    # where it was), Ray Train's checkpoint list dropped where Ray would refuse it, the checkpoints it never kept
    # removed once it keeps newer ones.
    if plan.replace:
        print(f"[raydiff] {move_aside(run_dir)}")
    dropped = drop_unusable_ray_checkpoint_list(run_dir)
    if dropped:
        print(f"[raydiff] {dropped}")
    removed = remove_checkpoints_ray_never_kept(run_dir, requested.run.keep_checkpoints)
    if removed:
        print(f"[raydiff] removed {', '.join(removed)}: never reported to Ray Train (written as its workers were "
              f"lost or resized, or before its checkpoint list was dropped), older than every checkpoint it keeps, "
              f"and past the newest {requested.run.keep_checkpoints} (run.keep_checkpoints)")
    storage = run_dir.parent  # Ray Train keeps its checkpoints in <storage>/<name> = run_dir, on the same filesystem
    # The allocator's settings are read when a worker's process starts, so they travel in its runtime environment.
    keep = keep_host_memory(resolved.train.keep_host_memory, use_gpu=bool(scaling.use_gpu))
    worker_env = {"env_vars": HOST_MEMORY_ENV} if keep else {}
    # A worker silent for scaling.hang_timeout_s is lost: the process group's collectives time out then, and Ray
    # Train's controller, which takes its own timeouts from the environment of the driver that starts the run.
    collective_timeout_s, hang_env = hang_timeouts(s.hang_timeout_s)
    os.environ.update(hang_env)
    nccl = bool(scaling.use_gpu)  # TorchConfig's backend: NCCL on GPUs, gloo on CPUs
    lost_workers = LostWorkers(max_failures=requested.run.max_failures, hang_timeout_s=s.hang_timeout_s, nccl=nccl)
    # ray.train names Train V2's classes at run time (a worker's return value reaches the driver; RunConfig takes
    # a logging config); type checkers see V1's.
    trainer = TorchTrainer(
        train_worker,  # type: ignore[arg-type]
        train_loop_config={"args": args},
        scaling_config=scaling,
        torch_config=TorchConfig(timeout_s=collective_timeout_s),
        run_config=ray.train.RunConfig(  # type: ignore[call-arg]
            name=requested.run.name,
            storage_path=storage.path,
            storage_filesystem=storage.fs,
            failure_config=ray.train.FailureConfig(max_failures=requested.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=requested.run.keep_checkpoints),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            callbacks=[*(callbacks or []), lost_workers, ControllerState(stop_flag)],  # type: ignore[list-item]
            worker_runtime_env=worker_env,
        ),
    )
    requester = requester_of(trainer)  # the name the run reserves its resources under
    cancel_previous_reservation(run_dir, requester, lease.previous)
    lease.update(requester=requester)  # for the next driver, should this one be killed before a group runs
    # What the run records beside its results: written by rank 0 once a checkpoint, if any, has been restored
    # (a start that the workers refuse changes nothing).
    records = {"config.yaml": yaml.safe_dump(requested.to_dict(), sort_keys=False),
               DATA_FILE: json.dumps({**identity, "layout": images.layout(), **images.label_summary()},
                                     indent=2) + "\n",
               DRIVER_FILE: json.dumps({**driver, "requester": requester}, indent=2) + "\n"}
    if unusable:
        records[BAD_FILE] = json.dumps(images.bad_report(limit=None)["examples"], indent=1) + "\n"
    args.records = records
    if note_run is not None:
        note_run(requester)
    failed_because: str | None = None  # all that Ray Train said: the first line names the kind, the rest the cause
    lost: dict[int, BaseException] | None = None  # where workers failed (a WorkerGroupError): which, and how
    # Once fit returns, a signal (under run_training's handler again) stops the records and the lease's release,
    # not training: a dashboard's close, or a renewal in flight, may take seconds.
    stage.before_training, stage.note = False, "training had ended (the same command goes on from its last checkpoint)"
    with stop_on_signals(stop_flag, lease) as received:
        def stop_now() -> None:  # while fit runs, in the main thread
            if received["at_once"] is not None and received["lease_lost"]:
                raise RunInUse(taken_over(run_dir, " while no worker group of this one ran: stopped without "
                                                   "writing more", lease.unrenewed_s))
            stop_at_once(received)

        try:
            result = beside_the_handlers(trainer.fit, poll=stop_now)
            outcome: WorkerResult | None = result.return_value  # type: ignore[attr-defined]
            checkpoint = str(run_dir / PurePosixPath(result.checkpoint.path).name) if result.checkpoint else None
        except ray.train.TrainingFailedError as exc:
            failed_because, outcome, checkpoint = str(exc).strip(), None, None
            lost = getattr(exc, "worker_failures", None)
        except (KeyboardInterrupt, RunInUse) as stopped:  # stopped at once: its controller and the autoscaler's
            # hold on its resources, too
            end_controller(stop_flag)
            if isinstance(stopped, KeyboardInterrupt):  # (a lost lease is another's now)
                keep_lease_until_workers_end(lease, requested.run.lease_stale_s)
            with contextlib.suppress(Exception):
                cancel_requests([requester], timeout_s=5)
            raise
    error = failed_because.splitlines()[0] if failed_because else None
    if lost:  # Ray Train's first line is "Training failed due to worker errors:"; which, and how, is the news
        error = "; ".join(causes(lost, s.hang_timeout_s, nccl=nccl))
    if outcome is not None and outcome.status == WorkerStatus.UNRESUMABLE:  # nothing was trained or written:
        raise Unresumable(outcome.diagnostic)  # refuse, as for a bad config
    if outcome is not None and outcome.status == WorkerStatus.REFUSED:
        raise ConfigError(outcome.diagnostic)
    if outcome is not None and outcome.status == WorkerStatus.LEASE_LOST:  # the run is another driver's: no summary
        raise RunInUse(taken_over(run_dir, outcome.diagnostic or "", lease.unrenewed_s))
    if stop_reason(stop_flag) == LEASE_LOST:  # lost after the workers' last check: no summary either
        raise RunInUse(taken_over(run_dir, " as this one ended: its summary was not written", lease.unrenewed_s))
    failure = _storage_failure(run_dir, outcome, failed_because)
    if failure is not None and checkpoint is not None:
        failure += f" ({PurePosixPath(checkpoint).name})"
    try:
        summary = _write_summary(requested, run_dir, invocation, plan.step, outcome, checkpoint, failure or error,
                                 started, bad_images=images.bad_report())
    except OSError as exc:
        unwritten = storage_failure(exc, str(run_dir), "writing summary.json")
        if unwritten is None:
            raise
        raise StorageFailure(f"{failure or unwritten} (summary.json could not be written)") from None
    if failure is not None:
        raise StorageFailure(failure)
    # The config the workers logged (resolved): the requested one would log its `auto`s as changed values.
    dashboards = dashboards_for(resolved, run_dir, resume_step=summary["steps"])
    if dashboards is not None:  # the final numbers (and the run's status) beside its curves
        dashboards.summary(summary)
        dashboards.close()
    return {**summary, "signal": received["signal"]}


def with_held_out(cfg: Config, images: RunImages) -> RunImages:
    """The images as the workers need them: streamed ones carry their `data.val_images` held-out images, which
    the driver gathers once (a sweep once for all its trials); images in memory hold them already."""
    if not isinstance(images, ShardedImages) or not cfg.data.val_images:
        return images
    return images.with_holdout(holdout_split(images.usable_indices(), cfg.data.val_images, cfg.train.seed)[1])


def _prepare_quality(cfg: Config, images: RunImages,
                     classes: dict[str, Any] | None) -> ray.ObjectRef | None:
    """eval.every / eval.at_end: the feature network and the reference statistics, once, before training (a
    missing Inception download stops the run here, not after hours of training)."""
    e = cfg.eval
    if not (e.every or e.at_end):
        return None
    features = features_for(e.features, cfg.data.source, e.inception_weights)
    reference = reference_for(cfg, features, keep_features="kid" in e.metrics, images=images)
    if "kid" in e.metrics:
        reference.features_for_kid()  # an .npz of mu/sigma cannot give KID: refuse before training
    when = ", ".join(filter(None, [f"every {e.every} steps" if e.every else "", "at the end" if e.at_end else ""]))
    names = [n for n, m in zip(metric_names(features), ("fid", "kid"), strict=True) if m in e.metrics]
    print(f"[raydiff] quality: {', '.join(names)} of {e.num} samples ({e.sampler}, {e.steps} steps) {when}, against "
          f"{reference.description} ({reference.count} images)")
    return ray.put(InRunQuality(features, reference,
                                class_names=tuple(classes["names"]) if classes else None,
                                class_counts=tuple(int(c) for c in classes["counts"]) if classes else None))


def _storage_failure(run_dir: RunDir, outcome: WorkerResult | None, error: str | None) -> str | None:
    """The one line of a storage error no retry can fix, from the workers (rank 0 stopped on it) or from a failed
    fit (Ray Train's own writes, or a worker that died of one); None for any other ending."""
    if outcome is not None and outcome.status == WorkerStatus.STORAGE_FAILED:
        return outcome.diagnostic
    reason = permanent_reason_in(error) if error else None
    return failure_message(str(run_dir), "training", reason) if reason else None


def _forget_work_after(run_dir: RunDir, step: int) -> None:
    """A finished run's records of work after its newest checkpoint (an extension killed before checkpointing, then
    re-run with the old train.total_steps): its metrics rows and post-hoc EMA snapshots, which no checkpoint
    holds, go, as a continuing run's workers cut them."""
    metrics = JsonlLog(run_dir, "metrics.jsonl")
    metrics.truncate_after(step)
    metrics.flush()
    removed = remove_snapshots_after(run_dir, step)
    if removed:
        print(removed_note(removed, step, "where the run finished"))


def _write_summary(cfg: Config, run_dir: RunDir, invocation: str, planned_step: int, result: WorkerResult | None,
                   checkpoint: str | None, error: str | None, started: float,
                   bad_images: dict[str, Any]) -> dict[str, Any]:
    rows = JsonlLog(run_dir, "metrics.jsonl").rows()
    events = JsonlLog(run_dir, "events.jsonl").rows()
    starts = [e for e in events if e["event"] == "start"]
    this_invocation = [e for e in starts if e["invocation"] == invocation]
    last = rows[-1] if rows else {}
    status = result.status.value if result is not None and error is None else "failed"
    if result is not None and status == "finished" and result.steps != cfg.train.total_steps:
        status = "failed"
    # Without the workers' counts (the run failed, or its workers failed to set up: a result of 0 steps on a run
    # that had more), what the logs show.
    counts = result if result is not None and not (result.steps == 0 and planned_step > 0) else None
    steps = counts.steps if counts else last.get("step", planned_step)
    summary = {
        "status": status,
        "steps": steps,
        "images_seen": counts.images_seen if counts else last.get("images_seen", planned_step * cfg.train.global_batch),
        "final_loss": counts.final_loss if counts and counts.final_loss is not None else last.get("loss"),
        "final_val_loss": counts.val_loss if counts else None,
        "quality": counts.quality if counts else None,
        "checkpoint": checkpoint,
        "world_sizes": list(dict.fromkeys(e["world_size"] for e in starts)),
        "restarts": max(0, len(this_invocation) - 1),
        "resumed_from_step": this_invocation[0]["step"] if this_invocation else planned_step,
        "skipped_steps": counts.skipped_steps if counts else last.get("skipped_steps", 0),
        # (a rollback past the last step logged was in work lost with its session)
        "rollbacks": counts.rollbacks if counts else sum(e["event"] == "rollback" and e.get("from_step", 0) <= steps
                                                         for e in events),
        "bad_images": bad_images,
        "wall_s": round(time.perf_counter() - started, 1),
        "run_dir": str(run_dir),
    }
    diagnostic = error or (result.diagnostic if result else None)
    if diagnostic:
        summary["error"] = diagnostic
    run_dir.write_text("summary.json", json.dumps(json_safe(summary), indent=2) + "\n")
    return summary
