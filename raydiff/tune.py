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
import copy
import csv
import json
import math
import signal
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from raydiff import cli
from raydiff.config import Config, ConfigError, load_config, preset_names
from raydiff.config.checks import validate
from raydiff.config.learning_rate import LR_RULES
from raydiff.storage.atomic import new_file
from raydiff.storage.errors import output_errors
from raydiff.storage.fs import is_remote
from raydiff.training.sweep import TrialFailed, run_sweep
from raydiff.training.sweep_plan import Sweep, plan_sweep, trial_config

DEFAULT_VAL_IMAGES = 256


def ranked(row: dict[str, Any], metric: str) -> bool:
    """Whether a trial takes part in the ranking: finished, with a finite metric (a NaN sorted first was the best)."""
    return row["status"] == "finished" and row[metric] is not None and math.isfinite(row[metric])


def rule_spread(rows: list[dict[str, Any]], metric: str = "val_loss") -> dict[str, Any]:
    """Per rule: the best base LR at each batch size (finished trials) and their spread in decades. A rule that
    holds puts the optimum at the same base LR for every batch: a spread near 0. A batch may have no finished trial
    (all failed or diverged), and a batch's best may be the lowest or highest base LR tried, where the optimum may
    lie beyond: such batches are listed, and the spread, which would describe the other batches alone or the
    edges of --lr, is withheld."""
    out = {}
    for rule in sorted({r["rule"] for r in rows}):
        best, unfinished, at_the_edge = {}, [], []
        for batch in sorted({r["batch"] for r in rows}):
            tried = [r for r in rows if r["rule"] == rule and r["batch"] == batch]
            done = [r for r in tried if ranked(r, metric)]
            if not done:
                unfinished.append(batch)
                continue
            best[batch] = min(done, key=lambda r: r[metric])["base_lr"]
            if best[batch] in (min(r["base_lr"] for r in tried), max(r["base_lr"] for r in tried)):
                at_the_edge.append(batch)
        known = len(best) > 1 and not unfinished and not at_the_edge
        out[rule] = {"best_base_lr_by_batch": best, "spread_decades": float(np.ptp(np.log10(list(best.values()))))
                     if known else None, "batches_without_a_finished_trial": unfinished,
                     "batches_best_at_the_edge_of_lr": at_the_edge}
    return out


def write_outputs(rows: list[dict[str, Any]], cfg: Config, sweep: Sweep, sweep_dir: Path,
                  failed: dict[str, str] | None = None) -> dict[str, Any]:
    """results.csv, sweep.png, best.yaml (from the best finished trial) and summary.json, which also keeps the line
    of each trial that `failed` with one of raydiff's one-line errors, by trial."""
    from raydiff.plots import plot_sweep

    rows = sorted(rows, key=lambda r: (r["rule"], r["batch"], -r["base_lr"]))
    with new_file(sweep_dir / "results.csv") as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_sweep(rows, sweep_dir / "sweep.png")
    metric = sweep.metric
    finished = [r for r in rows if ranked(r, metric)]
    summary: dict[str, Any] = {"sweep": sweep.name, "metric": metric, "trials": len(rows),
                               "finished": len(finished), "stopped": sum(r["status"] == "stopped" for r in rows),
                               "diverged": sum(r["status"] == "diverged" for r in rows),
                               "errors": sum(r["status"] == "error" for r in rows), "failed_trials": failed or {},
                               "rules": rule_spread(rows, metric)}
    if finished:
        best = min(finished, key=lambda r: r[metric])
        best_cfg = trial_config(cfg, best, sweep, cfg.run.storage)
        best_cfg.run.name = f"{sweep.name}-best"
        best_cfg.train.lr = None  # re-derived from base_lr by the rule, so a changed global_batch rescales it
        best_cfg.run.keep_checkpoints = cfg.run.keep_checkpoints
        best_cfg.scaling = copy.deepcopy(cfg.scaling)  # the long run's workers, not a trial's (auto: one each)
        header = (f"# Best trial of sweep {sweep.name}: {best['trial']}, {metric} {best[metric]:.5g} after "
                  f"{best['images_seen']:,} images.\n# Train it longer with --set train.total_steps=N.\n")
        with new_file(sweep_dir / "best.yaml") as tmp:
            tmp.write_text(header + yaml.safe_dump(best_cfg.to_dict(), sort_keys=False))
        summary["best"] = best
    with new_file(sweep_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    summary["dir"] = str(sweep_dir)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.tune", description=__doc__.split("\n\n")[0],
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
    if is_remote(cfg.run.storage):
        raise ConfigError(f"run.storage = {cfg.run.storage!r}: sweeps need a local or NFS folder for now (their "
                          f"trials' results are gathered from it); single runs accept s3:// and gs://")
    sweep = plan_sweep(args, cfg)
    ran = run_sweep(cfg, sweep)
    if "interrupted" in ran:
        print(f"[raydiff] sweep {sweep.name} stopped by {ran['interrupted']}, its state saved in "
              f"{ran['dir']}: the same command continues it (each trial from its newest checkpoint)")
        return 128 + signal.Signals[ran["interrupted"]].value
    with output_errors("run.storage", ran["dir"]):
        summary = write_outputs(ran["rows"], cfg, sweep, Path(ran["dir"]), ran["failed"])
    print(f"[raydiff] sweep {sweep.name}: {summary['finished']} finished, {summary['stopped']} stopped early by "
          f"ASHA, {summary['diverged']} diverged, {summary['errors']} failed")
    for rule, info in summary["rules"].items():
        best = ", ".join(f"batch {b}: {lr:.{sweep.lr_digits}g}" for b, lr in info["best_base_lr_by_batch"].items())
        spread = f"; spread {info['spread_decades']:.2f} decades" if info["spread_decades"] is not None else ""
        unfinished, at_the_edge = info["batches_without_a_finished_trial"], info["batches_best_at_the_edge_of_lr"]
        if at_the_edge:
            spread = (f"; batch {', '.join(map(str, at_the_edge))}: best at an end of --lr (the optimum may lie "
                      f"beyond: widen --lr), so no spread")
        if unfinished:
            spread = f"; batch {', '.join(map(str, unfinished))}: no trial finished (failed or diverged), so no spread"
        print(f"[raydiff] {rule} rule: best base LR {best or '-'}{spread}")
    if "best" in summary:
        best = summary["best"]
        metric = summary["metric"]
        print(f"[raydiff] best: {best['trial']} (lr {best['lr']:.3g}), {metric} {best[metric]:.5g}")
        print(f"[raydiff] train it: python -m raydiff.train --config {summary['dir']}/best.yaml")
    print(f"[raydiff] results: {summary['dir']}/results.csv, sweep.png, summary.json")
    if ran["failed"]:
        raise TrialFailed(f"{len(ran['failed'])} of {len(ran['rows'])} trials failed (each said why above); once that "
                          f"is fixed, the same command runs them again")
    if summary["errors"]:  # failed otherwise than in one of raydiff's lines: Tune's traceback says why
        raise TrialFailed(f"{summary['errors']} of {len(ran['rows'])} trials failed (Tune's traceback above says "
                          f"why); the same command runs them again")
    if "best" not in summary:
        raise TrialFailed(f"no trial of sweep {sweep.name} finished ({summary['diverged']} diverged: lower the --lr "
                          f"range; {summary['stopped']} stopped early by ASHA), so there is no best.yaml")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
