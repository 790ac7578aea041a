"""Ray Tune sweeps of learning rate and batch size, with the LR scaling rule put to the test.

    python -m raydiff.tune [--config NAME_OR_PATH] [--set key=value ...] --lr 1e-5:1e-3 --batch 64,128,256
        [--scaling linear|sqrt|none|compare] [--samples N] [--max-concurrent K] [--budget-images M] [--name SWEEP]
        [--metric val_loss|fid]

Every trial is a full raydiff run (a Ray Train TorchTrainer launched from a Tune function trainable) on images
decoded once for the whole sweep. --lr is the range of the base learning rate (at train.base_batch); --samples
log-spaced values of it are tried for every batch size and scaling rule. Trials train on the same number of
images whatever their batch and are compared on a held-out validation loss (fixed images, timesteps and
noise), evaluated at the same images-seen points in every trial; ASHA stops the worse ones early. With
--metric fid they are compared on the Frechet distance of eval.features there instead.
`--scaling compare` runs every rule: if a rule holds, the best base learning rate is the same at every batch
size under it, so the sweep reports the spread of the best base LR across batch sizes per rule.

Writes to <run.storage>/<SWEEP>/: results.csv (a row per trial), best.yaml (the best trial's config, which
`python -m raydiff.train --config best.yaml` accepts), sweep.png, summary.json. Re-running the same command
continues an interrupted sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import json
import math
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from raydiff import cli
from raydiff.config import Config, ConfigError, load_config, preset_names
from raydiff.config.checks import validate
from raydiff.config.learning_rate import LR_RULES

REPORTS_PER_TRIAL = 8  # validation points per trial; ASHA's rungs fall on them
TRIAL_CPU = 0.01  # a trial only waits on its TorchTrainer (Tune refuses 0); its workers hold the real CPUs
DEFAULT_VAL_IMAGES = 256
LAYOUT_FILE = "data.json"  # the sweep's data layout, kept by a re-run
# Each trial's Ray Train controller ends with the trial (finished, or stopped by ASHA) and the run's placement-group
# cleaner warns that it found it dead: routine in a sweep (in a single run it would signal a fault, and shows).
TRIAL_CONTROLLER_GONE = re.compile(r"Detected that the Ray Train controller actor \(\w+\) is dead")


@dataclass(frozen=True)
class Sweep:
    """What a sweep runs: its name, grid and budget (saved as sweep.json so that a re-run can check it)."""

    name: str
    base_lrs: tuple[float, ...]
    batches: tuple[int, ...]
    rules: tuple[str, ...]
    budget_images: int  # images per trial, a multiple of interval_images
    interval_images: int  # images between validation points, a multiple of every batch size
    max_concurrent: int | None  # None: as many as the cluster fits
    metric: str = "val_loss"  # what trials are ranked by (lower is better): val_loss, fid or digits_fd


def _parse_lrs(text: str, samples: int) -> tuple[float, ...]:
    """'1e-5:1e-3' -> `samples` log-spaced values, largest first (a single value is allowed)."""
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        raise ConfigError(f"--lr {text!r}: expected LOW:HIGH, for example 1e-5:1e-3") from None
    if len(parts) == 1:
        parts *= 2
    low, high = parts if len(parts) == 2 else (0.0, 0.0)
    if not 0 < low <= high or len(parts) != 2:
        raise ConfigError(f"--lr {text!r}: expected LOW:HIGH with 0 < LOW <= HIGH")
    if samples > 1 and low == high:
        raise ConfigError(f"--lr {text!r}: --samples {samples} needs a range, LOW < HIGH")
    return tuple(float(v) for v in np.geomspace(high, low, samples)) if samples > 1 else (high,)


def _parse_batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise ConfigError(f"--batch {text!r}: expected comma-separated integers, for example 64,128,256") from None
    if not batches or any(b < 1 for b in batches) or len(set(batches)) != len(batches):
        raise ConfigError(f"--batch {text!r}: expected distinct positive integers, for example 64,128,256")
    return tuple(sorted(batches))


def plan_sweep(args: argparse.Namespace, cfg: Config) -> Sweep:
    """Check the arguments against the config; raises ConfigError with one line."""
    if args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: must be >= 1")
    base_lrs, batches = _parse_lrs(args.lr, args.samples), _parse_batches(args.batch)
    rules = LR_RULES if args.scaling == "compare" else (args.scaling,)
    for batch in batches:  # every trial's config must be valid, e.g. divisible by the number of workers
        trial = cfg.replaced("train", global_batch=batch)
        try:
            validate(trial, check_source=False)
        except ConfigError as exc:
            raise ConfigError(f"--batch {batch}: {exc}") from None
    step = math.lcm(*batches)
    budget = args.budget_images or cfg.train.total_steps * cfg.train.global_batch
    if budget < step:
        raise ConfigError(f"--budget-images {budget}: must be at least {step} (one step of every batch size)")
    interval = step * max(1, budget // (REPORTS_PER_TRIAL * step))
    budget = -(-budget // interval) * interval
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise ConfigError(f"--max-concurrent {args.max_concurrent}: must be >= 1")
    name = args.name or f"sweep-{cfg.run.name}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
    metric = "val_loss" if args.metric == "val_loss" else fd_metric_name(cfg)
    return Sweep(name=name, base_lrs=base_lrs, batches=batches, rules=rules, budget_images=budget,
                 interval_images=interval, max_concurrent=args.max_concurrent, metric=metric)


def fd_metric_name(cfg: Config) -> str:
    """The metrics key of the Frechet distance the run's eval.features give: fid (Inception) or digits_fd."""
    from raydiff.quality.features import feature_kind

    return "digits_fd" if feature_kind(cfg.eval.features, cfg.data.source) == "digits" else "fid"


def concurrent_trials(cfg: Config, cpus: float, gpus: float) -> int:
    """How many trials fit the cluster at once: whole worker groups, on GPUs if the run uses them."""
    workers = cfg.scaling.max_workers
    use_gpu = gpus > 0 if cfg.scaling.use_gpu == "auto" else cfg.scaling.use_gpu
    fit = gpus // workers if use_gpu else cpus // (cfg.scaling.cpus_per_worker or 1) // workers
    return max(1, int(fit))


def trial_config(base: Config, params: dict[str, Any], sweep: Sweep, runs_dir: str) -> Config:
    """The full config of one trial: the base config with this trial's batch, base LR, rule and budget."""
    cfg = copy.deepcopy(base)
    if cfg.scaling.auto:  # a sweep runs trials side by side: one worker each, not every GPU each
        cfg.scaling.num_workers = 1
    t, batch = cfg.train, params["batch"]
    # Trials are compared at equal images seen: keep the LR warmup, the EMA warmup and the EMA half-life what they
    # are in images for the base config (EDM's half-life rule), not in steps, which would favour small batches.
    images_per_base_step = t.global_batch / batch
    t.warmup_steps = round(t.warmup_steps * images_per_base_step)
    t.ema_warmup_steps = round(t.ema_warmup_steps * images_per_base_step)
    t.ema_decay = t.ema_decay ** (1 / images_per_base_step)
    t.global_batch, t.base_lr, t.lr_scaling, t.lr = batch, params["base_lr"], params["rule"], None
    t.total_steps = sweep.budget_images // batch
    t.val_every = t.checkpoint_every = sweep.interval_images // batch  # every report carries a validation loss
    t.log_every = min(t.log_every, t.val_every)
    t.sample_every = 0  # grids only at the end
    if sweep.metric != "val_loss":  # every report carries the Frechet distance too
        cfg.eval.every, cfg.eval.at_end = t.val_every, True
    cfg.run.name = trial_name(params)
    cfg.run.storage = runs_dir
    cfg.run.keep_checkpoints = 1
    cfg.resolve()
    validate(cfg, check_source=False)
    return cfg


def trial_name(params: dict[str, Any]) -> str:
    return f"{params['rule']}-b{params['batch']}-lr{params['base_lr']:.3g}"


def _run_trial(params: dict[str, Any], *, base: Config, sweep: Sweep, runs_dir: str, images,
               cpus_per_trial: float, trial_runs) -> None:
    """A Tune function trainable: one raydiff run whose every report reaches Tune."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raydiff.training.cadence import ray_report
    from raydiff.training.driver import run_training
    from raydiff.training.reservations import note_trial_run

    cfg = trial_config(base, params, sweep, runs_dir)
    summary = run_training(cfg, images=images, cpus=cpus_per_trial, callbacks=[TuneReportCallback()],
                           note_run=lambda requester: note_trial_run(trial_runs, requester))
    # A trial Tune runs again whose run had nothing left to train (Tune's state set aside, or a sweep driver
    # killed after the trial's last checkpoint): its final measurements, restored, count again.
    nothing_left = summary.get("already_finished") or summary.get("resumed_from_step") == summary.get("steps")
    if summary["status"] == "finished" and nothing_left:
        tune.report(ray_report(summary["steps"], cfg.train.global_batch, summary["quality"], summary["final_val_loss"]))
    if summary["status"] not in ("finished",):
        raise RuntimeError(f"trial {cfg.run.name} {summary['status']}: {summary.get('error', 'unknown error')}")


def _require_state_api() -> None:
    """ASHA stops a trial by killing it, and with it the trial's Ray Train controller; Ray then frees that run's
    placement group through its state API (served by the dashboard). Without it the freed CPUs/GPUs stay
    reserved and the next trial waits forever, so refuse up front."""
    from ray.util.state import list_actors

    try:
        list_actors(limit=1, timeout=10, raise_on_missing_output=False)
    except Exception:
        raise ConfigError("this Ray cluster has no state API (started without the dashboard): sweeps need it to "
                          "free the resources of stopped trials; start Ray with the dashboard (the default of "
                          "`ray start --head`, or pip install 'ray[default]')") from None


def run_sweep(cfg: Config, sweep: Sweep) -> dict[str, Any]:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raydiff.cluster.nodes import wait_for_worker_node
    from raydiff.cluster.start import drop_worker_lines, init_ray
    from raydiff.runs.sweep_state import set_aside_unusable_tune_state
    from raydiff.storage.rundir import unwritable
    from raydiff.training.driver import with_held_out
    from raydiff.training.reservations import TrialRuns, releasing_killed_trials
    from raydiff.training.stop import noting_tune_interrupt

    sweep_dir = Path(cfg.run.storage) / sweep.name
    spec_file = sweep_dir / "sweep.json"
    spec = {**sweep.__dict__, "config": cfg.to_dict()}
    spec = json.loads(json.dumps(spec))  # tuples -> lists, as read back
    if spec_file.exists() and json.loads(spec_file.read_text()) != spec:
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
    concurrent = sweep.max_concurrent or concurrent_trials(cfg, cpus, resources.get("GPU", 0))
    images, cache = sweep_images(cfg, sweep_dir, concurrent)
    if cfg.data.val_images >= images.num_good:
        raise ConfigError(f"data.val_images = {cfg.data.val_images}: must be below the {images.num_good} images")
    images = with_held_out(cfg, images)  # once for every trial: they all hold out the same images
    print(f"[raydiff] sweep {sweep.name}: {len(sweep.base_lrs)} base LR(s) x {len(sweep.batches)} batch size(s) x "
          f"{len(sweep.rules)} rule(s) = {len(sweep.base_lrs) * len(sweep.batches) * len(sweep.rules)} trials of "
          f"{sweep.budget_images:,} images, validation every {sweep.interval_images:,} images on "
          f"{cfg.data.val_images} held-out images, {concurrent} at a time; {cache}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(spec, indent=2) + "\n")
    (sweep_dir / LAYOUT_FILE).write_text(json.dumps({"layout": images.layout()}, indent=2) + "\n")

    trial_runs = TrialRuns.remote()  # type: ignore[attr-defined]  # @ray.remote adds .remote
    trainable = tune.with_resources(
        tune.with_parameters(_run_trial, base=cfg, sweep=sweep, runs_dir=str(sweep_dir / "runs"),
                             images=images, cpus_per_trial=cpus / concurrent - TRIAL_CPU, trial_runs=trial_runs),
        {"CPU": TRIAL_CPU},
    )
    experiment = str(sweep_dir / "tune")
    set_aside = set_aside_unusable_tune_state(Path(experiment))
    if set_aside:
        print(f"[raydiff] {set_aside}")
    if tune.Tuner.can_restore(experiment):
        print(f"[raydiff] continuing the sweep in {sweep_dir}")
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_errored=True)
    else:
        scheduler = ASHAScheduler(time_attr="images_seen", max_t=sweep.budget_images,
                                  grace_period=min(2 * sweep.interval_images, sweep.budget_images),
                                  reduction_factor=2)
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
    with releasing_killed_trials(trial_runs), noting_tune_interrupt() as interrupt, without_tune_banner():
        grid = tuner.fit()
    if interrupt["signal"]:  # Tune saved its state; the results so far are not the sweep's
        return {"interrupted": interrupt["signal"], "dir": str(sweep_dir)}
    rows = [_result_row(grid[i], cfg, sweep, sweep_dir) for i in range(len(grid))]
    return write_outputs(rows, cfg, sweep, sweep_dir)


@contextlib.contextmanager
def without_tune_banner() -> Iterator[None]:
    """Tune's start banner off. At `verbose=0` Tune's current output engine still prints a table of its search
    algorithm and scheduler, its experiment folder and a `tensorboard` command for a folder of the Ray session,
    where raydiff's own lines say what the sweep is and where its results are; its legacy engine
    (`RAY_AIR_NEW_OUTPUT=0`, read when the sweep starts) prints nothing at `verbose=0`. Tune's log messages (a
    trial's error, its interruption) are unchanged."""
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["RAY_AIR_NEW_OUTPUT"]
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def sweep_images(cfg: Config, sweep_dir: Path, concurrent: int):
    """The images every trial trains on, decoded once: `open_images` with two sweep rules. Streamed, the K trials
    that run at once on a node split `data.stream_buffer_gb` (each node cache holds a K-th of it, so the node
    holds what the key says, not K times that). A re-run of the sweep keeps the layout it began with (the
    sweep's data.json), so that its trials continue in their sample order."""
    from raydiff.data.run_images import open_images
    from raydiff.data.sources import source_of

    layout_file = sweep_dir / LAYOUT_FILE
    keep = json.loads(layout_file.read_text())["layout"] if layout_file.is_file() else None
    images, cache = open_images(cfg.data, source_of(cfg.data), storage=cfg.run.storage, endpoint=cfg.run.endpoint,
                                keep=keep, buffer_share=1 / concurrent, lease_stale_s=cfg.run.lease_stale_s,
                                use_gpu=cfg.scaling.use_gpu)
    if images.layout()["cache"] == "stream" and concurrent > 1:
        cache += f" (each trial's node cache holds 1/{concurrent} of data.stream_buffer_gb: {concurrent} at a time)"
    return images, cache


def _result_row(result, cfg: Config, sweep: Sweep, sweep_dir: Path) -> dict[str, Any]:
    params = result.config
    metrics = result.metrics or {}
    images_seen = metrics.get("images_seen", 0)
    if result.error is not None:
        status = "error"
    else:
        status = "finished" if images_seen >= sweep.budget_images else "stopped"
    trial = trial_config(cfg, params, sweep, str(sweep_dir / "runs"))
    return {"trial": trial.run.name, "rule": params["rule"], "batch": params["batch"], "base_lr": params["base_lr"],
            "lr": trial.train.lr, "images_seen": images_seen, "val_loss": metrics.get("val_loss"),
            **({sweep.metric: metrics.get(sweep.metric)} if sweep.metric != "val_loss" else {}), "status": status}


def rule_spread(rows: list[dict[str, Any]], metric: str = "val_loss") -> dict[str, Any]:
    """Per rule: the best base LR at each batch size (finished trials) and their spread in decades. A rule that
    holds puts the optimum at the same base LR for every batch: a spread near 0."""
    out = {}
    for rule in sorted({r["rule"] for r in rows}):
        best = {}
        for batch in sorted({r["batch"] for r in rows}):
            done = [r for r in rows if r["rule"] == rule and r["batch"] == batch and r["status"] == "finished"
                    and r[metric] is not None]
            if done:
                best[batch] = min(done, key=lambda r: r[metric])["base_lr"]
        spread = float(np.ptp(np.log10(list(best.values())))) if len(best) > 1 else None
        out[rule] = {"best_base_lr_by_batch": best, "spread_decades": spread}
    return out


def write_outputs(rows: list[dict[str, Any]], cfg: Config, sweep: Sweep, sweep_dir: Path) -> dict[str, Any]:
    from raydiff.plots import plot_sweep

    rows = sorted(rows, key=lambda r: (r["rule"], r["batch"], -r["base_lr"]))
    with (sweep_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_sweep(rows, sweep_dir / "sweep.png")
    metric = sweep.metric
    finished = [r for r in rows if r["status"] == "finished" and r[metric] is not None]
    summary: dict[str, Any] = {"sweep": sweep.name, "metric": metric, "trials": len(rows),
                               "finished": len(finished), "stopped": sum(r["status"] == "stopped" for r in rows),
                               "errors": sum(r["status"] == "error" for r in rows), "rules": rule_spread(rows, metric)}
    if finished:
        best = min(finished, key=lambda r: r[metric])
        best_cfg = trial_config(cfg, best, sweep, cfg.run.storage)
        best_cfg.run.name = f"{sweep.name}-best"
        best_cfg.train.lr = None  # re-derived from base_lr by the rule, so a changed global_batch rescales it
        best_cfg.run.keep_checkpoints = cfg.run.keep_checkpoints
        best_cfg.scaling = copy.deepcopy(cfg.scaling)  # the long run's workers, not a trial's (auto: one each)
        header = (f"# Best trial of sweep {sweep.name}: {best['trial']}, {metric} {best[metric]:.5g} after "
                  f"{best['images_seen']:,} images.\n# Train it longer with --set train.total_steps=N.\n")
        (sweep_dir / "best.yaml").write_text(header + yaml.safe_dump(best_cfg.to_dict(), sort_keys=False))
        summary["best"] = best
    (sweep_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["dir"] = str(sweep_dir)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m raydiff.tune", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default", help=f"preset ({', '.join(preset_names())}) or YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--lr", required=True, help="base learning rate range LOW:HIGH (log scale)")
    parser.add_argument("--batch", required=True, help="global batch sizes, comma-separated")
    parser.add_argument("--scaling", choices=(*LR_RULES, "compare"), default="linear",
                        help="LR scaling rule from base_batch to each batch; compare = all rules (default linear)")
    parser.add_argument("--samples", type=int, default=3, help="base learning rates per batch and rule (default 3)")
    parser.add_argument("--max-concurrent", type=int, default=None,
                        help="trials at a time (default: as many as the cluster's CPUs/GPUs fit)")
    parser.add_argument("--budget-images", type=int, default=None,
                        help="images each trial trains on (default: the config's total_steps x global_batch)")
    parser.add_argument("--name", default=None, help="sweep folder under run.storage (default sweep-<run.name>)")
    parser.add_argument("--metric", choices=("val_loss", "fid"), default="val_loss",
                        help="rank trials by the validation loss (default) or the Frechet distance of eval.features "
                             "(FID; digits_fd on the built-in digits), measured at every validation point")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    if cfg.data.val_images == 0:
        cfg.data.val_images = DEFAULT_VAL_IMAGES
        validate(cfg)
    if "://" in cfg.run.storage:
        raise ConfigError(f"run.storage = {cfg.run.storage!r}: sweeps need a local or NFS folder for now (their "
                          f"trials' results are gathered from it); single runs accept s3:// and gs://")
    sweep = plan_sweep(args, cfg)
    summary = run_sweep(cfg, sweep)
    if "interrupted" in summary:
        print(f"[raydiff] sweep {sweep.name} stopped by {summary['interrupted']}, its state saved in "
              f"{summary['dir']}: the same command continues it (each trial from its newest checkpoint)")
        return 128 + signal.Signals[summary["interrupted"]].value
    print(f"[raydiff] sweep {sweep.name}: {summary['finished']} finished, {summary['stopped']} stopped early by "
          f"ASHA, {summary['errors']} failed")
    for rule, info in summary["rules"].items():
        best = ", ".join(f"batch {b}: {lr:.3g}" for b, lr in info["best_base_lr_by_batch"].items())
        spread = f"; spread {info['spread_decades']:.2f} decades" if info["spread_decades"] is not None else ""
        print(f"[raydiff] {rule} rule: best base LR {best or '-'}{spread}")
    if "best" in summary:
        best = summary["best"]
        metric = summary["metric"]
        print(f"[raydiff] best: {best['trial']} (lr {best['lr']:.3g}), {metric} {best[metric]:.5g}")
        print(f"[raydiff] train it: python -m raydiff.train --config {summary['dir']}/best.yaml")
    print(f"[raydiff] results: {summary['dir']}/results.csv, sweep.png, summary.json")
    return 0 if "best" in summary else 1


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
