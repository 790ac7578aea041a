"""Generate images from a trained run.

    python -m raydiff.sample --checkpoint RUN_DIR_OR_CHECKPOINT [--num N] --out PATH
        [--class K[,K...]] [--guidance W] [--guide GUIDE] [--sampler ddpm|ddim|dpmpp_2m|dpmpp_2m_sde|heun]
        [--steps S] [--eta E] [--seed S] [--no-ema]
        [--batch B] [--device auto|cpu|cuda] [--endpoint URL]

PATH ending in .png gets one grid; any other PATH becomes a folder of sample_00000.png, sample_00001.png, ...
plus grid.png. --checkpoint also takes an s3:// or gs:// URI (--endpoint for an S3-compatible server), or a local
diffusers pipeline folder (what raydiff.export writes; needs the diffusers extra).
Sampling runs in full fp32 (no TF32) from the EMA weights (unless --no-ema). Image i draws its noise on the
sampling device from its own generator, seeded by (--seed, i): the same command gives the same images on the same
kind of device (CPU, or a CUDA GPU), whatever --batch. With --sampler ddim --steps <train.sample_steps> --seed
<train.seed> --num <train.sample_num> it reproduces the run's own sample grid (a class-conditional run's grid has
a row of sample_num // C images for each of its first C classes, C at most 16: --num C x (sample_num // C), and
--class 0,...,C-1 where the model has more than 16 classes).

A class-conditional model samples the classes of --class (ids or names; default every class) with classifier-free
guidance W in diffusers' convention, eps = eps_uncond + W (eps_cond - eps_uncond): W = 1 is conditional sampling
without guidance, W = 0 unconditional. The default is the run's eval.guidance (2 unless the run set it), the
guidance of its own grids: a middle ground, where at W = 1 samples follow their class only loosely, and larger W
buys class fidelity with diversity (and FID). With C
classes asked for and N images, image i gets class i * C // N (contiguous blocks); the grid has one row per class
when C > 1 divides N.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from raydiff import cli
from raydiff.config import Config
from raydiff.config.schema import MAX_SAMPLING_STEPS, SAMPLERS
from raydiff.runs.images import GRID_FORMATS, is_grid_file
from raydiff.storage.errors import output_errors
from raydiff.storage.rundir import unwritable

SHOWN_CLASSES = 8  # classes named in full in the start line and in an error's list of choices


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.sample", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run directory (its newest checkpoint) or checkpoint folder; a path or s3:// / gs:// URI; "
                             "or a diffusers pipeline folder")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--num", type=int, default=64, help="number of images (default 64)")
    parser.add_argument("--out", required=True,
                        help="one grid image (.png; .jpg, .jpeg or .webp at quality 95), or a folder")
    parser.add_argument("--class", dest="classes", default=None, metavar="K[,K...]",
                        help="class-conditional models: the classes to sample, by id (0..classes-1) or name "
                             "(default: every class); image i gets class i * C // N of the C classes")
    parser.add_argument("--guidance", type=float, default=None,
                        help="class-conditional models: classifier-free guidance W >= 0, diffusers' convention "
                             "(1: conditional without guidance, 0: unconditional; default: the run's eval.guidance); "
                             "with --guide, the autoguidance weight (1: the model alone; default 2)")
    parser.add_argument("--guide", default=None, metavar="GUIDE",
                        help="autoguidance: a weaker model of the same data guides the model (an earlier checkpoint "
                             "of the run, or a smaller or shorter-trained run): a run or checkpoint folder, or a "
                             "diffusers folder")
    parser.add_argument("--sampler", choices=SAMPLERS, default="ddpm",
                        help="default ddpm; dpmpp_2m (DPM-Solver++ 2M), dpmpp_2m_sde (its SDE variant) and heun "
                             "approach or pass ddpm's quality in far fewer network evaluations")
    parser.add_argument("--steps", type=int, default=None,
                        help="sampling steps (default: all T for ddpm, 50 for ddim, 20 for the dpmpp_2m samplers, "
                             "18 for heun: 2 x 18 - 1 = 35 network evaluations, 34 on the cosine schedule)")
    parser.add_argument("--eta", type=float, default=0.0,
                        help="DDIM noise in [0, 1]: 0 deterministic, 1 = DDPM posterior")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ema", action="store_true", help="use the online weights instead of the EMA")
    parser.add_argument("--batch", type=int, default=None,
                        help="images per forward pass (default: 64 up to 64x64, fewer above, 4 at 256x256)")
    parser.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    cli.refuse_empty(parser, "--checkpoint", args.checkpoint, "a run directory or checkpoint")
    if args.guide is not None:
        cli.refuse_empty(parser, "--guide", args.guide, "a run directory or checkpoint")
    for name, low in (("num", 1), ("batch", 1), ("seed", 0)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            parser.error(f"--{name} {getattr(args, name)}: must be >= {low}")
    if args.steps is not None and not 1 <= args.steps <= MAX_SAMPLING_STEPS:
        parser.error(f"--steps {args.steps}: must be in [1, {MAX_SAMPLING_STEPS:,}]")
    if not 0 <= args.eta <= 1:  # above 1, DDIM's steps would clamp their noise and silently misshape the images
        parser.error(f"--eta {args.eta:g}: must be in [0, 1] (0: deterministic DDIM, 1: DDPM's posterior)")
    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 0):
        parser.error(f"--guidance {args.guidance:g}: must be >= 0 (diffusers' convention: 0 unconditional, 1 "
                     f"conditional without guidance, more follows the class more closely)")
    if args.sampler != "ddim" and args.eta:
        parser.error("--eta applies to --sampler ddim only")
    cli.refuse_empty(parser, "--out", args.out, f"a grid image ({', '.join(GRID_FORMATS)}) or a folder")
    cli.refuse_remote(parser, "--out", args.out)
    if is_grid_file(Path(args.out)) and args.out.endswith(("/", os.sep)):  # Path() drops the slash: a grid file
        parser.error(f"--out {args.out}: names a folder (the trailing /); a name ending in {Path(args.out).suffix} "
                     f"is written as one grid image file (a folder of samples takes a name without it)")
    args.out = Path(args.out).expanduser()  # `--out=~/x.png`: the shell leaves that ~
    if is_grid_file(args.out) and args.out.is_dir():  # else found only once every image is sampled
        parser.error(f"--out {args.out}: is a folder; a name ending in {args.out.suffix} is written as one grid "
                     f"image file (a folder of samples takes a name without it)")
    reason = unwritable(args.out.parent if is_grid_file(args.out) else args.out)
    if reason:
        parser.error(f"--out {args.out}: cannot write there ({reason})")
    return args


def class_names(state: dict) -> list[str]:
    """The names of a class-conditional model's classes (its ids where none were recorded); [] when unconditional."""
    num_classes = int(state["config"]["model"].get("num_classes") or 0)
    names = [str(n) for n in (state.get("classes") or {}).get("names") or []]
    return names if len(names) == num_classes else [str(i) for i in range(num_classes)]


def _choices(names: Sequence[str]) -> str:
    shown = ", ".join(f"{i} {n!r}" for i, n in enumerate(names[:SHOWN_CLASSES]))
    more = f", ... ({len(names)} classes)" if len(names) > SHOWN_CLASSES else ""
    return f"an id 0..{len(names) - 1} or a name: {shown}{more}"


def class_id(token: str, names: Sequence[str]) -> int:
    """One class of `--class`: a name (first: names are what the run's data called the classes) or an id."""
    if token in names:
        return list(names).index(token)
    if token.isascii() and token.isdigit() and int(token) < len(names):
        return int(token)
    raise ValueError(f"--class {token!r}: not a class of this model; use {_choices(names)}")


def class_request(state: dict, spec: str | None, guidance: float | None,
                  autoguided: bool = False) -> tuple[list[int] | None, float]:
    """(the class ids to sample, or None for an unconditional model; the guidance: classifier-free, or with
    `autoguided` the autoguidance weight). ValueError, one line naming the value and what is allowed, for what
    the model cannot do: checked before anything is sampled or written."""
    names = class_names(state)
    if autoguided:
        from raydiff.model.guidance import AUTOGUIDANCE

        if spec is not None and not names:
            raise ValueError(f"--class {spec}: the model is unconditional (model.num_classes = 0); --class applies "
                             f"to class-conditional models only")
        ids = None if not names else list(range(len(names))) if spec is None else [
            class_id(token.strip(), names) for token in spec.split(",")]
        return ids, AUTOGUIDANCE if guidance is None else guidance
    if not names:
        for flag, value in (("--class", spec), ("--guidance", None if guidance is None else f"{guidance:g}")):
            if value is not None:
                raise ValueError(f"{flag} {value}: the model is unconditional (model.num_classes = 0); {flag} "
                                 f"applies to class-conditional models only")
        return None, 1.0
    ids = list(range(len(names))) if spec is None else [class_id(token.strip(), names) for token in spec.split(",")]
    run = Config.from_dict(state["config"])
    w = run.eval.guidance if guidance is None else guidance  # default: the run's own grids' guidance
    if w != 1 and run.train.label_dropout == 0:
        raise ValueError(f"--guidance {w:g}: this model never learned the unconditional prediction that guidance "
                         f"needs (trained with train.label_dropout = 0: no labels dropped); use --guidance 1 "
                         f"(conditional, no guidance)")
    return ids, w


def describe(classes: Sequence[int], names: Sequence[str], everyone: bool) -> str:
    shown = ", ".join(f"{i} ({names[i]})" for i in classes[:SHOWN_CLASSES])
    more = f", ... ({len(classes)} in all)" if len(classes) > SHOWN_CLASSES else ""
    return f"{'every class: ' if everyone else 'class '}{shown}{more}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported once the arguments are read: a mistake in them is answered without loading torch.
    import torch

    from raydiff.cluster.devices import resolve_device
    from raydiff.cluster.host_memory import keep_host_memory, keep_host_memory_here
    from raydiff.model.diffusion import images_per_pass, steps_taken
    from raydiff.model.guidance import check_guide, state_class_names
    from raydiff.runs.ema_snapshots import weights_of
    from raydiff.runs.generate import generate, read_any
    from raydiff.runs.images import grid_row, image_labels, save_samples

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"raydiff: error: {exc}", file=sys.stderr)
        return 2
    checkpoint, state = read_any(args.checkpoint, args.endpoint)
    guide_at, guide = read_any(args.guide, args.endpoint, flag="--guide") if args.guide is not None else (None, None)
    try:
        if guide is not None:
            check_guide(state["config"], guide["config"], args.guide,
                        class_names=(state_class_names(state), state_class_names(guide)))
        classes, guidance = class_request(state, args.classes, args.guidance, autoguided=guide is not None)
        if classes is not None and args.classes is not None and args.num < len(classes):
            raise ValueError(f"--num {args.num}: fewer images than the {len(classes)} classes asked (--class "
                             f"{args.classes}); give --num {len(classes)} or more")
        weights = weights_of(state, checkpoint, use_ema=not args.no_ema)
    except ValueError as exc:
        print(f"raydiff: error: {exc}", file=sys.stderr)
        return 2
    labels = None if classes is None else image_labels(classes, args.num)
    sampled = None if labels is None else list(dict.fromkeys(labels))  # every class of the model, or --num of them
    # Sampling runs in this process: on CPUs, keep what each pass frees, as the run's workers did.
    setting = state["config"]["train"].get("keep_host_memory", "auto")  # older runs' configs lack it
    kept = keep_host_memory(setting, use_gpu=device.type == "cuda") and keep_host_memory_here()
    steps = steps_taken(args.sampler, args.steps, state["config"]["diffusion"]["timesteps"])
    print(f"[raydiff] sampling {args.num} images from {checkpoint} (step {state['step'] or '?'}, {weights} weights) "
          f"with {args.sampler}, {steps} steps, on {device}" + (", host memory kept" if kept else "")
          + ("" if sampled is None or classes is None else
             f"; {describe(sampled, class_names(state), args.classes is None and sampled == classes)}"
             + ("" if sampled == classes else f" ({len(sampled)} of its {len(classes)} classes: --num {args.num})"))
          + ("" if guide is None and classes is None else f", {'autoguidance' if guide else 'guidance'} {guidance:g}")
          + ("" if guide is None else f" by {guide_at} (step {guide['step'] or '?'})"))
    with torch.inference_mode():
        images = generate(state, num=args.num, sampler=args.sampler, steps=steps, eta=args.eta, seed=args.seed,
                          use_ema=not args.no_ema, device=device, labels=labels, guidance=guidance, guide=guide,
                          batch=args.batch or images_per_pass(state["config"]["data"]["resolution"]))
    with output_errors("--out", args.out):
        out = save_samples(images, args.out, nrow=None if classes is None else grid_row(classes, args.num))
    print(f"[raydiff] wrote {out.resolve()}")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
