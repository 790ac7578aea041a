"""The config schema: typed sections whose defaults are the built-in default run (DDPM on scikit-learn's digits),
and the typed reading and writing of one `section.key` (a value converted to the key's type by
`raydiff.config.values`).

Why one module: a key's type, default and meaning live here once; `raydiff.config.load` reads YAML and overrides
through `set_key`, `raydiff.config.checks` holds the rules between keys, and docs/configuration.md is generated
from this file.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

from raydiff.config.learning_rate import rule_lr
from raydiff.config.values import coerce, describe_type, read_override, shown


def sections_problem(tree: Any) -> str | None:
    """What is wrong with the shape of a config tree as a file or a checkpoint holds it (None where it is
    sections of key: value pairs); its keys and values are `Config.from_dict`'s to judge."""
    if not isinstance(tree, dict) or not all(isinstance(v, dict | None) for v in tree.values()):
        return "expected sections of key: value pairs (data:, model:, train:, ...)"
    return None


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one line naming the key."""


# The samplers `eval.sampler` and the commands' `--sampler` choose from (`raydiff.model.diffusion` runs them);
# named here, apart from torch, so that a command reads its arguments before importing it.
Sampler = Literal["ddim", "ddpm", "dpmpp_2m", "dpmpp_2m_sde", "heun"]
SAMPLERS: tuple[Sampler, ...] = get_args(Sampler)
MAX_CLASSES = 100_000  # more than this is a wrong label column (an id per sample), not classes
MAX_SAMPLING_STEPS = 100_000  # Heun's, which may step between timesteps, bounded as diffusion.timesteps is


@dataclass
class DataSection:
    """The training images: where they are read from, how they are decoded, and where the decoded images live
    while training."""

    source: str | None = "builtin:digits"
    """Where the training images are: a folder or file of images, Parquet or WebDataset shards, or a folder written
    by `raydiff.prepare`, as a local path or a `file://`, `s3://`, `gs://` or `hf://` (Hugging Face Hub) URI, whose
    last parts may be a glob (`train-*.parquet`); or `builtin:digits` (see docs/data.md#sources)."""
    format: Literal["auto", "images", "parquet", "webdataset"] = "auto"
    """What kind of files `data.source` holds; `auto` tells from the files' extensions (a prepared folder is
    recognised by its manifest whatever this says)."""
    image_column: str = "image"
    """Parquet: the column holding the images, encoded (bytes, or Hugging Face's `{bytes, path}`) or as uint8
    tensors. Left at `image` where a file that Hugging Face's `datasets` wrote has no such column: the one column
    its `Image` feature names (CIFAR-10's `img`)."""
    endpoint: str | None = None
    """The S3, GCS or Hugging Face Hub endpoint URL for `data.source` (MinIO, Ceph, a Hub mirror, a local test
    server); null: `AWS_ENDPOINT_URL` or `HF_ENDPOINT`, else the provider's default."""
    anonymous: bool = False
    """Read a public bucket or Hub dataset without credentials (no token is sent)."""
    max_bad_fraction: float = 0.1
    """Stop before training when more than this share of the source's samples cannot be decoded (the others are
    skipped and listed in `bad_images.json`)."""
    resolution: int = 16
    """Images are scaled to cover this square size (antialiased bicubic) and center-cropped to it."""
    channels: int = 1
    """1 trains on grayscale images, 3 on RGB."""
    flip: bool = False
    """Random horizontal flips, per sample and epoch and reproducible (off for digits: a mirrored 3 is not a
    digit)."""
    val_images: int = 0
    """Images held out of training (a fixed, seeded subset) for the validation loss; 0 = none."""
    cache: Literal["auto", "memory", "stream"] = "auto"
    """Where the decoded images live: `memory` (every node holds the whole decoded dataset), `stream` (prepared
    shards, a window at a time), or `auto` (memory if it takes at most half the smallest node's object store);
    see docs/data.md#datasets-bigger-than-memory."""
    on_device: Literal["auto"] | bool = "auto"
    """Keep a copy of the decoded images on each worker's training device and gather every micro-batch there (the
    host copies only sample indices, flip bits and class ids), instead of a loader thread gathering them on the host
    and copying them over; needs `data.cache` memory. `auto`: on CUDA GPUs where the images take at most 1/8 of
    the GPU's memory (see docs/training.md#performance)."""
    stream_buffer_gb: float = 4.0
    """Stream mode: the most shard data one node's cache holds, in GB (capped at half its object store; see
    docs/data.md#throughput-and-memory)."""
    stream_window_shards: int = 8
    """Stream mode: how many shards' samples are shuffled together (the shuffle's reach); the buffer must hold four
    windows (see docs/data.md#shuffle-quality)."""
    labels: Literal["none", "auto"] = "none"
    """`auto` reads each sample's class from the source (image folders: the first-level subfolder; Parquet:
    `data.label_column`; WebDataset: the `.cls` member; prepared data: its label column; `builtin:digits`: the
    digit) for class-conditional training; `none` reads no labels (see docs/data.md#labelled-data)."""
    label_column: str = "label"
    """Parquet: the column holding each sample's class, as an integer id or a name."""


@dataclass
class ModelSection:
    """The UNet (Ho et al.'s DDPM architecture) and the weights a new run starts from."""

    base_channels: int = 32
    """The UNet's width at its first level (DDPM's CIFAR-10 model: 128)."""
    channel_mult: tuple[int, ...] = (1, 2, 2)
    """Per-level width multipliers of `model.base_channels`; each level after the first halves the resolution."""
    num_res_blocks: int = 1
    """Residual blocks per level."""
    attention_resolutions: tuple[int, ...] = (8,)
    """The feature-map sizes (of the model's levels) that get a self-attention block."""
    dropout: float = 0.0
    """Dropout probability in the residual blocks."""
    norm_groups: int = 16
    """GroupNorm groups; must divide every channel count (`base_channels` times each multiplier)."""
    norm_eps: float = 1e-6
    """GroupNorm epsilon (Ho et al.'s reference code uses 1e-6; torch's default is 1e-5)."""
    num_classes: Literal["auto"] | int = 0
    """Classes of a class-conditional model: 0 = unconditional; N = a learned embedding of N classes plus one null
    class (classifier-free guidance); `auto` = the number of classes `data.labels: auto` finds (see
    docs/training.md#class-conditional-training)."""
    init_from: str | None = None
    """A new run starts from these weights: a raydiff run or checkpoint folder (local, s3:// or gs://; its EMA
    weights, see docs/training.md#fine-tune-a-run-of-your-own), a diffusers pipeline or `UNet2DModel` folder, or a
    Hugging Face hub id such as `google/ddpm-cifar10-32` (needs diffusers; see
    docs/sampling-and-diffusers.md#start-from-a-diffusers-model); null: random initialisation."""


@dataclass
class DiffusionSection:
    """The forward (noising) process and what the network learns to predict."""

    timesteps: int = 1000
    """The number of diffusion steps T (2 to 100000; at least 21 with the linear schedule, whose largest beta is
    20/T)."""
    schedule: Literal["linear", "cosine"] = "linear"
    """The noise schedule: `linear` (Ho et al.) or `cosine` (Nichol & Dhariwal)."""
    prediction: Literal["eps", "v", "x0"] = "eps"
    """What the network predicts: the noise (`eps`), the velocity (`v`) or the clean image (`x0`)."""


@dataclass
class TrainSection:
    """The optimisation: batch, learning rate, precision, EMA, and how often the run checkpoints, samples and
    logs."""

    global_batch: int = 64
    """Images per optimizer step, summed over all workers; it stays the same whatever the number of workers."""
    micro_batch: Literal["auto"] | int | None = None
    """Images per worker per forward pass (gradients accumulate up to the worker's share); null = the whole share
    in one pass; `auto` = the largest that fits the GPU, measured (see docs/training.md#automatic-micro-batch)."""
    lr: float | None = None
    """The AdamW learning rate after warmup; null: `train.base_lr` scaled from `train.base_batch` to
    `train.global_batch` by `train.lr_scaling` (see docs/sweeps.md#the-scaling-rule); a number is used as it is."""
    base_lr: float = 2e-3
    """The learning rate that suits a global batch of `train.base_batch` (the starting point of the scaling
    rule)."""
    base_batch: int = 64
    """The global batch at which `train.base_lr` applies."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """How the learning rate follows the global batch: `linear` (up to `train.lr_scaling_knee`, with the square
    root beyond), `sqrt`, or `none`."""
    lr_scaling_knee: int = 512
    """The global batch above which linear scaling turns into square-root scaling."""
    warmup_steps: int = 100
    """Optimizer steps over which the learning rate rises linearly to `train.lr` (then `train.lr_decay` applies)."""
    lr_decay: Literal["none", "cosine", "rsqrt"] = "none"
    """How the learning rate falls after warmup: `none` keeps it (DDPM); `cosine` lowers it along a half cosine
    towards 0 at `train.total_steps` (the diffusers example's); `rsqrt` divides it by sqrt(step /
    `train.lr_decay_steps`) from that step on (EDM2's: it does not depend on `train.total_steps`, so extending a
    run leaves its schedule as it was). See docs/training.md#learning-rate-decay."""
    lr_decay_steps: int = 0
    """With `train.lr_decay = rsqrt`: the step from which the learning rate falls (0 with any other decay)."""
    total_steps: int = 1400
    """Optimizer steps in the run."""
    grad_clip: float = 1.0
    """The largest global gradient norm (measured after unscaling); larger gradients are scaled down to it; 0
    disables clipping."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Training precision: `auto` (bf16 autocast on GPUs that compute in it, compute capability 8 (Ampere) and
    later; else fp32, as on a T4 or V100, which only emulate it), `fp32`, `bf16`, or `fp16` (with a gradient
    scaler)."""
    compile: Literal["auto"] | bool | str = "auto"
    """`torch.compile` the training step's forward pass (the network with the loss around it, one graph): `auto`
    (on GPUs, falling back to eager if compilation fails there), `true`, `false`, or the name of a torch.compile
    backend (`aot_eager`, ...)."""
    channels_last: Literal["auto"] | bool = "auto"
    """NHWC (channels-last) activations and weights; `auto`: on where the step is compiled on a GPU (faster there),
    off in eager mode, where NHWC GroupNorm is slower (see docs/training.md#performance)."""
    cuda_graphs: Literal["auto"] | bool = "auto"
    """Replay the compiled forward and backward passes as CUDA graphs (torch.compile's `reduce-overhead` mode; on
    GPUs, with `train.compile` on, and with several workers only under `train.allreduce: flat`); `auto`: on
    wherever that holds, since the compiled step is bound by the host launching its kernels there (see
    docs/training.md#performance)."""
    allreduce: Literal["auto", "ddp", "flat"] = "auto"
    """How several workers average their gradients. `ddp`: DDP all-reduces them in buckets while the backward pass
    runs (overlapped; no CUDA graphs). `flat`: the gradients live in one buffer, all-reduced once after the last
    micro-batch's backward pass, so that the step can replay as CUDA graphs. `auto`: `flat` where the step
    replays as CUDA graphs and all workers share one node (the all-reduce over the node's links is short beside
    the launches the graphs save), and on CPUs with three or more workers (DDP's first step after a start sums in
    another order: a resumed run would not end bit for bit as the uninterrupted one), else `ddp`. Both average
    alike (see docs/training.md#performance)."""
    tf32: bool = True
    """TF32 tensor cores for fp32 convolutions and matmuls during training on GPUs (sampling and evaluation always
    compute in IEEE fp32); false: IEEE fp32 throughout."""
    keep_host_memory: Literal["auto"] | bool = "auto"
    """Set glibc's allocator to keep freed host memory for the next step (one arena, no trimming) instead of
    returning it to the system and having it zeroed again, in the training workers, the evaluation's tasks,
    `lr_find` and `sample`; `auto`: on where they compute on CPUs (see docs/training.md#performance). Their memory
    stays at its peak."""
    compile_cache: bool = True
    """Keep the compiled step in the run directory (`compile_cache/`), so that a restarted worker, a resized run or
    a re-run loads it instead of compiling again (torch 2.7 and later)."""
    activation_checkpointing: Literal["auto"] | bool = False
    """Recompute each residual and attention block's activations in the backward pass instead of keeping them:
    much less memory for more compute, the same losses and gradients. `auto`: on when, without it, the measured
    micro-batch (`train.micro_batch: auto`) would be smaller than the worker's share of the global batch (see
    docs/training.md#activation-checkpointing)."""
    grad_compression: Literal["none", "bf16"] = "none"
    """`bf16`: the gradients are all-reduced in bf16 (by DDP or the flat all-reduce), half the bytes on links
    between nodes (the cluster presets use it; see docs/training.md#performance); `none` averages them in fp32."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ema_decay: float = 0.995
    """Decay per optimizer step of the exponential moving average of the weights, which samples and exports use
    (DDPM's CIFAR-10 model: 0.9999)."""
    ema_warmup_steps: int = 100
    """The EMA's window grows linearly from 1 step to 1/(1 - `train.ema_decay`) steps over this many steps."""
    ema: Literal["classic", "posthoc"] = "classic"
    """`classic`: the one EMA above. `posthoc`: also tracks power-function averages of widths
    `train.ema_sigma_rels` and stores them every `train.ema_snapshot_every` steps, so that `raydiff.ema` can
    rebuild the EMA of any width afterwards and `raydiff.evaluate --sigma-rel` can pick the best (EDM2's post-hoc
    EMA; see docs/training.md#post-hoc-ema)."""
    ema_sigma_rels: tuple[float, ...] = (0.05, 0.10)
    """`train.ema: posthoc`: the relative widths (standard deviation / training time) of the tracked averages
    (EDM2's 0.05 and 0.10); each in [0.0001, 0.28)."""
    ema_snapshot_every: Literal["auto"] | int = "auto"
    """`train.ema: posthoc`: optimizer steps between snapshots of the tracked averages (`ema_snapshots/` in the run
    directory); `auto` = `train.checkpoint_every`."""
    checkpoint_every: int = 100
    """Optimizer steps between checkpoints (the run also checkpoints at its end)."""
    sample_every: int = 700
    """Optimizer steps between sample grids written to the run directory; 0 = only at the end."""
    sample_num: int = 64
    """Images in each sample grid."""
    sample_steps: int = 50
    """DDIM sampling steps for the sample grids."""
    log_every: int = 50
    """Optimizer steps between rows of `metrics.jsonl` and progress lines."""
    val_every: int = 0
    """Optimizer steps between validation losses (`val_loss`; needs `data.val_images` > 0); 0 = only at the
    end."""
    seed: int = 0
    """Fixes the initial weights, the sample order, flips, noise and the sample grids."""
    loss_weighting: Literal["uniform", "min_snr"] = "uniform"
    """How each sample's squared error counts: `uniform` (DDPM's plain mean) or `min_snr` (Hang et al. 2023: as if
    every target's error were the x0 error it implies, weighted by min(SNR, `train.min_snr_gamma`); see
    docs/training.md#loss-weighting). The logged and validation losses are the weighted ones."""
    min_snr_gamma: float = 5.0
    """`train.loss_weighting: min_snr`: the SNR above which timesteps count no more (the paper's 5)."""
    label_dropout: float = 0.5
    """Class-conditional models: the probability that a sample's class is replaced by the null class, so that
    the same model also learns the unconditional prediction that guidance needs (a pure function of the seed and
    the sample's stream position, like the noise). The default suits short budgets, where the unconditional
    prediction learns only from this share; long runs on large datasets often use 0.1 to 0.2 (DiT, the CFG
    paper). At 0 no guidance but 1 can be used (`eval.guidance`)."""
    max_bad_steps: int = 25
    """Consecutive non-finite steps after which the run rolls back to its last good checkpoint (once), then
    stops with a diagnostic."""


@dataclass
class ScalingSection:
    """How many Ray Train workers the run has, on which devices, and how it waits for them."""

    num_workers: Literal["auto"] | int | tuple[int, ...] = 2
    """Ray Train workers: a number, `[min, max]` for elastic training (see docs/resume-and-elastic.md#elastic-training),
    or `auto` (one per GPU in the cluster, or one CPU worker with every CPU where there are no GPUs). A global
    batch the workers cannot split evenly, or into whole micro-batches of `train.micro_batch`, is split as evenly
    as it goes."""
    use_gpu: Literal["auto"] | bool = "auto"
    """Train on GPUs: `auto` (where the cluster has a GPU for each of the run's fewest workers; else on CPUs, said at
    the start), `true` (wait for GPU nodes where there are none yet), or `false`."""
    cpus_per_worker: float | None = None
    """CPUs reserved for each worker; null: 1 per GPU worker, while CPU workers share the cluster's CPUs as far as
    each node holds them (a worker is placed on one node). A CPU worker computes on its whole CPUs' number of torch
    threads, at most the worker's OMP_NUM_THREADS."""
    resize_check_s: float = 60.0
    """Elastic training: seconds between Ray Train's checks for room to add workers."""
    node_wait_s: float = 900.0
    """Seconds to wait for the first node that can run a worker, on a cluster that has none yet (a head without
    workers, whose worker nodes the autoscaler adds)."""
    hang_timeout_s: float = 1800.0
    """Seconds after which a worker that makes no progress counts as lost, like one that died: a process that stops
    answering, or a collective (an all-reduce, a checkpoint's report) that another worker never joins. The run
    then restarts from its newest checkpoint (`run.max_failures`). Keep it above the longest wait a healthy run
    has: the first step's compilation, rank 0's sample grid, a checkpoint's write. At least 10."""

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def auto(self) -> bool:
        return self.num_workers == "auto"

    @property
    def max_workers(self) -> int:
        """The most workers the run may have (auto counts as 1 until the driver resolves it)."""
        n = self.num_workers  # `auto` and `elastic`, narrowed for the type checker
        return 1 if n == "auto" else max(n) if isinstance(n, tuple) else n


@dataclass
class RunSection:
    """The run directory: its name and storage, continuing a run, and recovering from failures."""

    name: str = "default"
    """The run directory's name under `run.storage`; starting a run of the same name again continues it."""
    storage: str = "runs"
    """The parent of the run directory `<storage>/<name>`: a local folder, an NFS path mounted on every node, or an
    `s3://BUCKET[/PREFIX]` or `gs://BUCKET[/PREFIX]` URI (see docs/clusters.md#shared-storage)."""
    endpoint: str | None = None
    """The S3 or GCS endpoint URL for `run.storage` (MinIO, a test server); null: `AWS_ENDPOINT_URL` or the
    provider's default."""
    max_failures: int = 3
    """Restarts of the worker group from the latest checkpoint before the run gives up; -1 = unlimited."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""
    resume: bool = True
    """Continue an existing run of this name; false moves it aside (to `<name>.replaced-<UTC time>`, nothing
    deleted; once the data is read and nothing can refuse the new run) and starts over."""
    lease_stale_s: float = 60.0
    """`s3://` or `gs://` storage: seconds after which a run's lease that was not renewed is taken to belong to a
    driver that is gone, and is taken over; a driver that has had no renewal confirmed for half of it stops (see
    docs/resume-and-elastic.md#one-driver-per-run)."""


@dataclass
class EvalSection:
    """Sample quality during and after training (see docs/quality-and-dashboards.md#measuring-quality)."""

    every: int = 0
    """Optimizer steps between sample-quality evaluations during the run; 0 = none during the run."""
    at_end: bool = False
    """Evaluate once more when the run finishes (the `default` and `digits` presets do)."""
    num: int = 500
    """Images generated per evaluation (the DDPM paper's FID uses 50,000)."""
    sampler: Sampler = "ddim"
    """The sampler that generates the evaluated images: `ddim`, `ddpm`, or the fast `dpmpp_2m` (DPM-Solver++ 2M),
    `dpmpp_2m_sde` (its SDE variant, fresh noise at each step) and `heun` (at most 2 `eval.steps` - 1 network
    evaluations); see docs/sampling-and-diffusers.md#samplers."""
    steps: int = 50
    """Sampling steps per generated image."""
    metrics: tuple[str, ...] = ("fid",)
    """The metrics to compute: `fid` and/or `kid`."""
    features: Literal["auto", "inception", "digits"] = "auto"
    """The feature network: `inception` (FID proper), `digits` (the built-in digits' classifier), or `auto` (digits
    for `builtin:digits`, else inception)."""
    inception_weights: str | None = None
    """A local copy of the Inception-v3 (2015-12-05) weights, for machines without internet; null: download them
    once into torch's hub cache."""
    ref: str | None = None
    """The reference the images are compared with: null = the run's `data.source` (its statistics cached), an
    `.npz` file with `mu` and `sigma`, or a folder of images."""
    seed: int = 0
    """Seeds the generated images: image i of an evaluation is a pure function of (seed, i)."""
    guidance: float = 2.0
    """Class-conditional models: the classifier-free guidance of the run's evaluations and sample grids, and of
    `raydiff.evaluate` and `raydiff.sample` without `--guidance` (diffusers' convention: 1 = conditional without
    guidance, one forward pass per step; 0 = unconditional; more = closer to the class, less diverse; see
    docs/quality-and-dashboards.md#class-conditional-models). Unconditional models ignore it."""


@dataclass
class LogSection:
    """Dashboards beside metrics.jsonl (rank 0 writes them). Credentials come from the environment only."""

    tensorboard: bool = True
    """Write TensorBoard event files to `<run>/tensorboard/`: every metrics row, the sample grids and the config
    (see docs/quality-and-dashboards.md#watching-a-run)."""
    mlflow_uri: str | None = None
    """The MLflow tracking URI (`http://host:5000`, `sqlite:///mlflow.db`, ...) to log to (needs
    `raydiff[mlflow]`); null = off."""
    mlflow_experiment: str = "raydiff"
    """The MLflow experiment the run is logged under."""
    wandb_project: str | None = None
    """The Weights & Biases project to log to (needs `raydiff[wandb]`; `WANDB_MODE=offline` is honoured); null =
    off."""
    wandb_entity: str | None = None
    """The Weights & Biases entity (user or team) that owns the project; null: the account's default."""
    profile_steps: tuple[int, ...] = ()
    """Two optimizer steps, `[first, last]` (50 steps at most): rank 0 records them with torch.profiler, all its
    training thread does (the data, the step, checks, rows, Ray's calls, writes), and writes
    `<run>/profile/steps_<first>-<last>.pt.trace.json.gz` (a trace for Perfetto or TensorBoard) and `.txt` (the
    top kernels on a GPU, operators on a CPU; the wall time per step and the GPU's busy share of it); empty = off.
    See docs/training.md#profiling-a-run."""


@dataclass
class DebugSection:
    """Fault injection and audit trails, for testing raydiff itself."""

    nan_at_steps: tuple[int, ...] = ()
    """Make the loss non-finite at these optimizer steps (counted from 1), once each."""
    nan_at_samples: tuple[int, ...] = ()
    """Make the loss non-finite whenever one of these sample indices is trained (a poisoned image)."""
    preemption_from_step: int = 0
    """Act as if a preemption notice arrived at this step and stays; 0 = never."""
    record_order: bool = False
    """Each worker logs the sample indices it trained on to `<run>/order/` (needs a local `run.storage`)."""
    step_delay_s: float = 0.0
    """Sleep this many seconds every step (at most 60): slows a tiny test run to the pace of cluster events."""
    hang_at_step: int = 0
    """Worker 1's training thread stops at this optimizer step and never goes on, once per run (its process still
    answers Ray): a hung worker; 0 = never. Needs two workers or more and a local `run.storage`."""


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
        """The config a tree of sections (`to_dict`'s, a YAML file's) holds; a ConfigError for a tree of another
        shape, an unknown key or a value of the wrong kind."""
        problem = sections_problem(tree)
        if problem:
            raise ConfigError(problem)
        cfg = cls()
        for section, values in tree.items():
            for key, value in (values or {}).items():
                set_key(cfg, f"{section}.{key}", value)
        return cfg

    def replaced(self, section: str, **values: Any) -> Config:
        """A copy with keys of one section replaced (`dataclasses.replace`); the other sections are shared, so
        neither config is to be changed afterwards."""
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)})

    def resolve(self) -> Config:
        """Fill in what is derived from other keys (the learning rate from the scaling rule, the post-hoc EMA's
        snapshot cadence); idempotent."""
        if self.train.lr is None:
            self.train.lr = rule_lr(self.train)
        if self.train.ema_snapshot_every == "auto":
            self.train.ema_snapshot_every = self.train.checkpoint_every
        return self

    def micro_batch_for(self, world_size: int) -> int | None:
        """Per-worker forward-pass size; null means one pass per step (the largest share). None for `auto`,
        which the workers measure."""
        if self.train.micro_batch == "auto":
            return None
        return self.train.micro_batch or -(-self.train.global_batch // world_size)


# Reading and writing keys.
def fields_of(obj: Any) -> dict[str, Any]:
    return get_type_hints(type(obj))


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{k}" for s in fields_of(cfg) for k in fields_of(getattr(cfg, s))]


def key_type(key: str) -> Any:
    """The type of `section.key`; a ConfigError naming the closest key for one that does not exist."""
    sections = get_type_hints(Config)
    section, _, name = key.partition(".")
    if "." in name or section not in sections or name not in get_type_hints(sections[section]):
        close = difflib.get_close_matches(key, all_keys(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known sections: {', '.join(sections)}"
        raise ConfigError(f"unknown key {shown(key)}{hint}")
    return get_type_hints(sections[section])[name]


def set_key(cfg: Config, key: str, value: Any) -> None:
    hint = key_type(key)
    section, name = key.split(".")
    try:
        setattr(getattr(cfg, section), name, coerce(value, hint))
    except ValueError:
        raise ConfigError(f"{key} = {shown(value)}: expected {describe_type(hint)}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`--set KEY=VALUE` as (key, value): VALUE read for the key's type by `read_override` (a string key takes the
    text as typed; another key reads it as YAML). A ConfigError for text without '=' or an unknown key."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, for example train.lr=1e-4")
    key, raw = text.split("=", 1)
    key = key.strip()
    hint = key_type(key)
    if not raw.strip() and type(None) in get_args(hint):  # `--set model.init_from=$CKPT`, CKPT unset: not "none"
        raise ConfigError(f"{key} = '': empty (an unset shell variable?): give a value, or null where you mean none")
    return key, read_override(raw, hint)
