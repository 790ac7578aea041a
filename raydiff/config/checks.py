"""Validation of a config: every key's allowed values and the rules between keys, as a table (`RULES`) of one-line
`ConfigError`s naming the key, its value and what is allowed. `raydiff.config.load` calls `validate`.

What the schema's types already refuse (a word outside a key's choices, a string for a number) never reaches this
table: `raydiff.config.schema.set_key` refuses it when the value is set.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from packaging.version import InvalidVersion, Version

from raydiff.config.learning_rate import rule_lr
from raydiff.config.schema import MAX_CLASSES, MAX_SAMPLING_STEPS, Config, ConfigError
from raydiff.config.values import shown
from raydiff.storage.fs import (
    HUB_SCHEME,
    OBJECT_STORE_SCHEMES,
    SCHEMES,
    STORAGE_SCHEMES,
    bucket_uri_problem,
    glob_split,
    hub_uri_problem,
    is_remote,
    scheme_of,
)

MAX_PROFILED_STEPS = 50  # log.profile_steps: a trace holds every kernel and operator, a few MB per GPU step
SEED_LIMIT = 2**64  # train.seed: torch.manual_seed takes a 64-bit unsigned seed, and a worker calls it
SIGMA_REL_MAX = 0.28  # a post-hoc EMA width: exponent > 0 needs sigma_rel < sqrt(1/12) = 0.2887
SIGMA_REL_MIN = 1e-4  # narrower is all extrapolation, and below ~1e-154 its exponent overflows a float

BUILTIN_SOURCES = ("builtin:digits",)
# The oldest release of an optional package that raydiff works with (pyproject.toml's extras say the same).
PACKAGE_FLOORS = {"wandb": "0.19.10"}  # wandb.init(reinit="create_new"): a run object of raydiff's own
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face repository id, e.g. google/ddpm-cifar10-32
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A folder name: file systems take 255 bytes, and raydiff adds up to ~30 (`.replaced-<time>`, `.<hex>.tmp`).
MAX_RUN_NAME = 200


@dataclass(frozen=True)
class Rule:
    """One rule: `key` must satisfy `ok`, else a ConfigError "`key` = `value`: `allowed`".

    :param key: the key the message names.
    :param ok: whether the config keeps the rule.
    :param allowed: what is allowed, or a function of the config that says it (for messages that name a value).
    :param value: the value the message shows (default: the key's own).
    """

    key: str
    ok: Callable[[Config], bool]
    allowed: str | Callable[[Config], str]
    value: Callable[[Config], Any] | None = None

    def check(self, cfg: Config) -> None:
        if self.ok(cfg):
            return
        value = self.value(cfg) if self.value is not None else _value(cfg, self.key)
        _check(False, self.key, value, self.allowed(cfg) if callable(self.allowed) else self.allowed)


def _value(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    return list(value) if isinstance(value, tuple) else value


T = TypeVar("T")
# The longest any wait may be set to (about 3 years): what Python's timed waits (threading.TIMEOUT_MAX, 292 years)
# and Ray's process-group timeout (a timedelta, under 2.7 million years) take, where 1e30 s raised OverflowError.
LONGEST_S = 1e8
AT_MOST_LONGEST = f"and at most {LONGEST_S:,.0f} (about 3 years)"

# torch's debugging backends, which list_backends leaves out (aot_eager: compiles the graph without inductor).
_DEBUG_BACKENDS = ("eager", "aot_eager")
# Backends whose package is imported at the first compiled step, not here: without it, a traceback mid-start.
_BACKEND_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla"}


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Refuse `key` = `value` with what is allowed, in one line, unless `ok`."""
    if not ok:
        raise ConfigError(f"{key} = {shown(value)}: {allowed}")


def look_at(key: str, value: str, what: Callable[[Path], T]) -> T:
    """`what` of the local path `value` of `key`, or one line (ConfigError) where the path cannot be looked at:
    a folder on its way that this user may not enter, a name too long, a NUL, a symlink loop (Path's checks
    raise for those)."""
    try:
        return what(Path(value).expanduser())
    except (OSError, ValueError, RuntimeError) as exc:
        why = exc.strerror.lower() if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{key} = {shown(value)}: cannot look at it ({why})") from None


class _Abridged(str):
    """A long string as a message shows it: its first 40 characters, then '...'."""

    def __repr__(self) -> str:
        return f"{str(self)[:40]!r}..." if len(self) > 40 else super().__repr__()


def is_raydiff_run(location: str) -> bool:
    """A raydiff run or checkpoint folder: on an object store (diffusers reads neither), or a local folder holding
    a checkpoint's state.pt (`raydiff.runs.checkpoint.STATE_FILE`)."""
    if is_remote(location) and location.startswith(STORAGE_SCHEMES):  # where a run's storage may be
        return True
    path = Path(location).expanduser()
    return (path / "state.pt").is_file() or any(path.glob("checkpoint_*/state.pt"))


def _holds_weights(location: str) -> bool:
    """A raydiff run or checkpoint folder, a local diffusers pipeline folder (unet/config.json) or UNet2DModel
    folder (config.json), where such a path exists here. Cheap: a new run reads and checks it before training (a
    missing folder too, which a continuing run, never reading it, does not need)."""
    def holds(path: Path) -> bool:
        if not path.exists():
            return True
        diffusers = (path / "unet" / "config.json").is_file() or (path / "config.json").is_file()
        return diffusers or is_raydiff_run(location)

    return look_at("model.init_from", location, holds)


def _resolutions(cfg: Config) -> list[int]:
    return [cfg.data.resolution // 2**i for i in range(len(cfg.model.channel_mult))]


def _channels_not_divided(cfg: Config) -> list[int]:
    m = cfg.model
    return [m.base_channels * mult for mult in (1, *m.channel_mult) if m.base_channels * mult % m.norm_groups]


def _installed(package: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(package))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def _package_rules(key: str, package: str) -> tuple[Rule, ...]:
    """An optional package a log.* key needs: installed, and not older than raydiff's floor."""
    floor = PACKAGE_FLOORS.get(package)

    def new_enough(c: Config) -> bool:
        installed = _installed(package)
        return floor is None or installed is None or installed >= Version(floor)

    def used(c: Config) -> bool:
        return bool(getattr(c.log, key))

    return (Rule(f"log.{key}", lambda c: not used(c) or importlib.util.find_spec(package) is not None,
                 f"needs the {package} package: pip install 'raydiff[{package}]'"),
            Rule(f"log.{key}", lambda c: not used(c) or new_enough(c),
                 lambda c: f"needs {package} >= {floor} (installed: {_installed(package)}): pip install -U "
                           f"'raydiff[{package}]'"))


# Guidance other than 1 mixes in the unconditional prediction, which a class-conditional model learns only from
# the samples whose labels were dropped.
NO_NULL_CLASS = ("the unconditional prediction it needs is learned only from dropped labels, and train.label_dropout "
                 "= 0: set train.label_dropout > 0 (0.1 to 0.2 in long runs), or guidance 1 (conditional, no guidance)")

# The image sizes raydiff trains at (and prepares, and writes synthetic images of): the UNet needs a few
# halvings; far larger, one image's activations alone would take a GPU's memory.
MIN_RESOLUTION, MAX_RESOLUTION = 8, 1024
# diffusion.timesteps: the linear schedule's largest beta is 20/T, so it needs T >= 21 (a diffusers scheduler's
# num_train_timesteps is held to the same).
MIN_TIMESTEPS, MIN_LINEAR_TIMESTEPS, MAX_TIMESTEPS = 2, 21, 100_000

# The rules, in the order they are checked: the first one broken is the error.
RULES: tuple[Rule, ...] = (
    # Data.
    Rule("data.max_bad_fraction", lambda c: 0 <= c.data.max_bad_fraction <= 1, "must be in [0, 1]"),
    Rule("data.image_column", lambda c: bool(c.data.image_column), "must name a column"),
    Rule("data.endpoint", lambda c: c.data.endpoint is None or "://" in c.data.endpoint,
         "must be a URL such as http://127.0.0.1:9000, or null"),
    Rule("data.channels", lambda c: c.data.channels in (1, 3), "must be 1 (grayscale) or 3 (RGB)"),
    Rule("data.stream_buffer_gb", lambda c: c.data.stream_buffer_gb > 0, "must be > 0"),
    Rule("data.label_column", lambda c: bool(c.data.label_column), "must name a column"),
    Rule("data.stream_window_shards", lambda c: c.data.stream_window_shards >= 1, "must be >= 1"),
    Rule("data.on_device", lambda c: not (c.data.on_device is True and c.data.cache == "stream"),
         "true needs the images in memory, and data.cache is stream: use auto or false"),
    # Model.
    Rule("model.channel_mult", lambda c: len(c.model.channel_mult) >= 1 and all(x >= 1 for x in c.model.channel_mult),
         "must be a non-empty list of positive integers"),
    Rule("data.resolution", lambda c: MIN_RESOLUTION <= c.data.resolution <= MAX_RESOLUTION,
         f"must be between {MIN_RESOLUTION} and {MAX_RESOLUTION}"),
    Rule("data.resolution", lambda c: c.data.resolution % 2 ** (len(c.model.channel_mult) - 1) == 0,
         lambda c: f"must be divisible by 2^(len(model.channel_mult)-1) = {2 ** (len(c.model.channel_mult) - 1)}"),
    # The timestep embedding's frequencies divide by base_channels // 2 - 1: 0 (NaN) at 2 or 3, none at 1.
    Rule("model.base_channels", lambda c: c.model.base_channels >= 4, "must be >= 4 (its sinusoidal timestep "
         "embedding needs two frequencies)"),
    Rule("model.norm_groups", lambda c: c.model.norm_groups >= 1, "must be >= 1"),
    Rule("model.norm_eps", lambda c: c.model.norm_eps > 0, "must be > 0"),
    Rule("model.norm_groups", lambda c: not _channels_not_divided(c),
         lambda c: f"must divide every channel count (base_channels x channel_mult, here "
                   f"{_channels_not_divided(c)[0]})"),
    Rule("model.num_res_blocks", lambda c: c.model.num_res_blocks >= 1, "must be >= 1"),
    Rule("model.attention_resolutions", lambda c: set(c.model.attention_resolutions) <= set(_resolutions(c)),
         lambda c: f"each must be one of the model's resolutions {_resolutions(c)}"),
    Rule("model.dropout", lambda c: 0 <= c.model.dropout < 1, "must be in [0, 1)"),
    Rule("model.num_classes", lambda c: c.model.num_classes == "auto" or 0 <= c.model.num_classes <= MAX_CLASSES,
         f"must be 0 (unconditional), a number of classes up to {MAX_CLASSES:,}, or auto"),
    Rule("model.num_classes", lambda c: c.model.num_classes == 0 or c.data.labels == "auto",
         "a class-conditional model learns from labels: set data.labels = auto, or model.num_classes = 0"),
    Rule("model.init_from", lambda c: c.model.init_from is None or not bucket_uri_problem(c.model.init_from),
         lambda c: str(bucket_uri_problem(c.model.init_from or ""))),
    Rule("model.init_from", lambda c: c.model.init_from is None or _holds_weights(c.model.init_from),
         "must be a raydiff run or checkpoint folder (local, s3:// or gs://), a diffusers pipeline folder (with "
         "unet/config.json), a UNet2DModel folder (with config.json) or a Hugging Face hub id such as "
         "google/ddpm-cifar10-32"),
    # Diffusion. The linear schedule's largest beta is 20/T: T <= 20 gives a beta >= 1 and alpha_bar <= 0 (NaN).
    Rule("diffusion.timesteps", lambda c: MIN_TIMESTEPS <= c.diffusion.timesteps <= MAX_TIMESTEPS,
         f"must be between {MIN_TIMESTEPS} and {MAX_TIMESTEPS}"),
    Rule("diffusion.timesteps",
         lambda c: c.diffusion.schedule != "linear" or c.diffusion.timesteps >= MIN_LINEAR_TIMESTEPS,
         f"must be >= {MIN_LINEAR_TIMESTEPS} with diffusion.schedule = linear (its largest beta, 20/T, must be < 1)"),
    # Training.
    Rule("train.global_batch", lambda c: c.train.global_batch >= 1, "must be >= 1"),
    Rule("train.micro_batch", lambda c: not isinstance(c.train.micro_batch, int) or c.train.micro_batch >= 1,
         "must be >= 1, auto or null"),
    Rule("train.lr", lambda c: c.train.lr is None or c.train.lr > 0, "must be > 0, or null to scale train.base_lr"),
    Rule("train.base_lr", lambda c: c.train.base_lr > 0, "must be > 0"),
    Rule("train.base_batch", lambda c: c.train.base_batch >= 1, "must be >= 1"),
    Rule("train.lr_scaling_knee", lambda c: c.train.lr_scaling_knee >= 1, "must be >= 1"),
    Rule("train.base_lr", lambda c: c.train.lr is not None or _scales_to_a_number(c.train),
         lambda c: f"scaled to train.global_batch = {shown(c.train.global_batch)} (train.lr_scaling = "
                   f"{c.train.lr_scaling}) it is no finite number"),
    Rule("train.lr", lambda c: c.train.lr is None or math.isfinite(c.train.lr),  # as scaled (a sweep's trial)
         lambda c: f"train.base_lr = {c.train.base_lr:g} scaled to train.global_batch = {shown(c.train.global_batch)} "
                   f"is no finite number"),
    Rule("train.val_every", lambda c: c.train.val_every >= 0, "must be >= 0 (0 = only at the end)"),
    Rule("train.val_every", lambda c: c.train.val_every == 0 or c.data.val_images > 0,
         "needs held-out images to measure on (data.val_images = 0): set data.val_images, or train.val_every = 0"),
    Rule("data.val_images", lambda c: c.data.val_images >= 0, "must be >= 0"),
    Rule("train.warmup_steps", lambda c: c.train.warmup_steps >= 0, "must be >= 0"),
    Rule("train.lr_decay_steps", lambda c: c.train.lr_decay != "rsqrt" or c.train.lr_decay_steps >= 1,
         "must be >= 1 with train.lr_decay = rsqrt (the step from which the learning rate falls)"),
    Rule("train.lr_decay_steps", lambda c: c.train.lr_decay == "rsqrt" or c.train.lr_decay_steps == 0,
         lambda c: f"only train.lr_decay = rsqrt reads it (train.lr_decay = {c.train.lr_decay}"
                   + (": it falls to 0 at train.total_steps)" if c.train.lr_decay == "cosine" else ")")
                   + "; leave it 0"),
    Rule("train.total_steps", lambda c: c.train.total_steps >= 1, "must be >= 1"),
    Rule("train.grad_clip", lambda c: c.train.grad_clip >= 0, "must be >= 0 (0 disables clipping)"),
    Rule("train.weight_decay", lambda c: c.train.weight_decay >= 0, "must be >= 0"),
    Rule("train.ema_decay", lambda c: 0 <= c.train.ema_decay < 1, "must be in [0, 1)"),
    Rule("train.ema_warmup_steps", lambda c: c.train.ema_warmup_steps >= 0, "must be >= 0"),
    Rule("train.checkpoint_every", lambda c: c.train.checkpoint_every >= 1, "must be >= 1"),
    Rule("train.ema_sigma_rels", lambda c: len(c.train.ema_sigma_rels) >= 1
         and all(SIGMA_REL_MIN <= s < SIGMA_REL_MAX for s in c.train.ema_sigma_rels)
         and len(set(c.train.ema_sigma_rels)) == len(c.train.ema_sigma_rels),
         f"must be one or more different widths, each in [{SIGMA_REL_MIN:g}, {SIGMA_REL_MAX})"),
    Rule("train.ema_snapshot_every", lambda c: c.train.ema_snapshot_every == "auto" or c.train.ema_snapshot_every >= 1,
         "must be >= 1 or auto"),
    Rule("train.sample_every", lambda c: c.train.sample_every >= 0, "must be >= 0 (0 = only at the end)"),
    Rule("train.sample_num", lambda c: c.train.sample_num >= 1, "must be >= 1"),
    Rule("train.sample_steps", lambda c: 1 <= c.train.sample_steps <= MAX_SAMPLING_STEPS,
         f"must be in [1, {MAX_SAMPLING_STEPS:,}]"),
    Rule("train.log_every", lambda c: c.train.log_every >= 1, "must be >= 1"),
    Rule("train.seed", lambda c: 0 <= c.train.seed < SEED_LIMIT, "must be in [0, 2^64) (torch.manual_seed's range)"),
    Rule("train.min_snr_gamma", lambda c: c.train.min_snr_gamma > 0, "must be > 0"),
    Rule("train.label_dropout", lambda c: 0 <= c.train.label_dropout < 1, "must be in [0, 1)"),
    Rule("train.max_bad_steps", lambda c: c.train.max_bad_steps >= 1, "must be >= 1"),
    Rule("train.cuda_graphs", lambda c: c.train.cuda_graphs is not True or c.train.compile in (True, "auto"),
         "needs train.compile = true or auto (CUDA graphs are torch.compile's reduce-overhead mode)"),
    Rule("train.compile", lambda c: not isinstance(c.train.compile, str) or c.train.compile == "auto"
         or c.train.compile in _backends(), lambda c: f"auto, true, false, or a torch.compile backend: "
                                                      f"{', '.join(_backends())}"),
    Rule("train.compile", lambda c: _backend_installed(c),
         lambda c: f"needs the {_BACKEND_PACKAGES[str(c.train.compile)]} package, which is not installed here"),
    # Scaling: the batch arithmetic against a known number of workers is `check_workers`.
    Rule("scaling.num_workers", lambda c: not isinstance(c.scaling.num_workers, tuple) or (
        len(c.scaling.num_workers) == 2 and 1 <= c.scaling.num_workers[0] <= c.scaling.num_workers[1]),
         "must be an integer >= 1, or [min, max] with 1 <= min <= max"),
    Rule("scaling.num_workers", lambda c: not isinstance(c.scaling.num_workers, int) or c.scaling.num_workers >= 1,
         "must be >= 1"),
    Rule("scaling.cpus_per_worker", lambda c: c.scaling.cpus_per_worker is None or c.scaling.cpus_per_worker > 0,
         "must be > 0 or null"),
    Rule("scaling.cpus_per_worker", lambda c: c.scaling.cpus_per_worker is None or c.scaling.cpus_per_worker >= 1e-4,
         "must be at least 0.0001 (Ray counts CPUs in 1/10,000ths), or null"),
    Rule("scaling.resize_check_s", lambda c: 0 < c.scaling.resize_check_s <= LONGEST_S,
         f"must be > 0 seconds, {AT_MOST_LONGEST}"),
    Rule("scaling.node_wait_s", lambda c: 0 < c.scaling.node_wait_s <= LONGEST_S,
         f"must be > 0 seconds, {AT_MOST_LONGEST}"),
    Rule("scaling.hang_timeout_s", lambda c: 10 <= c.scaling.hang_timeout_s <= LONGEST_S,
         f"must be at least 10 seconds, {AT_MOST_LONGEST}"),
)

# Checked after the workers' batch arithmetic, as before it: run, evaluation, dashboards, debug.
LATER_RULES: tuple[Rule, ...] = (
    Rule("run.name", lambda c: RUN_NAME.fullmatch(c.run.name) is not None,
         "use letters, digits, '.', '_' and '-' (it names a folder)"),
    Rule("run.name", lambda c: len(c.run.name) <= MAX_RUN_NAME,
         lambda c: f"{len(c.run.name)} characters; at most {MAX_RUN_NAME} (it names a folder, and file systems "
                   f"take 255 bytes a name, less what raydiff adds to it)", value=lambda c: _Abridged(c.run.name)),
    Rule("run.storage", lambda c: bool(c.run.storage), "required: a folder for run directories"),
    Rule("run.storage", lambda c: "://" not in c.run.storage or c.run.storage.startswith(STORAGE_SCHEMES),
         f"supported URI schemes: {', '.join(STORAGE_SCHEMES)} (or a local or NFS path)"),
    Rule("run.storage", lambda c: not bucket_uri_problem(c.run.storage),
         lambda c: str(bucket_uri_problem(c.run.storage))),
    Rule("run.endpoint", lambda c: c.run.endpoint is None or "://" in c.run.endpoint,
         "must be a URL such as http://127.0.0.1:9000, or null"),
    Rule("debug.record_order", lambda c: not c.debug.record_order or not is_remote(c.run.storage),
         "needs a local run.storage"),
    Rule("run.max_failures", lambda c: c.run.max_failures >= -1, "must be >= 0, or -1 for unlimited"),
    Rule("run.keep_checkpoints", lambda c: c.run.keep_checkpoints >= 1, "must be >= 1"),
    Rule("run.lease_stale_s", lambda c: 4 <= c.run.lease_stale_s <= LONGEST_S,
         f"must be >= 4 seconds (the lease is renewed every quarter of it), {AT_MOST_LONGEST}"),
    Rule("eval.every", lambda c: c.eval.every >= 0, "must be >= 0 (0 = none during the run)"),
    Rule("eval.num", lambda c: c.eval.num >= 2, "must be >= 2 (a covariance needs two images; FID uses 50000)"),
    Rule("eval.steps", lambda c: 1 <= c.eval.steps <= MAX_SAMPLING_STEPS, f"must be in [1, {MAX_SAMPLING_STEPS:,}]"),
    Rule("eval.seed", lambda c: c.eval.seed >= 0, "must be >= 0"),
    Rule("eval.guidance", lambda c: math.isfinite(c.eval.guidance) and c.eval.guidance >= 0,
         "must be a number >= 0 (1 = conditional without guidance, 0 = unconditional)"),
    Rule("eval.guidance", lambda c: not c.model.num_classes or c.train.label_dropout > 0 or c.eval.guidance == 1,
         NO_NULL_CLASS),
    Rule("eval.metrics", lambda c: len(c.eval.metrics) >= 1 and set(c.eval.metrics) <= {"fid", "kid"}
         and len(set(c.eval.metrics)) == len(c.eval.metrics), "must be a list of fid and/or kid, each once"),
    Rule("eval.features", lambda c: c.eval.features != "digits" or c.data.source == "builtin:digits",
         "digits features apply to data.source = builtin:digits only; use inception or auto"),
    Rule("eval.inception_weights", lambda c: c.eval.inception_weights is None or "://" not in c.eval.inception_weights,
         "a local copy is read (a URI is not): download the file to this machine"),
    Rule("eval.inception_weights", lambda c: c.eval.inception_weights is None or "://" in c.eval.inception_weights
         or look_at("eval.inception_weights", c.eval.inception_weights, Path.is_file), "no such file"),
    Rule("log.mlflow_uri", lambda c: c.log.mlflow_uri is None or bool(c.log.mlflow_uri.strip()),
         "must be a tracking URI such as http://127.0.0.1:5000, or null"),
    Rule("log.mlflow_experiment", lambda c: bool(c.log.mlflow_experiment), "must name one"),
    Rule("log.wandb_project", lambda c: c.log.wandb_project is None or bool(c.log.wandb_project.strip()),
         "must name a Weights & Biases project, or be null (no W&B)"),
    Rule("eval.ref", lambda c: c.eval.ref is None or bool(c.eval.ref.strip()),
         "must name the reference images (a folder, a bucket, hf://, builtin:digits), or be null (data.source's)"),
    *_package_rules("mlflow_uri", "mlflow"),
    *_package_rules("wandb_project", "wandb"),
    Rule("log.profile_steps", lambda c: _profile_steps_ok(c.log.profile_steps, c.train.total_steps),
         lambda c: f"two optimizer steps [first, last], 1 <= first <= last <= train.total_steps "
                   f"({c.train.total_steps}), at most {MAX_PROFILED_STEPS} steps in all; or [] for none"),
    Rule("debug.nan_at_steps", lambda c: all(step >= 1 for step in c.debug.nan_at_steps), "steps are counted from 1"),
    Rule("debug.nan_at_samples", lambda c: all(i >= 0 for i in c.debug.nan_at_samples), "sample indices are >= 0"),
    Rule("debug.preemption_from_step", lambda c: c.debug.preemption_from_step >= 0, "must be >= 0 (0 = never)"),
    Rule("debug.step_delay_s", lambda c: 0 <= c.debug.step_delay_s <= 60, "must be in [0, 60]"),
    Rule("debug.hang_at_step", lambda c: c.debug.hang_at_step >= 0, "must be >= 0 (0 = never)"),
    Rule("debug.hang_at_step", lambda c: not c.debug.hang_at_step or (c.scaling.max_workers >= 2
                                                                      and not is_remote(c.run.storage)),
         "needs scaling.num_workers >= 2 and a local run.storage"),
)


def _scales_to_a_number(train) -> bool:
    """Whether the scaling rule makes a finite learning rate of train.base_lr (1e308 at a batch of millions does
    not, and an inf would train NaNs)."""
    try:
        return math.isfinite(rule_lr(train))
    except OverflowError:  # a batch of hundreds of digits
        return False


def _profile_steps_ok(steps: tuple[int, ...], total_steps: int) -> bool:
    if not steps:
        return True
    return len(steps) == 2 and 1 <= steps[0] <= steps[1] <= total_steps and steps[1] - steps[0] < MAX_PROFILED_STEPS


def _backends() -> list[str]:
    from torch._dynamo import list_backends  # only for a backend name: a slow import

    return sorted({*list_backends(), *_DEBUG_BACKENDS})


def _backend_installed(c: Config) -> bool:
    package = _BACKEND_PACKAGES.get(c.train.compile) if isinstance(c.train.compile, str) else None
    return package is None or importlib.util.find_spec(package) is not None


def validate(cfg: Config, *, check_source: bool = True) -> None:
    """Raise a one-line ConfigError at the first rule `cfg` breaks."""
    if check_source:
        check_source_uri(cfg.data.source)
        if cfg.eval.ref and cfg.eval.ref.strip():  # read at the run's first measurement: found wrong now, not then
            check_source_uri(cfg.eval.ref, "eval.ref")
        storage_problem = bucket_case_problem(cfg.run.storage)
        _check(storage_problem is None, "run.storage", cfg.run.storage, str(storage_problem))
    for rule in RULES:
        rule.check(cfg)
    if not cfg.scaling.auto:  # the driver resolves auto once it sees the cluster, then checks the batch
        check_workers(cfg)
    for rule in LATER_RULES:
        rule.check(cfg)


def check_source_uri(source: str | None, key: str = "data.source") -> None:
    """A source of images (`key`: data.source, or eval.ref, read the same way) as far as can be told without
    listing it: its form, and that a local one exists."""
    _check(bool(source), key, source, "required: a folder or file of images, Parquet or WebDataset "
           "shards (local, s3://, gs://), a dataset on the Hugging Face Hub (hf://datasets/uoft-cs/cifar10), or "
           "builtin:digits")
    assert source is not None  # _check raised if it is None or empty
    if source.startswith("builtin:"):
        _check(source in BUILTIN_SOURCES, key, source, f"builtin sources: {', '.join(BUILTIN_SOURCES)}")
    elif "://" not in source:
        folder, _ = glob_split(source)  # a glob's folder must exist; what matches is listed when the run starts
        _check(look_at(key, source, lambda path: path.exists() or Path(folder).expanduser().is_dir()), key,
               source, "no such file or folder")
    else:
        _check(source.startswith(SCHEMES), key, source,
               f"supported URI schemes: {', '.join(SCHEMES)} (or a local path)")
        problem = hub_uri_problem(source) if source.startswith(HUB_SCHEME) else (bucket_uri_problem(source)
                                                                                 or bucket_case_problem(source))
        _check(problem is None, key, source, str(problem))


def bucket_case_problem(uri: str) -> str | None:
    """Why an s3:// or gs:// URI cannot name a bucket: a preset's YOUR-BUCKET left in place, or capitals on GCS,
    which the store's client would otherwise retry for a while before failing (S3 kept a few buckets of before 2018
    with capitals: allowed there). Checked only where the run opens the location (`validate(check_source=True)`):
    cluster_check reads the presets as they ship."""
    scheme = scheme_of(uri)
    if scheme not in OBJECT_STORE_SCHEMES:
        return None
    bucket = uri[len(scheme):].split("/", 1)[0]
    if bucket == "YOUR-BUCKET":
        return "bucket names are lowercase; replace YOUR-BUCKET with your bucket"
    if scheme != "s3://" and bucket != bucket.lower():
        return f"bucket names are lowercase ({bucket!r} has capitals)"
    return None


def check_workers(cfg: Config) -> None:
    """The global batch against a known number of workers (validate() calls it; the driver again once it has
    resolved `scaling.num_workers: auto`). Any number up to the global batch reaches it exactly: a batch the
    workers cannot split evenly, or into whole micro-batches, is split as evenly as it goes (`rank_share`, shares
    an image apart, micro-batches of up to `train.micro_batch`), as an elastic run does at every world size, and
    the loss is the global batch's mean all the same."""
    s, t = cfg.scaling, cfg.train
    _check(t.global_batch >= s.max_workers, "train.global_batch", t.global_batch,
           f"must be at least the number of workers ({s.max_workers}): every worker needs a sample per step")


def parse_numbers(flag: str, text: str, *, ok: Callable[[float], bool], allowed: str,
                  different: bool = False) -> list[float]:
    """A command's comma-separated numbers (`--sigma-rel`, `--guidance`), finite and each `ok`, in the order
    given (and all `different`); else a ConfigError naming the flag and what is `allowed`."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} = {text!r}: {allowed}") from None
    if not all(math.isfinite(v) and ok(v) for v in values) or (different and len(set(values)) != len(values)):
        raise ConfigError(f"{flag} = {text!r}: {allowed}")
    return values


def parse_sigma_rels(text: str) -> list[float]:
    """--sigma-rel S[,S...]: different numbers in [SIGMA_REL_MIN, SIGMA_REL_MAX), in the order given."""
    return parse_numbers("--sigma-rel", text, ok=lambda s: SIGMA_REL_MIN <= s < SIGMA_REL_MAX, different=True,
                         allowed=f"must be comma-separated different numbers in [{SIGMA_REL_MIN:g}, {SIGMA_REL_MAX}), "
                                 f"such as 0.05,0.1")
