"""One training worker's objects, built once per worker start, in this order: the model, its EMA and optimizer;
the data; the memory plan; the checkpoint restored (the same one on every worker, `raydiff.training.recovery`);
the step's forward module wrapped for DDP and compiled (`raydiff.training.speed`); the logs.

Why apart from the loop: setting up is long and runs once; the loop (`raydiff.training.loop`) then reads as
training only.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from raydiff.cluster.devices import require_visible
from raydiff.cluster.nodes import this_node
from raydiff.config import Config
from raydiff.data.loader import Batches, ImageTable
from raydiff.data.node_cache import StreamTable
from raydiff.data.on_device import DeviceImages, open_batches, place_images
from raydiff.data.order import SampleOrder, micro_batches, rank_share
from raydiff.data.run_images import open_tables
from raydiff.model.diffusion import GaussianDiffusion, build_diffusion, images_per_pass
from raydiff.model.unet import build_model
from raydiff.model.weight_averages import EmaUpdater, PowerEma, make_ema
from raydiff.runs.runlog import JsonlLog
from raydiff.runs.state import Progress, TrainingState
from raydiff.storage.rundir import RunDir
from raydiff.storage.writes import BackgroundWrites
from raydiff.training.compile_cache import CompileCache, cache_key
from raydiff.training.debug import DebugHooks
from raydiff.training.distributed import first_to_hold, from_rank_zero, smallest
from raydiff.training.flat_allreduce import FlatGradients
from raydiff.training.in_run_quality import InRunQuality
from raydiff.training.microbatch import plan_memory, probe_share
from raydiff.training.recovery import restore_agreed
from raydiff.training.speed import SpeedPlan, apply_training_flags, for_training, plan_speed, set_compile_threads
from raydiff.training.step import StepParts, make_optimizer, resolve_precision
from raydiff.training.validation import Validation, holdout_split
from raydiff.training.worker_io import WorkerArgs

REMOTE_METRICS_FLUSH_S = 30.0  # an object store cannot append: metrics.jsonl is rewritten at most this often


def quiet_ray_train_logs() -> None:
    """Ray 2.60 names some Train loggers by file path (`getLogger(__file__)`), so they escape RunConfig's
    LoggingConfig and print every report on every worker; raise just those to WARNING."""
    for name in list(logging.root.manager.loggerDict):
        if "ray/train/" in name.replace("\\", "/"):
            logging.getLogger(name).setLevel(logging.WARNING)


@dataclass
class Worker:
    """What one worker holds for the whole run."""

    cfg: Config
    run_dir: RunDir
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module  # the bare model (the EMA follows it; checkpoints hold it)
    ema: torch.nn.Module
    ema_update: EmaUpdater
    posthoc: PowerEma | None  # train.ema: posthoc: the tracked power-function averages
    diffusion: GaussianDiffusion
    speed: SpeedPlan  # what train.compile, channels_last, cuda_graphs, ... mean here
    memory_plan: str  # the micro-batch and activation checkpointing, and why (`plan_memory`)
    step_parts: StepParts
    table: ImageTable | StreamTable
    device_images: DeviceImages | None  # data.on_device: the images on the training device, gathered there
    data_placement: str  # where the images are gathered, and why, for the start line (`place_images`)
    order: SampleOrder
    validation: Validation | None
    quality: InRunQuality | None  # eval.every / eval.at_end: the feature network and the reference
    micro_batch: int
    metrics_log: JsonlLog | None  # rank 0 only
    events: JsonlLog | None  # rank 0 only
    writes: BackgroundWrites | None  # rank 0 only: metrics and sample grids go to storage on this thread
    debug: DebugHooks  # the debug.* keys: fault injection and audit trails (nothing, by default)
    compile_cache: CompileCache | None  # where the compiled step is kept (train.compile_cache), if it is compiled
    restore_notes: list[str]  # what restoring the checkpoint dropped because a setting changed (rank 0 warns)
    compile_cache_note: str | None  # whether the compiled step came from the cache, for the start line
    classes: dict[str, Any] | None = None  # class-conditional: {"names", "counts"}, saved with every checkpoint

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def num_classes(self) -> int:
        """The model's classes (0: unconditional); the driver resolved `model.num_classes: auto`."""
        num_classes = self.cfg.model.num_classes
        assert num_classes != "auto", "the driver resolves model.num_classes"
        return num_classes

    @property
    def images_per_pass(self) -> int:
        """Images per forward pass of what the run generates or scores besides training (validation, sample
        grids, in-run quality): at most the micro-batch (a training step's forward and backward pass fits it) and
        at most `images_per_pass` of the resolution, as the commands sample: under CUDA graphs the step's
        activations stay in the graphs' memory pool, which these passes cannot reuse (4 images at 256x256)."""
        return min(self.micro_batch, images_per_pass(self.cfg.data.resolution))

    @property
    def training_state(self) -> TrainingState:
        """What checkpoints save and restore (the bare model, not its DDP or compiled wrapper)."""
        s = self.step_parts
        return TrainingState(self.model, self.ema, s.optimizer, s.scaler, self.posthoc)

    def open_stream(self, progress: Progress) -> Batches:
        t = self.cfg.train
        share = rank_share(t.global_batch, self.world_size, self.rank)
        labels = (t.label_dropout, self.num_classes) if self.num_classes else None
        return open_batches(table=self.table, images=self.device_images, order=self.order,
                            global_batch=t.global_batch, share=share, micro_batch=self.micro_batch,
                            start_step=progress.stream_step, seed=t.seed, timesteps=self.cfg.diffusion.timesteps,
                            device=self.device, labels=labels)

    def event(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.append({"event": event, **fields, "time": time.time()})

    def close(self, *, flush: bool = True) -> None:
        """At the end of the worker's training: rank 0's metrics rows and writes reach storage (with `flush`; not
        after a storage failure), then its writer thread ends."""
        flushed = False
        try:
            if flush and self.metrics_log is not None:
                self.metrics_log.flush()
            flushed = flush
        finally:
            try:
                if self.writes is not None:  # ended whatever the flush met (a full disk): no thread left behind
                    self.writes.close(drain=flushed)
            finally:
                self.debug.close()


def set_up(cfg: Config, args: WorkerArgs) -> tuple[Worker, Progress]:
    """Build this worker's objects and restore the run's newest checkpoint into them (`Unresumable` when there are
    checkpoints and none restores: nothing has been written then); returns the worker and where it continues."""
    t = cfg.train
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    require_visible(device)
    node = this_node()  # its CPUs shared by the training workers on it: this run's, or a sweep's, one per GPU
    on_node = max(context.get_local_world_size(), int(node.get("GPU", 0)) if device.type == "cuda" else 0)
    speed = plan_speed(t, device, world_size, one_node=context.get_local_world_size() == world_size,
                       node_cpus=node.get("CPU"), workers_on_node=on_node)
    apply_training_flags(speed, device)
    set_compile_threads(speed.compile_threads)

    # The model, its EMA and optimizer: the same initial weights on every worker.
    torch.manual_seed(t.seed)
    model = build_model(cfg).to(device)
    if args.init_weights is not None:  # model.init_from: the driver sends it to new runs only
        model.load_state_dict(ray.get(args.init_weights))
    if speed.channels_last:  # before the EMA and the optimizer's moments copy its layout
        model = model.to(memory_format=torch.channels_last)
    ema = make_ema(model)
    ema_update = EmaUpdater(ema, model)  # before the memory plan: on a GPU it keeps a copy of the weights
    posthoc = PowerEma(model, t.ema_sigma_rels, staged_by=ema_update) if t.ema == "posthoc" else None
    assert t.lr is not None, "a loaded config has its learning rate resolved"
    optimizer = make_optimizer(model, lr=t.lr, weight_decay=t.weight_decay)
    autocast_dtype = resolve_precision(t.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    diffusion = build_diffusion(cfg)
    run_dir = args.run_dir

    # The data: the held-out images, and the training stream (from memory, or streamed shard by shard).
    images = args.images
    train_indices, val_indices = holdout_split(images.usable_indices(), cfg.data.val_images, t.seed)
    conditional = bool(cfg.model.num_classes)
    val_labels = images.labels[val_indices] if conditional and images.labels is not None else None
    table, order, val_table, val_indices = open_tables(images, train_indices, val_indices, t.seed,
                                                      group=from_rank_zero(uuid.uuid4().hex))
    validation = Validation(table=val_table, val_indices=val_indices, seed=t.seed, timesteps=diffusion.timesteps,
                            rank=rank, world_size=world_size, labels=val_labels) if len(val_indices) else None
    device_images, data_placement = place_images(cfg.data.on_device, table, device)  # before the memory plan

    # The micro-batch and activation checkpointing, measured with the setting the worker will train with.
    share = rank_share(t.global_batch, world_size, rank)
    micro_batch, _, memory_plan = plan_memory(  # the model holds whether it checkpoints
        model, diffusion, optimizer, fixed_micro_batch=cfg.micro_batch_for(world_size),
        checkpointing=t.activation_checkpointing, share=probe_share(t.global_batch, world_size),
        shape=images.shape, device=device,
        autocast_dtype=autocast_dtype, agree=lambda n: smallest(n, device))

    # The newest checkpoint every worker restores alike; then the settings a re-run may change.
    training_state = TrainingState(model, ema, optimizer, scaler, posthoc)
    restored = restore_agreed(training_state, run_dir, is_chief=rank == 0, weight_decay=t.weight_decay,
                              latest=ray.train.get_checkpoint())

    # The step's forward module as it runs here: under DDP (or beside the flat all-reduce) with several workers,
    # compiled (with its cache).
    step_parts = StepParts.build(model, diffusion, optimizer, scaler, device=device, autocast_dtype=autocast_dtype,
                                   seed=t.seed, flip=cfg.data.flip, global_batch=t.global_batch,
                                   world_size=world_size, grad_clip=t.grad_clip, dropout=cfg.model.dropout > 0,
                                   channels_last=speed.channels_last)
    compile_cache, compile_cache_note = None, None
    if speed.compile is not False and t.compile_cache:
        key = compiled_step_key(cfg, speed, device, layout=micro_batches(share, micro_batch),
                                autocast_dtype=autocast_dtype, checkpointing=model.activation_checkpointing)
        compile_cache = CompileCache(run_dir, key, keeps=first_to_hold(key))  # a collective
        compile_cache_note = compile_cache.load()
    step_parts.loss = for_training(step_parts.loss, speed, device, world_size)
    step_parts.cuda_graphs = speed.cuda_graphs
    if speed.allreduce == "flat":
        step_parts.flat_grads = FlatGradients(list(model.parameters()), world_size=world_size,
                                              compression=speed.grad_compression)
        step_parts.flat_grads.broadcast_weights()

    is_chief = rank == 0
    writes = BackgroundWrites() if is_chief else None
    worker = Worker(
        cfg=cfg, run_dir=run_dir, rank=rank, world_size=world_size, device=device, model=model, ema=ema,
        ema_update=ema_update, posthoc=posthoc, diffusion=diffusion, speed=speed, memory_plan=memory_plan,
        step_parts=step_parts, table=table, device_images=device_images, data_placement=data_placement, order=order,
        validation=validation,
        quality=ray.get(args.quality) if args.quality is not None else None,
        micro_batch=micro_batch,
        metrics_log=JsonlLog(run_dir, "metrics.jsonl", flush_every_s=REMOTE_METRICS_FLUSH_S,
                             writes=writes) if is_chief else None,
        events=JsonlLog(run_dir, "events.jsonl") if is_chief else None, writes=writes,
        debug=DebugHooks(cfg, run_dir, rank), compile_cache=compile_cache,
        restore_notes=restored.notes if restored is not None else [], compile_cache_note=compile_cache_note,
        classes=args.classes,
    )
    return worker, restored.progress if restored is not None else Progress()


def compiled_step_key(cfg: Config, speed: SpeedPlan, device: torch.device, *,
                      layout: list[tuple[int, int]], autocast_dtype: torch.dtype | None, checkpointing: bool) -> str:
    """The compile cache's key: what the compiled step depends on besides torch and the device."""
    model = {k: v for k, v in asdict(cfg.model).items() if k != "init_from"}
    return cache_key({"model": model, "image": [cfg.data.channels, cfg.data.resolution], "flip": cfg.data.flip,
                      "diffusion": asdict(cfg.diffusion), "loss_weighting": cfg.train.loss_weighting,
                      "min_snr_gamma": cfg.train.min_snr_gamma, "autocast": str(autocast_dtype),
                      "activation_checkpointing": checkpointing, "micro_batches": sorted({n for _, n in layout}),
                      "ddp": speed.allreduce == "ddp", "grad_compression": speed.grad_compression,
                      "compile": speed.compile, "options": speed.compile_options,
                      "channels_last": speed.channels_last, "tf32": speed.tf32}, device)
