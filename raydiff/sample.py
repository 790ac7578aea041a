"""Generate images from a trained run.

    python -m raydiff.sample --checkpoint RUN_DIR_OR_CHECKPOINT --num N --out PATH
        [--sampler ddpm|ddim] [--steps S] [--eta E] [--seed S] [--no-ema] [--batch B] [--device auto|cpu|cuda]
        [--endpoint URL]

PATH ending in .png gets one grid; any other PATH becomes a folder of sample_00000.png, sample_00001.png, ...
plus grid.png. --checkpoint also takes an s3:// or gs:// URI (--endpoint for an S3-compatible server), or a local
diffusers pipeline folder (what raydiff.export writes; needs the diffusers extra).
Sampling runs in full fp32 (no TF32) from the EMA weights (unless --no-ema). Image i draws its noise on the
sampling device from its own generator, seeded by (--seed, i): the same command gives the same images on the same
kind of device (CPU, or a CUDA GPU), whatever --batch. With --sampler ddim --steps <train.sample_steps> --seed
<train.seed> --num <train.sample_num> it reproduces the run's own sample grid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

import torch

from raydiff import cli
from raydiff.config import Config
from raydiff.model import diffusers_folder
from raydiff.model.diffusion import build_diffusion, images_per_pass
from raydiff.model.noise import GRID_NOISE
from raydiff.model.unet import build_model
from raydiff.runs.checkpoint import checkpoint_location
from raydiff.runs.images import save_samples
from raydiff.runs.rundir import unwritable
from raydiff.runs.state import read_newest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m raydiff.sample", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run directory (its newest checkpoint) or checkpoint folder; a path or s3:// / gs:// URI; "
                             "or a diffusers pipeline folder")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--num", type=int, default=64, help="number of images (default 64)")
    parser.add_argument("--out", required=True, type=Path, help="grid .png, or a folder")
    parser.add_argument("--sampler", choices=("ddpm", "ddim"), default="ddpm", help="default ddpm")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: all T for ddpm, 50 for ddim)")
    parser.add_argument("--eta", type=float, default=0.0, help="DDIM noise: 0 deterministic, 1 = DDPM posterior")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ema", action="store_true", help="use the online weights instead of the EMA")
    parser.add_argument("--batch", type=int, default=None,
                        help="images per forward pass (default: 64 up to 64x64, fewer above, 4 at 256x256)")
    parser.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    for name, low in (("num", 1), ("batch", 1), ("seed", 0)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            parser.error(f"--{name} {getattr(args, name)}: must be >= {low}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    if args.eta < 0:
        parser.error(f"--eta {args.eta}: must be >= 0")
    if args.sampler == "ddpm" and args.eta:
        parser.error("--eta applies to --sampler ddim only")
    reason = unwritable(args.out.parent if args.out.suffix.lower() == ".png" else args.out)
    if reason:
        parser.error(f"--out {args.out}: cannot write there ({reason})")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device on this machine")
    return device


def generate(state: dict, *, num: int, sampler: Literal["ddpm", "ddim"], steps: int | None, eta: float, seed: int,
             use_ema: bool, batch: int, device: torch.device) -> torch.Tensor:
    """Images in [-1, 1] from a training state; image i is a pure function of (seed, i), whatever `batch`."""
    cfg = Config.from_dict(state["config"])
    model = build_model(cfg)
    model.load_state_dict(state["ema" if use_ema else "model"])
    model = model.float().eval().to(device)
    diffusion = build_diffusion(cfg)
    shape = (cfg.data.channels, cfg.data.resolution, cfg.data.resolution)
    chunks = diffusion.sample_in_chunks(model, range(num), shape, batch=batch, seed=seed, tag=GRID_NOISE,
                                        device=device, sampler=sampler, steps=steps, eta=eta)
    return torch.cat([images.cpu() for images in chunks])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"raydiff: error: {exc}", file=sys.stderr)
        return 2
    if "://" not in args.checkpoint and diffusers_folder.is_diffusers_folder(args.checkpoint):
        # An exported pipeline: one set of weights, converted back to raydiff's names.
        checkpoint, state = args.checkpoint, diffusers_folder.state_from_folder(args.checkpoint)
    else:
        checkpoint, state = read_newest(checkpoint_location(args.checkpoint, args.endpoint))
    steps = args.steps if args.steps is not None else (50 if args.sampler == "ddim" else None)
    weights = state.get("weights") or ("online" if args.no_ema else "EMA")  # a diffusers folder holds one set
    print(f"[raydiff] sampling {args.num} images from {checkpoint} (step {state['step'] or '?'}, {weights} weights) "
          f"with {args.sampler}, "
          f"{steps or state['config']['diffusion']['timesteps']} steps, on {device}")
    with torch.inference_mode():
        images = generate(state, num=args.num, sampler=args.sampler, steps=steps, eta=args.eta, seed=args.seed,
                          use_ema=not args.no_ema, device=device,
                          batch=args.batch or images_per_pass(state["config"]["data"]["resolution"]))
    out = save_samples(images, args.out)
    print(f"[raydiff] wrote {out.resolve()}")
    return 0


def _entry() -> None:
    sys.exit(cli.run(main))


if __name__ == "__main__":
    _entry()
