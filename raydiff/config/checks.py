"""Validation of a config: every key's allowed values and the rules between keys, each a one-line `ConfigError`
naming the key, its value and what is allowed. `raydiff.config.load` calls `validate`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import re
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from raydiff.config.schema import Config, ConfigError
from raydiff.storage.fs import SCHEMES

BUILTIN_SOURCES = ("builtin:digits",)
# The oldest release of an optional package that raydiff works with (pyproject.toml's extras say the same).
PACKAGE_FLOORS = {"wandb": "0.19.10"}  # wandb.init(reinit="create_new"): a run object of raydiff's own
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face repository id, e.g. google/ddpm-cifar10-32


def _is_diffusers_unet(location: str) -> bool:
    """A local diffusers pipeline folder (unet/config.json) or UNet2DModel folder (config.json), where such a
    path exists here. Cheap: a new run reads and checks it before training (a missing folder too, which a
    continuing run, never reading it, does not need)."""
    path = Path(location).expanduser()
    if path.exists():
        return (path / "unet" / "config.json").is_file() or (path / "config.json").is_file()
    return True


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {'null' if value is None else repr(value)}: {allowed}")


def validate(cfg: Config, *, check_source: bool = True) -> None:
    d, m, f, t, s, r = cfg.data, cfg.model, cfg.diffusion, cfg.train, cfg.scaling, cfg.run

    # Data.
    if check_source:
        source = d.source
        _check(bool(source), "data.source", source, "required: a folder of images or builtin:digits")
        assert source is not None  # _check raised if it is None or empty
        if source.startswith("builtin:"):
            _check(source in BUILTIN_SOURCES, "data.source", source,
                   f"builtin sources: {', '.join(BUILTIN_SOURCES)}")
        elif "://" not in source:
            _check(Path(source).exists(), "data.source", source, "no such file or folder")
        else:
            _check(source.startswith(SCHEMES), "data.source", source,
                   f"supported URI schemes: {', '.join(SCHEMES)} (or a local path)")
    _check(0 <= d.max_bad_fraction <= 1, "data.max_bad_fraction", d.max_bad_fraction, "must be in [0, 1]")
    _check(bool(d.image_column), "data.image_column", d.image_column, "must name a column")
    _check(d.endpoint is None or "://" in d.endpoint, "data.endpoint", d.endpoint,
           "must be a URL such as http://127.0.0.1:9000, or null")
    _check(d.channels in (1, 3), "data.channels", d.channels, "must be 1 (grayscale) or 3 (RGB)")
    _check(d.cache in ("auto", "memory", "stream"), "data.cache", d.cache, "must be auto, memory or stream")
    _check(d.stream_buffer_gb > 0, "data.stream_buffer_gb", d.stream_buffer_gb, "must be > 0")
    _check(bool(d.label_column), "data.label_column", d.label_column, "must name a column")
    _check(d.stream_window_shards >= 1, "data.stream_window_shards", d.stream_window_shards, "must be >= 1")

    # Model.
    levels = len(m.channel_mult)
    _check(levels >= 1 and all(x >= 1 for x in m.channel_mult), "model.channel_mult", list(m.channel_mult),
           "must be a non-empty list of positive integers")
    _check(8 <= d.resolution <= 1024, "data.resolution", d.resolution, "must be between 8 and 1024")
    _check(d.resolution % 2 ** (levels - 1) == 0, "data.resolution", d.resolution,
           f"must be divisible by 2^(len(model.channel_mult)-1) = {2 ** (levels - 1)}")
    _check(m.base_channels >= 1, "model.base_channels", m.base_channels, "must be >= 1")
    _check(m.norm_groups >= 1, "model.norm_groups", m.norm_groups, "must be >= 1")
    _check(m.norm_eps > 0, "model.norm_eps", m.norm_eps, "must be > 0")
    for mult in (1, *m.channel_mult):
        _check(m.base_channels * mult % m.norm_groups == 0, "model.norm_groups", m.norm_groups,
               f"must divide every channel count (base_channels x channel_mult, here {m.base_channels * mult})")
    _check(m.num_res_blocks >= 1, "model.num_res_blocks", m.num_res_blocks, "must be >= 1")
    resolutions = [d.resolution // 2**i for i in range(levels)]
    for res in m.attention_resolutions:
        _check(res in resolutions, "model.attention_resolutions", list(m.attention_resolutions),
               f"each must be one of the model's resolutions {resolutions}")
    _check(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")
    _check(m.num_classes == "auto" or m.num_classes >= 0, "model.num_classes", m.num_classes,
           "must be 0 (unconditional), a number of classes, or auto")
    _check(m.num_classes == 0 or d.labels == "auto", "model.num_classes", m.num_classes,
           "a class-conditional model learns from labels: set data.labels = auto, or model.num_classes = 0")
    _check(m.init_from is None or _is_diffusers_unet(m.init_from), "model.init_from", m.init_from,
           "must be a diffusers pipeline folder (with unet/config.json), a UNet2DModel folder (with config.json) "
           "or a Hugging Face hub id such as google/ddpm-cifar10-32")

    # Diffusion.
    _check(2 <= f.timesteps <= 100_000, "diffusion.timesteps", f.timesteps, "must be between 2 and 100000")
    # The linear schedule's largest beta is 20/T: T <= 20 gives a beta >= 1 and alpha_bar <= 0 (NaN).
    _check(f.schedule != "linear" or f.timesteps >= 21, "diffusion.timesteps", f.timesteps,
           "must be >= 21 with diffusion.schedule = linear (its largest beta, 20/T, must be < 1)")

    # Training.
    _check(t.global_batch >= 1, "train.global_batch", t.global_batch, "must be >= 1")
    _check(t.micro_batch is None or t.micro_batch == "auto" or t.micro_batch >= 1, "train.micro_batch", t.micro_batch,
           "must be >= 1, auto or null")
    _check(t.lr is None or t.lr > 0, "train.lr", t.lr, "must be > 0, or null to scale train.base_lr")
    _check(t.base_lr > 0, "train.base_lr", t.base_lr, "must be > 0")
    _check(t.base_batch >= 1, "train.base_batch", t.base_batch, "must be >= 1")
    _check(t.lr_scaling_knee >= 1, "train.lr_scaling_knee", t.lr_scaling_knee, "must be >= 1")
    _check(t.val_every >= 0, "train.val_every", t.val_every, "must be >= 0 (0 = only at the end)")
    _check(d.val_images >= 0, "data.val_images", d.val_images, "must be >= 0")
    _check(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0")
    _check(t.total_steps >= 1, "train.total_steps", t.total_steps, "must be >= 1")
    _check(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
    _check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    _check(0 <= t.ema_decay < 1, "train.ema_decay", t.ema_decay, "must be in [0, 1)")
    _check(t.ema_warmup_steps >= 0, "train.ema_warmup_steps", t.ema_warmup_steps, "must be >= 0")
    _check(t.checkpoint_every >= 1, "train.checkpoint_every", t.checkpoint_every, "must be >= 1")
    _check(t.sample_every >= 0, "train.sample_every", t.sample_every, "must be >= 0 (0 = only at the end)")
    _check(t.sample_num >= 1, "train.sample_num", t.sample_num, "must be >= 1")
    _check(t.sample_steps >= 1, "train.sample_steps", t.sample_steps, "must be >= 1")
    _check(t.log_every >= 1, "train.log_every", t.log_every, "must be >= 1")
    _check(t.seed >= 0, "train.seed", t.seed, "must be >= 0")
    _check(0 <= t.label_dropout < 1, "train.label_dropout", t.label_dropout, "must be in [0, 1)")
    _check(t.max_bad_steps >= 1, "train.max_bad_steps", t.max_bad_steps, "must be >= 1")
    _check(t.cuda_graphs is not True or t.compile in (True, "auto"), "train.cuda_graphs", t.cuda_graphs,
           "needs train.compile = true or auto (CUDA graphs are torch.compile's reduce-overhead mode)")
    if isinstance(t.compile, str) and t.compile != "auto":
        from torch._dynamo import list_backends  # only for a backend name: a slow import

        _check(t.compile in list_backends(), "train.compile", t.compile,
               f"auto, true, false, or a torch.compile backend: {', '.join(list_backends())}")

    # Scaling and the batch arithmetic: global = micro x workers x accumulation, exactly.
    n = s.num_workers  # `s.auto` and `s.elastic`, narrowed for the type checker
    if n == "auto":
        pass  # the driver resolves it once it sees the cluster, then checks the batch (`check_workers`)
    elif isinstance(n, tuple):
        _check(len(n) == 2 and 1 <= n[0] <= n[1], "scaling.num_workers",
               list(n), "must be an integer >= 1, or [min, max] with 1 <= min <= max")
    else:
        _check(n >= 1, "scaling.num_workers", n, "must be >= 1")
    _check(s.cpus_per_worker is None or s.cpus_per_worker > 0, "scaling.cpus_per_worker", s.cpus_per_worker,
           "must be > 0 or null")
    _check(s.resize_check_s > 0, "scaling.resize_check_s", s.resize_check_s, "must be > 0 seconds")
    _check(s.node_wait_s > 0, "scaling.node_wait_s", s.node_wait_s, "must be > 0 seconds")
    if not s.auto:
        check_workers(cfg)

    # Run.
    _check(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", r.name) is not None, "run.name", r.name,
           "use letters, digits, '.', '_' and '-' (it names a folder)")
    _check(bool(r.storage), "run.storage", r.storage, "required: a folder for run directories")
    _check("://" not in r.storage or r.storage.startswith(SCHEMES), "run.storage", r.storage,
           f"supported URI schemes: {', '.join(SCHEMES)} (or a local or NFS path)")
    _check(r.endpoint is None or "://" in r.endpoint, "run.endpoint", r.endpoint,
           "must be a URL such as http://127.0.0.1:9000, or null")
    _check(not cfg.debug.record_order or "://" not in r.storage or r.storage.startswith("file://"),
           "debug.record_order", True, "needs a local run.storage")
    _check(r.max_failures >= -1, "run.max_failures", r.max_failures, "must be >= 0, or -1 for unlimited")
    _check(r.keep_checkpoints >= 1, "run.keep_checkpoints", r.keep_checkpoints, "must be >= 1")
    _check(r.lease_stale_s >= 4, "run.lease_stale_s", r.lease_stale_s,
           "must be >= 4 seconds (the lease is renewed every quarter of it)")

    # Evaluation and dashboards.
    e = cfg.eval
    _check(e.every >= 0, "eval.every", e.every, "must be >= 0 (0 = none during the run)")
    _check(e.num >= 2, "eval.num", e.num, "must be >= 2 (a covariance needs two images; FID uses 50000)")
    _check(e.steps >= 1, "eval.steps", e.steps, "must be >= 1")
    _check(e.seed >= 0, "eval.seed", e.seed, "must be >= 0")
    _check(math.isfinite(e.guidance) and e.guidance >= 0, "eval.guidance", e.guidance,
           "must be a number >= 0 (1 = conditional without guidance, 0 = unconditional)")
    _check(len(e.metrics) >= 1 and set(e.metrics) <= {"fid", "kid"}, "eval.metrics", list(e.metrics),
           "must be a list of fid and/or kid")
    _check(e.features != "digits" or d.source == "builtin:digits", "eval.features", e.features,
           "digits features apply to data.source = builtin:digits only; use inception or auto")
    _check(e.inception_weights is None or "://" in e.inception_weights or Path(e.inception_weights).is_file(),
           "eval.inception_weights", e.inception_weights, "no such file")
    _check(cfg.log.mlflow_uri is None or bool(cfg.log.mlflow_uri.strip()), "log.mlflow_uri", cfg.log.mlflow_uri,
           "must be a tracking URI such as http://127.0.0.1:5000, or null")
    _check(bool(cfg.log.mlflow_experiment), "log.mlflow_experiment", cfg.log.mlflow_experiment, "must name one")
    for key, package in (("mlflow_uri", "mlflow"), ("wandb_project", "wandb")):
        if getattr(cfg.log, key):
            _check(importlib.util.find_spec(package) is not None, f"log.{key}", getattr(cfg.log, key),
                   f"needs the {package} package: pip install 'raydiff[{package}]'")
            installed, floor = _version(package), PACKAGE_FLOORS.get(package)
            _check(floor is None or installed is None or installed >= Version(floor), f"log.{key}",
                   getattr(cfg.log, key), f"needs {package} >= {floor} (installed: {installed}): pip install -U "
                                          f"'raydiff[{package}]'")

    # Debug.
    _check(all(step >= 1 for step in cfg.debug.nan_at_steps), "debug.nan_at_steps", list(cfg.debug.nan_at_steps),
           "steps are counted from 1")
    _check(all(i >= 0 for i in cfg.debug.nan_at_samples), "debug.nan_at_samples", list(cfg.debug.nan_at_samples),
           "sample indices are >= 0")
    _check(cfg.debug.preemption_from_step >= 0, "debug.preemption_from_step", cfg.debug.preemption_from_step,
           "must be >= 0 (0 = never)")
    _check(0 <= cfg.debug.step_delay_s <= 60, "debug.step_delay_s", cfg.debug.step_delay_s, "must be in [0, 60]")


def _version(package: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(package))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def check_workers(cfg: Config) -> None:
    """The global batch against a known number of workers (validate() calls it; the driver again once it has
    resolved `scaling.num_workers: auto`)."""
    s, t = cfg.scaling, cfg.train
    _check(t.global_batch >= s.max_workers, "train.global_batch", t.global_batch,
           f"must be at least the number of workers ({s.max_workers}): every worker needs a sample per step")
    w = s.num_workers
    if not isinstance(w, tuple):  # not elastic
        # A fixed world size must reach the global batch exactly as micro_batch x workers x accumulation.
        # (Elastic runs split each global batch as evenly as the current world size allows instead.)
        assert w != "auto"  # resolved before this is called (validate skips it for auto)
        _check(t.global_batch % w == 0, "train.global_batch", t.global_batch,
               f"not reachable with scaling.num_workers = {w}: must be a multiple of the number of workers")
        per_worker = t.global_batch // w
        _check(not isinstance(t.micro_batch, int) or per_worker % t.micro_batch == 0, "train.micro_batch",
               t.micro_batch,
               f"train.global_batch = {t.global_batch} is not reachable as micro_batch x {w} workers x "
               f"accumulation: {per_worker} images per worker must be a multiple of micro_batch")
