"""Export a trained run to a Hugging Face diffusers pipeline folder.

    python -m raydiff.export --checkpoint RUN_DIR_OR_CHECKPOINT --out DIR [--no-ema] [--endpoint URL]

DIR gets what `diffusers.DDPMPipeline.from_pretrained(DIR)` loads: model_index.json, unet/ (UNet2DModel config and
safetensors weights, the EMA unless --no-ema) and scheduler/ (DDPMScheduler config: the run's T, schedule,
prediction type, clipping and the posterior variance of raydiff's DDPM sampler), plus the run's config
(raydiff_config.yaml), where the weights came from (raydiff_export.json) and a README model card. A class-conditional
model's UNet has num_class_embeds = classes + 1 (the null class last); its class names are in raydiff_export.json
and the model card, whose example samples a class with guidance through diffusers' scheduler (DDPMPipeline itself
takes no labels). --checkpoint also
takes an s3:// or gs:// URI (--endpoint for an S3-compatible server); DIR is a local folder that must not exist or
be empty, and appears complete or not at all. Needs the diffusers extra: pip install "raydiff[diffusers]".
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from raydiff import cli
from raydiff.config import Config, ConfigError
from raydiff.runs.checkpoint import checkpoint_location
from raydiff.runs.ema_snapshots import weights_of
from raydiff.runs.state import read_newest
from raydiff.storage.rundir import unwritable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m raydiff.export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run directory (its newest checkpoint) or checkpoint folder; a path or s3:// / gs:// URI")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--out", required=True, type=Path, help="the pipeline folder to write (new or empty)")
    parser.add_argument("--no-ema", action="store_true", help="export the online weights instead of the EMA")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"raydiff: error: --out {args.out}: exists and is not an empty folder; choose a new one", file=sys.stderr)
        return 2
    reason = unwritable(out.parent)  # the pipeline is built beside DIR, then renamed into place
    if reason:
        print(f"raydiff: error: --out {args.out}: cannot write there ({reason})", file=sys.stderr)
        return 2
    location = checkpoint_location(args.checkpoint, args.endpoint)

    from raydiff.model import diffusers_folder, diffusers_io

    diffusers_io.require_diffusers("raydiff.export")
    checkpoint, state = read_newest(location)
    try:
        weights = weights_of(state, checkpoint, use_ema=not args.no_ema)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    diffusers_io.check_exportable(Config.from_dict(state["config"]))  # refused before anything is written

    # Build beside DIR and rename it into place: DIR is complete or absent.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        diffusers_folder.save_pipeline_folder(tmp, state, use_ema=not args.no_ema, checkpoint=str(checkpoint),
                                              guidance=Config.from_dict(state["config"]).eval.guidance)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    classes = diffusers_folder.recorded_classes(state, Config.from_dict(state["config"]))
    kind = f", {len(classes['names'])} classes plus the null class" if classes else ""
    print(f"[raydiff] exported {checkpoint} (step {state['step']}, {weights} weights{kind}) to {out}")
    if classes:
        print(f"[raydiff] load it with: DDPMPipeline.from_pretrained({str(out)!r}) and sample a class as "
              f"{out / 'README.md'} shows (DDPMPipeline's own __call__ takes no labels)")
    else:
        print(f"[raydiff] load it with: DDPMPipeline.from_pretrained({str(out)!r}); see {out / 'README.md'}")
    return 0


def _entry() -> None:
    sys.exit(cli.run(main))


if __name__ == "__main__":
    _entry()
