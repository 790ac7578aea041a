"""Export a trained run to a Hugging Face diffusers pipeline folder.

    python -m raydiff.export --checkpoint RUN_DIR_OR_CHECKPOINT --out DIR [--no-ema] [--guide GUIDE [--guidance W]]
        [--endpoint URL]

DIR gets what `diffusers.DDPMPipeline.from_pretrained(DIR)` loads: model_index.json, unet/ (UNet2DModel config and
safetensors weights, the EMA unless --no-ema) and scheduler/ (DDPMScheduler config: the run's T, schedule,
prediction type, clipping and the posterior variance of raydiff's DDPM sampler), plus the run's config
(raydiff_config.yaml), where the weights came from (raydiff_export.json) and a README model card. A class-conditional
model's UNet has num_class_embeds = classes + 1 (the null class last); its class names are in raydiff_export.json
and the model card, whose example samples a class with guidance through diffusers' scheduler (DDPMPipeline itself
takes no labels). --guide exports a guiding model's EMA UNet as guide_unet/ and adds sampling with autoguidance
at --guidance W (default 2) to the model card. --checkpoint and --guide also take s3:// or gs:// URIs
(--endpoint for an S3-compatible server); DIR is a local folder that must not exist or be empty, and appears
complete or not at all. Needs the diffusers extra: pip install "raydiff[diffusers]".
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from raydiff import cli
from raydiff.config import Config, ConfigError
from raydiff.data.shard_format import refuse_occupied
from raydiff.storage.atomic import new_folder
from raydiff.storage.errors import output_errors
from raydiff.storage.rundir import unwritable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.export", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run directory (its newest checkpoint) or checkpoint folder; a path or s3:// / gs:// URI")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--out", required=True, help="the pipeline folder to write (new or empty)")
    parser.add_argument("--no-ema", action="store_true", help="export the online weights instead of the EMA")
    parser.add_argument("--guide", default=None, help="autoguidance: a weaker model of the same data (an earlier "
                                                     "checkpoint of the run, or a smaller or shorter-trained run), "
                                                     "exported as guide_unet/ with sampling code in the model card")
    parser.add_argument("--guidance", type=float, default=None, help="with --guide: the autoguidance weight the model "
                                                                     "card samples at (default 2; 1 = the model alone)")
    args = parser.parse_args(argv)
    cli.refuse_empty(parser, "--checkpoint", args.checkpoint, "a run directory or checkpoint")
    cli.refuse_empty(parser, "--out", args.out, "a new or empty folder")
    cli.refuse_remote(parser, "--out", args.out)
    if args.guide is not None:
        cli.refuse_empty(parser, "--guide", args.guide, "a run directory or checkpoint")
    args.out = Path(args.out)
    if args.guidance is not None and (args.guide is None or not math.isfinite(args.guidance) or args.guidance < 0):
        parser.error(f"--guidance {args.guidance:g}: a number >= 0, and only with --guide")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.expanduser().resolve()
    refuse_occupied(str(out), name="--out")  # a local path (a Path's text has no URI's "//"), `~` expanded
    reason = unwritable(out.parent)  # the pipeline is built beside DIR, then renamed into place
    if reason:
        print(f"raydiff: error: --out {args.out}: cannot write there ({reason})", file=sys.stderr)
        return 2

    from raydiff.model import diffusers_folder, diffusers_io
    from raydiff.model.guidance import AUTOGUIDANCE
    from raydiff.runs.checkpoint import checkpoint_location
    from raydiff.runs.ema_snapshots import weights_of
    from raydiff.runs.state import read_guide, read_newest

    location = checkpoint_location(args.checkpoint, args.endpoint)  # first: a folder this user may not read
    diffusers_io.require_diffusers("raydiff.export")
    checkpoint, state = read_newest(location, where=f"--checkpoint {args.checkpoint}")
    try:
        weights = weights_of(state, checkpoint, use_ema=not args.no_ema)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    diffusers_io.check_exportable(Config.from_dict(state["config"]))  # refused before anything is written
    guide: dict[str, Any] | None = None
    guided = ""
    if args.guide is not None:
        guide_at, guide_state = read_guide(args.guide, args.endpoint, state)
        try:
            diffusers_io.check_exportable(Config.from_dict(guide_state["config"]))
        except ConfigError as exc:
            raise ConfigError(f"--guide {args.guide}: {exc}") from None
        guide = {"state": guide_state, "checkpoint": str(guide_at),
                 "guidance": AUTOGUIDANCE if args.guidance is None else args.guidance}
        guided = f", guided by {guide_at} (step {guide_state['step']}) in guide_unet/"

    # Built beside DIR and renamed into place: DIR is complete or absent (or still empty).
    with output_errors("--out", args.out), new_folder(out) as tmp:
        diffusers_folder.save_pipeline_folder(tmp, state, use_ema=not args.no_ema, checkpoint=str(checkpoint),
                                              guidance=Config.from_dict(state["config"]).eval.guidance, guide=guide)
    classes = diffusers_folder.recorded_classes(state, Config.from_dict(state["config"]))
    kind = f", {len(classes['names'])} classes plus the null class" if classes else ""
    print(f"[raydiff] exported {checkpoint} (step {state['step']}, {weights} weights{kind}{guided}) to {out}")
    if classes:
        print(f"[raydiff] load it with: DDPMPipeline.from_pretrained({str(out)!r}) and sample a class as "
              f"{out / 'README.md'} shows (DDPMPipeline's own __call__ takes no labels)")
    else:
        print(f"[raydiff] load it with: DDPMPipeline.from_pretrained({str(out)!r}); see {out / 'README.md'}")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
