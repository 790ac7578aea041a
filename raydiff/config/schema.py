"""The config schema: typed sections whose defaults are the built-in default run (DDPM on scikit-learn's digits),
and the typed reading and writing of one `section.key`.

Why one module: a key's type, default and meaning live here once; `raydiff.config.load` reads YAML and overrides
through `set_key`, `raydiff.config.checks` holds the rules between keys, and docs/configuration.md is generated
from this file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from raydiff.config.lr_rule import rule_lr

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
    node_wait_s: float = 900.0  # a cluster with no node that can run a worker yet: wait this long for the first

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
    lease_stale_s: float = 60.0  # s3:// or gs:// storage: a run's lease not renewed this long is taken over


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
def fields_of(obj: Any) -> dict[str, Any]:
    return get_type_hints(type(obj))


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{k}" for s in fields_of(cfg) for k in fields_of(getattr(cfg, s))]


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is tuple:
        return f"list of {_describe(args[0])}"
    return {int: "integer", float: "a finite number", bool: "true | false", str: "string"}.get(hint, str(hint))


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
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        number = float(value)  # YAML 1.1 reads "1e-4" as a string
        if not math.isfinite(number):  # inf or nan would train NaNs, or never stop waiting
            raise ValueError
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError
    raise TypeError(f"unsupported config type {hint}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in fields_of(cfg) or parts[1] not in fields_of(getattr(cfg, parts[0])):
        close = difflib.get_close_matches(key, all_keys(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known sections: {', '.join(fields_of(cfg))}"
        raise ConfigError(f"unknown key '{key}'{hint}")
    section = getattr(cfg, parts[0])
    hint = fields_of(section)[parts[1]]
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
