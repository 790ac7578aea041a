"""Run configuration: typed sections with defaults, YAML presets, `key=value` overrides, validation.

Config flows one way: preset YAML + overrides -> `Config` (validated here) -> driver -> workers.
The dataclass defaults are the built-in default run (DDPM on scikit-learn's digits, ~5 min on 2 CPU cores).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from raydiff.data.fs import SCHEMES

_PACKAGE_DIR = Path(__file__).resolve().parent
# A checkout (or a Ray job's working_dir) has the presets beside the package; a wheel has them inside it.
PRESETS_DIR = next((p for p in (_PACKAGE_DIR.parent / "configs", _PACKAGE_DIR / "configs") if p.is_dir()),
                   _PACKAGE_DIR.parent / "configs")


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line naming the key."""


@dataclass
class DataSection:
    source: str | None = "builtin:digits"  # folder or file, file:// / s3:// / gs:// URI, or builtin:digits
    format: Literal["auto", "images", "parquet", "webdataset"] = "auto"  # auto: from the files' extensions
    image_column: str = "image"  # Parquet: the column with encoded images or uint8 tensors
    endpoint: str | None = None  # s3:// or gs:// endpoint URL (MinIO, ...); null: AWS_ENDPOINT_URL or the default
    anonymous: bool = False  # read a public bucket without credentials
    max_bad_fraction: float = 0.1  # stop before training when more of the source than this cannot be decoded
    resolution: int = 16  # images are resized (short side) and center-cropped to this square size
    channels: int = 1  # 1 = grayscale, 3 = RGB
    flip: bool = False  # random horizontal flips (off for digits: a mirrored 3 is not a digit)
    val_images: int = 0  # images held out of training for the validation loss (0 = none)
    cache: Literal["auto", "memory", "stream"] = "auto"  # memory: every node holds the decoded dataset; stream:
    # a window of prepared shards at a time; auto: memory if it takes at most half the smallest object store
    stream_buffer_gb: float = 4.0  # stream: the most a node holds (capped at half its object store)
    stream_window_shards: int = 8  # stream: shards shuffled together (the shuffle's reach; see README)


@dataclass
class ModelSection:
    base_channels: int = 32
    channel_mult: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 1
    attention_resolutions: tuple[int, ...] = (8,)
    dropout: float = 0.0
    norm_groups: int = 16
    norm_eps: float = 1e-6  # GroupNorm epsilon (Ho et al.'s reference: 1e-6; torch's default is 1e-5)
    # A new run starts from these weights: a diffusers pipeline or UNet2DModel folder, or a hub id (needs diffusers)
    init_from: str | None = None


@dataclass
class DiffusionSection:
    timesteps: int = 1000
    schedule: Literal["linear", "cosine"] = "linear"
    prediction: Literal["eps", "v", "x0"] = "eps"


@dataclass
class TrainSection:
    global_batch: int = 64  # images per optimizer step, summed over all workers
    micro_batch: Literal["auto"] | int | None = None  # per worker per forward pass; null = whole share
    lr: float | None = None  # null: base_lr scaled from base_batch to global_batch by lr_scaling
    base_lr: float = 2e-3  # the learning rate at base_batch
    base_batch: int = 64
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    lr_scaling_knee: int = 512  # linear scaling turns into sqrt scaling above this global batch
    warmup_steps: int = 100
    total_steps: int = 1400
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    compile: Literal["auto"] | bool | str = "auto"  # torch.compile: auto (on GPUs), true, false, or a backend name
    channels_last: Literal["auto"] | bool = "auto"  # NHWC activations; auto = off (see README "Performance")
    grad_compression: Literal["none", "bf16"] = "none"  # DDP all-reduces gradients in bf16: half the network bytes
    weight_decay: float = 0.0
    ema_decay: float = 0.995
    ema_warmup_steps: int = 100  # the EMA window grows linearly from 1 step to 1/(1-ema_decay) steps
    checkpoint_every: int = 100
    sample_every: int = 700  # 0 = only at the end
    sample_num: int = 64
    sample_steps: int = 50  # DDIM steps for in-training sample grids
    log_every: int = 50
    val_every: int = 0  # steps between validation losses (with data.val_images > 0); 0 = only at the end
    seed: int = 0
    max_bad_steps: int = 25  # consecutive non-finite steps before rolling back once, then stopping


@dataclass
class ScalingSection:
    num_workers: Literal["auto"] | int | tuple[int, ...] = 2  # an int, [min, max] (elastic), or auto (every GPU)
    use_gpu: Literal["auto"] | bool = "auto"
    cpus_per_worker: float | None = None  # null = share the node's CPUs among the workers
    resize_check_s: float = 60.0  # elastic: how often Ray Train looks for room to grow

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def auto(self) -> bool:
        return self.num_workers == "auto"

    @property
    def max_workers(self) -> int:
        """The most workers the run may have (auto counts as 1 until the driver resolves it)."""
        return 1 if self.auto else max(self.num_workers) if self.elastic else self.num_workers


@dataclass
class RunSection:
    name: str = "default"
    storage: str = "runs"  # parent of the run directory <storage>/<name>: a folder (NFS on clusters), s3:// or gs://
    endpoint: str | None = None  # run.storage's S3/GCS endpoint URL; null: AWS_ENDPOINT_URL or the default
    max_failures: int = 3  # worker-group restarts allowed; -1 = unlimited
    keep_checkpoints: int = 3
    resume: bool = True  # false: move an existing run of this name aside and start over


@dataclass
class EvalSection:
    """Sample quality during and after training (see README "Measuring quality")."""

    every: int = 0  # steps between evaluations in the run; 0 = none during the run
    at_end: bool = False  # evaluate once more when the run finishes (the default and digits presets do)
    num: int = 500  # images generated per evaluation (the DDPM paper's FID uses 50,000)
    sampler: Literal["ddim", "ddpm"] = "ddim"
    steps: int = 50  # sampling steps
    metrics: tuple[str, ...] = ("fid",)  # fid and/or kid
    features: Literal["auto", "inception", "digits"] = "auto"  # auto: digits for builtin:digits, else inception
    inception_weights: str | None = None  # a local copy of the Inception-v3 (2015-12-05) weights; null: download
    ref: str | None = None  # reference: null = the run's data.source; an .npz with mu/sigma; or a folder of images
    seed: int = 0  # image i of an evaluation is a pure function of (seed, i)


@dataclass
class LogSection:
    """Dashboards beside metrics.jsonl (rank 0 writes them). Credentials come from the environment only."""

    tensorboard: bool = True  # <run>/tensorboard/: every metrics row, the sample grids, the config
    mlflow_uri: str | None = None  # MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, ...); null = off
    mlflow_experiment: str = "raydiff"
    wandb_project: str | None = None  # Weights & Biases project; null = off (WANDB_MODE=offline is honoured)
    wandb_entity: str | None = None


@dataclass
class DebugSection:
    """Fault injection and audit trails, for testing raydiff itself."""

    nan_at_steps: tuple[int, ...] = ()  # make the loss non-finite at these optimizer steps (1-based), once each
    nan_at_samples: tuple[int, ...] = ()  # make the loss non-finite whenever these sample indices are trained
    preemption_from_step: int = 0  # act as if a preemption notice arrived at this step and stays (0 = never)
    record_order: bool = False  # each worker logs the sample indices it trained on to <run>/order/
    step_delay_s: float = 0.0  # sleep this long every step: slows a tiny test run to the pace of cluster events


@dataclass
class Config:
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    train: TrainSection = field(default_factory=TrainSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    run: RunSection = field(default_factory=RunSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: LogSection = field(default_factory=LogSection)
    debug: DebugSection = field(default_factory=DebugSection)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists, not tuples): YAML- and `torch.load(weights_only=True)`-safe."""

        def plain(v: Any) -> Any:
            return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

        return {s: {k: plain(v) for k, v in section.items()} for s, section in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> Config:
        cfg = cls()
        for section, values in tree.items():
            for key, value in (values or {}).items():
                set_key(cfg, f"{section}.{key}", value)
        return cfg

    def resolve(self) -> Config:
        """Fill in what is derived from other keys (the learning rate from the scaling rule); idempotent."""
        from raydiff.training.lr import rule_lr

        if self.train.lr is None:
            self.train.lr = rule_lr(self.train)
        return self

    def micro_batch_for(self, world_size: int) -> int:
        """Per-worker forward-pass size; null means one pass per step (the largest share). Not for `auto`,
        which the workers measure."""
        if self.train.micro_batch == "auto":
            raise ValueError("micro_batch=auto is measured on the workers")
        return self.train.micro_batch or -(-self.train.global_batch // world_size)


# Reading and writing keys.
def _fields(obj: Any) -> dict[str, Any]:
    return get_type_hints(type(obj))


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{k}" for s in _fields(cfg) for k in _fields(getattr(cfg, s))]


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is tuple:
        return f"list of {_describe(args[0])}"
    return {int: "integer", float: "number", bool: "true | false", str: "string"}.get(hint, str(hint))


def _coerce(value: Any, hint: Any) -> Any:
    """Convert `value` to `hint` or raise ValueError. Accepts what YAML and the command line produce."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except ValueError:
                pass
        raise ValueError
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ValueError
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("[]() ").split(",") if v.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # a single value is a one-item list
        if not isinstance(value, (list, tuple)):
            raise ValueError
        return tuple(_coerce(yaml.safe_load(v) if isinstance(v, str) else v, args[0]) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if hint is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            return int(value)
        raise ValueError
    if hint is float:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value)  # YAML 1.1 reads "1e-4" as a string
        raise ValueError
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError
    raise TypeError(f"unsupported config type {hint}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _fields(cfg) or parts[1] not in _fields(getattr(cfg, parts[0])):
        close = difflib.get_close_matches(key, all_keys(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known sections: {', '.join(_fields(cfg))}"
        raise ConfigError(f"unknown key '{key}'{hint}")
    section = getattr(cfg, parts[0])
    hint = _fields(section)[parts[1]]
    try:
        setattr(section, parts[1], _coerce(value, hint))
    except ValueError:
        raise ConfigError(f"{key} = {value!r}: expected {_describe(hint)}") from None


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, for example train.lr=1e-4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# Presets.
def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"--config {name_or_path}: no such file")
        return path
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if not preset.is_file():
        raise ConfigError(f"--config {name_or_path}: not a file and not a preset; presets: {', '.join(preset_names())}")
    return preset


def load_config(name_or_path: str = "default", overrides: list[str] = (), *, check_source: bool = True) -> Config:
    """Preset or YAML file, then `key=value` overrides, then validation. Raises ConfigError."""
    path = resolve_config_path(name_or_path)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict) or not all(isinstance(v, (dict, type(None))) for v in tree.values()):
        raise ConfigError(f"{path}: expected sections of key: value pairs (data:, model:, train:, ...)")
    cfg = Config()
    for section, values in tree.items():
        if not isinstance(section, str) or section not in _fields(cfg):
            raise ConfigError(f"{path}: unknown section '{section}'; known sections: {', '.join(_fields(cfg))}")
        for key, value in (values or {}).items():
            set_key(cfg, f"{section}.{key}", value)
    for text in overrides:
        set_key(cfg, *parse_override(text))
    _resolve_paths(cfg)
    validate(cfg, check_source=check_source)
    return cfg.resolve()


def _resolve_paths(cfg: Config) -> None:
    """Workers run in another directory: make local paths absolute on the driver."""
    if cfg.data.source and "://" not in cfg.data.source and not cfg.data.source.startswith("builtin:"):
        cfg.data.source = str(Path(cfg.data.source).expanduser().resolve())
    if "://" not in cfg.run.storage:
        cfg.run.storage = str(Path(cfg.run.storage).expanduser().resolve())
    if cfg.model.init_from and Path(cfg.model.init_from).expanduser().exists():  # else a hub id, kept as it is
        cfg.model.init_from = str(Path(cfg.model.init_from).expanduser().resolve())
    for key in ("inception_weights", "ref"):
        value = getattr(cfg.eval, key)
        if value and "://" not in value:
            setattr(cfg.eval, key, str(Path(value).expanduser().resolve()))


# Validation.
BUILTIN_SOURCES = ("builtin:digits",)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face repository id, e.g. google/ddpm-cifar10-32


def _is_diffusers_unet(location: str) -> bool:
    """A local diffusers pipeline folder (unet/config.json) or UNet2DModel folder (config.json), or, when no such
    path exists here, something shaped like a hub id. Cheap: the driver reads and checks it before training."""
    path = Path(location).expanduser()
    if path.exists():
        return (path / "unet" / "config.json").is_file() or (path / "config.json").is_file()
    return HUB_ID.fullmatch(location) is not None


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {'null' if value is None else repr(value)}: {allowed}")


def validate(cfg: Config, *, check_source: bool = True) -> None:
    d, m, f, t, s, r = cfg.data, cfg.model, cfg.diffusion, cfg.train, cfg.scaling, cfg.run

    # Data.
    if check_source:
        _check(bool(d.source), "data.source", d.source, "required: a folder of images or builtin:digits")
        if d.source.startswith("builtin:"):
            _check(d.source in BUILTIN_SOURCES, "data.source", d.source,
                   f"builtin sources: {', '.join(BUILTIN_SOURCES)}")
        elif "://" not in d.source:
            _check(Path(d.source).exists(), "data.source", d.source, "no such file or folder")
        else:
            _check(d.source.startswith(SCHEMES), "data.source", d.source,
                   f"supported URI schemes: {', '.join(SCHEMES)} (or a local path)")
    _check(0 <= d.max_bad_fraction <= 1, "data.max_bad_fraction", d.max_bad_fraction, "must be in [0, 1]")
    _check(bool(d.image_column), "data.image_column", d.image_column, "must name a column")
    _check(d.endpoint is None or "://" in d.endpoint, "data.endpoint", d.endpoint,
           "must be a URL such as http://127.0.0.1:9000, or null")
    _check(d.channels in (1, 3), "data.channels", d.channels, "must be 1 (grayscale) or 3 (RGB)")
    _check(d.cache in ("auto", "memory", "stream"), "data.cache", d.cache, "must be auto, memory or stream")
    _check(d.stream_buffer_gb > 0, "data.stream_buffer_gb", d.stream_buffer_gb, "must be > 0")
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
    _check(t.micro_batch in (None, "auto") or t.micro_batch >= 1, "train.micro_batch", t.micro_batch,
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
    _check(t.max_bad_steps >= 1, "train.max_bad_steps", t.max_bad_steps, "must be >= 1")
    if isinstance(t.compile, str) and t.compile != "auto":
        from torch._dynamo import list_backends  # only for a backend name: a slow import

        _check(t.compile in list_backends(), "train.compile", t.compile,
               f"auto, true, false, or a torch.compile backend: {', '.join(list_backends())}")

    # Scaling and the batch arithmetic: global = micro x workers x accumulation, exactly.
    if s.auto:
        pass  # the driver resolves it once it sees the cluster, then checks the batch (`check_workers`)
    elif s.elastic:
        _check(len(s.num_workers) == 2 and 1 <= s.num_workers[0] <= s.num_workers[1], "scaling.num_workers",
               list(s.num_workers), "must be an integer >= 1, or [min, max] with 1 <= min <= max")
    else:
        _check(s.num_workers >= 1, "scaling.num_workers", s.num_workers, "must be >= 1")
    _check(s.cpus_per_worker is None or s.cpus_per_worker > 0, "scaling.cpus_per_worker", s.cpus_per_worker,
           "must be > 0 or null")
    _check(s.resize_check_s > 0, "scaling.resize_check_s", s.resize_check_s, "must be > 0 seconds")
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

    # Evaluation and dashboards.
    e = cfg.eval
    _check(e.every >= 0, "eval.every", e.every, "must be >= 0 (0 = none during the run)")
    _check(e.num >= 2, "eval.num", e.num, "must be >= 2 (a covariance needs two images; FID uses 50000)")
    _check(e.steps >= 1, "eval.steps", e.steps, "must be >= 1")
    _check(e.seed >= 0, "eval.seed", e.seed, "must be >= 0")
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

    # Debug.
    _check(all(step >= 1 for step in cfg.debug.nan_at_steps), "debug.nan_at_steps", list(cfg.debug.nan_at_steps),
           "steps are counted from 1")
    _check(all(i >= 0 for i in cfg.debug.nan_at_samples), "debug.nan_at_samples", list(cfg.debug.nan_at_samples),
           "sample indices are >= 0")
    _check(cfg.debug.preemption_from_step >= 0, "debug.preemption_from_step", cfg.debug.preemption_from_step,
           "must be >= 0 (0 = never)")
    _check(0 <= cfg.debug.step_delay_s <= 60, "debug.step_delay_s", cfg.debug.step_delay_s, "must be in [0, 60]")


def check_workers(cfg: Config) -> None:
    """The global batch against a known number of workers (validate() calls it; the driver again once it has
    resolved `scaling.num_workers: auto`)."""
    s, t = cfg.scaling, cfg.train
    _check(t.global_batch >= s.max_workers, "train.global_batch", t.global_batch,
           f"must be at least the number of workers ({s.max_workers}): every worker needs a sample per step")
    if not s.elastic:
        # A fixed world size must reach the global batch exactly as micro_batch x workers x accumulation.
        # (Elastic runs split each global batch as evenly as the current world size allows instead.)
        w = s.num_workers
        _check(t.global_batch % w == 0, "train.global_batch", t.global_batch,
               f"not reachable with scaling.num_workers = {w}: must be a multiple of the number of workers")
        per_worker = t.global_batch // w
        _check(not isinstance(t.micro_batch, int) or per_worker % t.micro_batch == 0, "train.micro_batch",
               t.micro_batch,
               f"train.global_batch = {t.global_batch} is not reachable as micro_batch x {w} workers x "
               f"accumulation: {per_worker} images per worker must be a multiple of micro_batch")
