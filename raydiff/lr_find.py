"""LR range test: train with an exponentially growing learning rate and watch the loss (Smith, 2017).

    python -m raydiff.lr_find [--config NAME_OR_PATH] [--set key=value ...] [--start 1e-7] [--end 1e-2]
        [--steps 200] [--out lr_find.png]

One process on one device (a GPU if there is one), the config's model (from `model.init_from`'s weights for a
fine-tune), data (with its labels and label dropout for a class-conditional config, the classes resolved as a run
resolves them), global batch and precision. The learning rate grows from --start to --end over --steps optimizer
steps; the test stops early when the smoothed loss diverges (above 4x its minimum, or not finite). It suggests a
tenth of the learning rate at the smoothed loss minimum (the textbook heuristic) and also reports the point of
steepest descent. Writes the plot to --out and the numbers to a .csv beside it.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from raydiff import cli
from raydiff.config import Config, ConfigError, load_config, preset_names
from raydiff.storage.atomic import new_file, sync_file
from raydiff.storage.errors import output_errors
from raydiff.storage.rundir import unwritable

SMOOTHING = 0.98  # exponential smoothing of the loss, bias-corrected
DIVERGED = 4.0  # stop once the smoothed loss exceeds this multiple of its minimum
MAX_STEPS = 100_000  # far more than a range test needs; its learning rates are held in memory


def lr_range(start: float, end: float, steps: int) -> np.ndarray:
    return start * (end / start) ** (np.arange(steps) / max(steps - 1, 1))


def smooth(losses: list[float]) -> list[float]:
    out, average = [], 0.0
    for i, loss in enumerate(losses):
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        out.append(average / (1 - SMOOTHING ** (i + 1)))
    return out


def suggest(lrs: np.ndarray, smoothed: list[float]) -> tuple[float, float, float]:
    """(suggested lr, lr at the smoothed minimum, lr of steepest descent before the minimum)."""
    values = np.asarray(smoothed)
    best = int(np.nanargmin(values))
    if best < 2:
        return lrs[best] / 10, lrs[best], lrs[best]
    slope = np.gradient(values[: best + 1], np.log(lrs[: best + 1]))
    return lrs[best] / 10, lrs[best], lrs[int(np.argmin(slope))]


def run_lr_find(cfg: Config, *, start: float, end: float, steps: int) -> dict:
    import torch

    from raydiff.cluster.devices import resolve_device
    from raydiff.cluster.host_memory import keep_host_memory, keep_host_memory_here
    from raydiff.cluster.start import init_ray
    from raydiff.data.loader import BatchStream
    from raydiff.data.noise import drawn_on_device
    from raydiff.data.order import Share
    from raydiff.data.run_images import open_images, open_tables
    from raydiff.data.sources import source_of
    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.unet import build_model
    from raydiff.runs.init_from import load_init_weights
    from raydiff.training.microbatch import plan_memory
    from raydiff.training.resolve import resolve_run
    from raydiff.training.step import StepParts, make_optimizer, optimizer_step, resolve_precision
    from raydiff.training.validation import check_holdout, holdout_split

    t = cfg.train
    # A fine-tune's range test starts where the fine-tune will: from model.init_from's weights (checked first).
    init_weights = load_init_weights(cfg).weights if cfg.model.init_from else None
    device = resolve_device("auto")
    # The test trains in this process, in its main thread: on CPUs, keep what each step frees, as a worker does.
    kept = keep_host_memory(t.keep_host_memory, use_gpu=device.type == "cuda") and keep_host_memory_here()
    init_ray()
    images, _ = open_images(cfg.data, source_of(cfg.data), storage=cfg.run.storage, endpoint=cfg.run.endpoint)
    # A class-conditional config trains on the data's labels, its classes resolved as a run's are.
    cfg, _ = resolve_run(cfg, gpus=float(device.type == "cuda"), images=images, init_weights=init_weights)
    num_classes = int(cfg.model.num_classes)
    check_holdout(cfg.data.val_images, images.num_good)
    train_indices, _ = holdout_split(images.usable_indices(), cfg.data.val_images, t.seed)
    table, order, _, _ = open_tables(images, train_indices, np.empty(0, np.int64), t.seed, group="lr-find")

    torch.manual_seed(t.seed)
    model = build_model(cfg)
    if init_weights is not None:
        model.load_state_dict(init_weights)
    model = model.to(device)
    autocast_dtype = resolve_precision(t.precision, device)
    diffusion, optimizer = build_diffusion(cfg), make_optimizer(model, lr=start, weight_decay=t.weight_decay)
    # The micro-batch and activation checkpointing as a one-worker run plans them: on a GPU `auto` measures what
    # fits (a 256x256 preset's whole batch in one pass does not).
    micro_batch, _, memory_plan = plan_memory(
        model, diffusion, optimizer, fixed_micro_batch=cfg.micro_batch_for(1),
        checkpointing=t.activation_checkpointing, share=t.global_batch, shape=images.shape, device=device,
        autocast_dtype=autocast_dtype, agree=lambda n: n)
    stream = BatchStream(table=table, order=order, global_batch=t.global_batch,
                         share=Share(0, t.global_batch), micro_batch=micro_batch, start_step=0,
                         pin_memory=device.type == "cuda", noise=(t.seed, cfg.diffusion.timesteps),
                         device_noise=drawn_on_device(device),
                         labels=(t.label_dropout, num_classes) if num_classes else None)

    step_parts = StepParts.build(
        model, diffusion, optimizer, torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16),
        device=device, autocast_dtype=autocast_dtype, seed=t.seed, flip=cfg.data.flip, global_batch=t.global_batch,
        world_size=1, grad_clip=t.grad_clip, dropout=cfg.model.dropout > 0)
    lrs, losses, stop_reason = lr_range(start, end, steps), [], None
    try:
        for lr in lrs:
            result = optimizer_step(step_parts, next(stream), lr=float(lr))  # the training loop's step, no EMA
            losses.append(float(result.loss_sum) / t.global_batch)
            smoothed = smooth(losses)
            if not math.isfinite(losses[-1]) or smoothed[-1] > DIVERGED * np.nanmin(smoothed):
                stop_reason = f"the loss diverged at lr {lr:.3g}"
                break
    finally:
        stream.close()
    lrs = lrs[: len(losses)]
    if not math.isfinite(losses[0]):  # nothing to suggest from
        raise ConfigError(f"lr_find: the loss was not finite at the first step (lr {start:.3g}): check "
                          f"train.precision (fp16 may overflow) and model.init_from's weights, or start lower with "
                          f"--start")
    smoothed = smooth([loss if math.isfinite(loss) else float("nan") for loss in losses])
    suggested, at_minimum, steepest = suggest(lrs, smoothed)
    return {"lrs": lrs.tolist(), "losses": losses, "smoothed": smoothed, "suggested_lr": float(suggested),
            "minimum_lr": float(at_minimum), "steepest_lr": float(steepest), "steps_run": len(losses),
            "stop_reason": stop_reason, "device": str(device), "host_memory_kept": kept, "classes": num_classes,
            "init_from": cfg.model.init_from, "micro_batch": micro_batch, "memory_plan": memory_plan}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.lr_find", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default", help=f"preset ({', '.join(preset_names())}) or YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--start", type=float, default=1e-7, help="first learning rate (default 1e-7)")
    parser.add_argument("--end", type=float, default=1e-2, help="last learning rate (default 1e-2)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--out", default="lr_find.png", help="plot path (default lr_find.png)")
    args = parser.parse_args(argv)
    for flag, value in (("--start", args.start), ("--end", args.end)):
        if not math.isfinite(value):  # inf (or 1e400) would train at an infinite learning rate
            parser.error(f"{flag} {value}: must be a finite learning rate, such as 1e-2")
    if not 0 < args.start < args.end:
        parser.error(f"--start {args.start} --end {args.end}: need 0 < start < end")
    if not 10 <= args.steps <= MAX_STEPS:
        parser.error(f"--steps {args.steps}: must be in [10, {MAX_STEPS:,}]")
    if Path(args.out).suffix.lower() != ".png":  # an empty one, too: Path("") is "."
        parser.error(f"--out {args.out!r}: must end in .png")
    cli.refuse_remote(parser, "--out", args.out)
    args.out = Path(args.out).expanduser()  # `--out=~/x.png`: the shell leaves that ~
    for path in (args.out, args.out.with_suffix(".csv")):  # else found only once the whole test has run
        if path.is_dir():
            what = "is a folder" if path == args.out else f"its numbers' file {path} is a folder"
            parser.error(f"--out {args.out}: {what}; the plot and the .csv beside it are files: choose another name")
    reason = unwritable(args.out.parent)
    if reason:
        parser.error(f"--out {args.out}: cannot write there ({reason})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    from raydiff.config.learning_rate import rule_lr
    from raydiff.plots import plot_lr_find

    t = cfg.train
    print(f"[raydiff] LR range test: up to {args.steps} steps, lr {args.start:.2g} -> {args.end:.2g}, "
          f"global batch {t.global_batch}")
    found = run_lr_find(cfg, start=args.start, end=args.end, steps=args.steps)
    table = args.out.with_suffix(".csv")
    # The numbers written first and published last, once the plot is: a failure leaves neither new file, not a
    # new plot beside an earlier run's numbers.
    with output_errors("--out", args.out), new_file(table) as tmp:
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "lr", "loss", "smoothed_loss"])
            writer.writerows(zip(range(1, found["steps_run"] + 1), found["lrs"], found["losses"], found["smoothed"],
                                 strict=True))
        sync_file(tmp)  # on disk before the plot is published: what may fail later is only the rename
        plot = plot_lr_find(found["lrs"], found["losses"], found["smoothed"], suggested=found["suggested_lr"],
                            steepest=found["steepest_lr"], path=args.out)

    ended = f"stopped after {found['steps_run']} steps: {found['stop_reason']}" if found["stop_reason"] else \
        f"ran all {found['steps_run']} steps without diverging (a larger --end may find the edge)"
    suggested = found["suggested_lr"]
    # The base_lr that the config's scaling rule would turn into the suggested learning rate.
    base = suggested * t.base_lr / rule_lr(t)
    conditional = f", class-conditional on {found['classes']} classes" if found["classes"] else ""
    init_from = f", from model.init_from = {found['init_from']}" if found["init_from"] else ""
    kept = ", host memory kept" if found["host_memory_kept"] else ""
    print(f"[raydiff] {ended} on {found['device']}{conditional}{init_from}{kept}; micro-batches of up to "
          f"{found['micro_batch']}, {found['memory_plan']}")
    print(f"[raydiff] smoothed loss minimum at lr {found['minimum_lr']:.3g}; steepest descent at lr "
          f"{found['steepest_lr']:.3g}")
    print(f"[raydiff] suggested lr {suggested:.3g} (a tenth of the minimum): --set train.lr={suggested:.3g}, or "
          f"--set train.base_lr={base:.3g} with train.lr_scaling={t.lr_scaling} at base_batch {t.base_batch}")
    print(f"[raydiff] plot: {plot.resolve()}  numbers: {table.resolve()}")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
