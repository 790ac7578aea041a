"""What a Ray Tune sweep runs: its grid of base learning rates, batch sizes and scaling rules, checked against the
config, its budget and validation points, and the full config of each trial.

Why a module of its own: the plan is decided, and every trial's config checked, before Ray starts (a mistake in
the arguments is one line), and the sweep's outputs name their trials by the same configs
(`raydiff.training.sweep`).
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from raydiff.config import Config, ConfigError
from raydiff.config.checks import validate
from raydiff.config.learning_rate import LR_RULES

REPORTS_PER_TRIAL = 8  # validation points per trial; ASHA's rungs fall on them
EMA_START_SHARE_WARNED = 0.1  # of the initial weights in the EMA at ASHA's first comparison: more is warned of
MAX_SAMPLES = 1000  # base learning rates per batch size and rule (10**9 was a wait of minutes for 8 GB of them)


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

    @property
    def trials(self) -> int:
        return len(self.base_lrs) * len(self.batches) * len(self.rules)

    @property
    def lr_digits(self) -> int:
        """Significant digits of the base LRs in the trials' names: 3, or as many as tell two close ones apart
        (two trials of one name would share a run directory)."""
        return next(d for d in range(3, 18) if len({f"{lr:.{d}g}" for lr in self.base_lrs}) == len(self.base_lrs))

    def grid(self) -> list[dict[str, Any]]:
        """Every trial's parameters, as Tune's grid gives them to the trials."""
        return [{"base_lr": lr, "batch": batch, "rule": rule}
                for lr in self.base_lrs for batch in self.batches for rule in self.rules]

    @property
    def grace_images(self) -> int:
        """Images a trial trains before ASHA may stop it: two validation points."""
        return min(2 * self.interval_images, self.budget_images)


def _parse_lrs(text: str, samples: int) -> tuple[float, ...]:
    """'1e-5:1e-3' -> `samples` log-spaced values, largest first (a single value is allowed)."""
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        raise ConfigError(f"--lr {text!r}: expected LOW:HIGH, for example 1e-5:1e-3") from None
    if not all(math.isfinite(p) for p in parts):  # inf would sweep to an infinite learning rate
        raise ConfigError(f"--lr {text!r}: expected finite learning rates LOW:HIGH, for example 1e-5:1e-3")
    if len(parts) == 1:
        parts *= 2
    low, high = parts if len(parts) == 2 else (0.0, 0.0)
    if not 0 < low <= high or len(parts) != 2:
        raise ConfigError(f"--lr {text!r}: expected LOW:HIGH with 0 < LOW <= HIGH")
    if samples > 1 and low == high:
        raise ConfigError(f"--lr {text!r}: --samples {samples} needs a range, LOW < HIGH")
    lrs = tuple(float(v) for v in np.geomspace(high, low, samples)) if samples > 1 else (high,)
    if len(set(lrs)) != len(lrs):
        raise ConfigError(f"--lr {text!r}: too narrow a range for --samples {samples} different learning rates")
    return lrs


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
    if not 1 <= args.samples <= MAX_SAMPLES:  # each a trial per batch size and rule
        raise ConfigError(f"--samples {args.samples}: must be between 1 and {MAX_SAMPLES}")
    base_lrs, batches = _parse_lrs(args.lr, args.samples), _parse_batches(args.batch)
    rules = LR_RULES if args.scaling == "compare" else (args.scaling,)
    for batch in batches:  # every trial's config must be valid, e.g. divisible by the number of workers
        trial = cfg.replaced("train", global_batch=batch)
        try:
            validate(trial, check_source=False)
        except ConfigError as exc:
            raise ConfigError(f"--batch {batch}: {exc}") from None
    step = math.lcm(*batches)
    # 0 is a budget asked for (and refused below), not the default.
    budget = args.budget_images if args.budget_images is not None else cfg.train.total_steps * cfg.train.global_batch
    if budget < step:
        given = (f"--budget-images {budget}" if args.budget_images is not None else
                 f"the budget of train.total_steps x train.global_batch = {budget:,} images (--budget-images unset)")
        raise ConfigError(f"{given}: must be at least {step} (one step of every batch size)")
    interval = step * max(1, budget // (REPORTS_PER_TRIAL * step))
    budget = -(-budget // interval) * interval
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise ConfigError(f"--max-concurrent {args.max_concurrent}: must be >= 1")
    # '' is a name asked for (and refused below): an unset shell variable would otherwise continue the default sweep.
    name = args.name if args.name is not None else f"sweep-{cfg.run.name}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
    if args.metric == "fid" and "fid" not in cfg.eval.metrics:  # the trials would report no Frechet distance
        raise ConfigError(f"--metric fid: eval.metrics = {list(cfg.eval.metrics)} computes no Frechet distance; "
                          f"add fid to it (--set 'eval.metrics=[fid, kid]') or rank by val_loss")
    metric = "val_loss" if args.metric == "val_loss" else fd_metric_name(cfg)
    sweep = Sweep(name=name, base_lrs=base_lrs, batches=batches, rules=rules, budget_images=budget,
                  interval_images=interval, max_concurrent=args.max_concurrent, metric=metric)
    for params in sweep.grid():  # each trial's own config (its steps, validation points), before Ray starts
        try:
            trial_config(cfg, params, sweep, cfg.run.storage)
        except ConfigError as exc:
            raise ConfigError(f"trial {trial_name(params, sweep.lr_digits)}: {exc}") from None
    warmup_images = cfg.train.warmup_steps * cfg.train.global_batch  # every trial's, in images
    if warmup_images >= sweep.grace_images:
        past = "the whole budget" if warmup_images >= budget else f"ASHA's first comparison at {sweep.grace_images:,}"
        print(f"[raydiff] warning: train.warmup_steps = {cfg.train.warmup_steps} warms the learning rate up over "
              f"{warmup_images:,} images in every trial, past {past}: trials would be ranked while still warming "
              f"up; raise --budget-images or lower train.warmup_steps", file=sys.stderr)
    start_share = ema_start_share(cfg.train, sweep.grace_images // cfg.train.global_batch)
    if start_share > EMA_START_SHARE_WARNED:
        print(f"[raydiff] warning: train.ema_decay = {cfg.train.ema_decay:g} (train.ema_warmup_steps = "
              f"{cfg.train.ema_warmup_steps}) leaves {start_share:.0%} of the start's weights in every trial's "
              f"EMA at ASHA's first comparison at {sweep.grace_images:,} images, and the validation loss is the "
              f"EMA's: trials would be ranked on averages still close to their start; raise --budget-images, or set "
              f"train.ema_warmup_steps or a lower train.ema_decay", file=sys.stderr)
    return sweep


def ema_start_share(t, steps: int) -> float:
    """The share of the start left in the EMA after `steps` optimizer steps of `t`'s decay and warmup (the same in
    every trial: their decays are kept in images): of the random initial weights, or with an EMA warmup, whose
    first update copies the online weights, of the first step's."""
    from raydiff.model.weight_averages import ema_decay_at

    if t.ema_warmup_steps <= 0:
        return t.ema_decay ** steps
    in_warmup = range(1, min(steps, t.ema_warmup_steps))
    after = max(steps - max(t.ema_warmup_steps, 1), 0)
    return math.exp(sum(math.log(ema_decay_at(step, t.ema_decay, t.ema_warmup_steps)) for step in in_warmup)
                    + after * math.log(t.ema_decay))


def fd_metric_name(cfg: Config) -> str:
    """The metrics key of the Frechet distance the run's eval.features give: fid (Inception) or digits_fd."""
    from raydiff.quality.features import feature_kind

    return "digits_fd" if feature_kind(cfg.eval.features, cfg.data.source) == "digits" else "fid"


def concurrent_trials(cfg: Config, cpus: float, gpus: float) -> int:
    """How many trials fit the cluster at once: whole worker groups, on GPUs where a trial trains on them (as
    `use_gpu: auto` decides it for a trial's workers), each worker with its CPUs (one beside a GPU)."""
    from raydiff.cluster.devices import trains_on_gpus  # (torch: not before a mistake in the arguments is said)

    workers = cfg.scaling.max_workers
    use_gpu = trains_on_gpus(cfg.scaling, gpus)
    by_cpus = cpus // (cfg.scaling.cpus_per_worker or 1) // workers
    return max(1, int(min(gpus // workers, by_cpus) if use_gpu else by_cpus))


def trial_config(base: Config, params: dict[str, Any], sweep: Sweep, runs_dir: str) -> Config:
    """The full config of one trial: the base config with this trial's batch, base LR, rule and budget."""
    cfg = copy.deepcopy(base)
    if cfg.scaling.auto:  # a sweep runs trials side by side: one worker each, not every GPU each
        cfg.scaling.num_workers = 1
    t, batch = cfg.train, params["batch"]
    # Trials are compared at equal images seen: keep the LR warmup and decay, the EMA warmup and the EMA half-life
    # what they are in images for the base config (EDM's half-life rule), not in steps, which would favour small
    # batches.
    images_per_base_step = t.global_batch / batch
    t.warmup_steps = round(t.warmup_steps * images_per_base_step)
    t.ema_warmup_steps = round(t.ema_warmup_steps * images_per_base_step)
    t.lr_decay_steps = max(1, round(t.lr_decay_steps * images_per_base_step)) if t.lr_decay_steps else 0
    t.ema_decay = t.ema_decay ** (1 / images_per_base_step)
    if isinstance(t.ema_snapshot_every, int):  # the post-hoc EMA's snapshots too: as many per image in every trial
        t.ema_snapshot_every = max(1, round(t.ema_snapshot_every * images_per_base_step))
    if cfg.eval.every and sweep.metric == "val_loss":  # as many evaluations per image (a sample-quality metric
        cfg.eval.every = max(1, round(cfg.eval.every * images_per_base_step))  # sets its own, below)
    t.global_batch, t.base_lr, t.lr_scaling, t.lr = batch, params["base_lr"], params["rule"], None
    t.total_steps = sweep.budget_images // batch
    t.val_every = t.checkpoint_every = sweep.interval_images // batch  # every report carries a validation loss
    t.log_every = min(t.log_every, t.val_every)
    t.sample_every = 0  # grids only at the end
    if sweep.metric != "val_loss":  # every report carries the Frechet distance too
        cfg.eval.every, cfg.eval.at_end = t.val_every, True
    cfg.run.name = trial_name(params, sweep.lr_digits)
    cfg.run.storage = runs_dir
    cfg.run.keep_checkpoints = 1
    cfg.run.resume = True  # a trial restarted by Tune, or by the same command, continues its own run
    cfg.resolve()
    validate(cfg, check_source=False)
    return cfg


def trial_name(params: dict[str, Any], lr_digits: int = 3) -> str:
    lr = f"{params['base_lr']:.{lr_digits}g}".replace("e+", "e")  # 1e+30 -> 1e30: a run's name takes no '+'
    return f"{params['rule']}-b{params['batch']}-lr{lr}"
