"""Decode a source once into Parquet shards of uint8 images at the training resolution.

    python -m raydiff.prepare SOURCE OUT --resolution R [--channels C] [--format auto|images|parquet|webdataset]
        [--image-column NAME] [--labels none|auto] [--label-column NAME] [--endpoint URL] [--anonymous]
        [--max-bad-fraction F]

Ray Data decodes, converts, resizes and center-crops every image in parallel (the same code as training),
streaming: the decoded dataset never has to fit in memory.
OUT (a folder, or an s3:// / gs:// URI) receives Parquet shards and a manifest (their format:
`raydiff.data.shard_format`).
Training with `data.source=OUT` then skips decoding. A local OUT appears all at once, complete or not at all.
`--labels auto` also writes each sample's class, read as `data.labels: auto` reads it (`raydiff.data.labels`), for
class-conditional training on OUT; samples without a label are skipped and listed like undecodable ones.
"""

from __future__ import annotations

import argparse
import time

from raydiff import cli
from raydiff.config.checks import MAX_RESOLUTION, MIN_RESOLUTION
from raydiff.data.errors import DataError
from raydiff.data.labels import plan_labels
from raydiff.data.shard_format import MANIFEST, refuse_occupied, write_prepared
from raydiff.data.sources import open_source
from raydiff.storage.errors import output_errors
from raydiff.storage.rundir import unwritable
from raydiff.training.interrupts import interrupt_on_signals


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.prepare", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="folder, file, or s3:// / gs:// URI of images, Parquet or WebDataset shards")
    parser.add_argument("out", help="new folder (or s3:// / gs:// URI) for the prepared shards")
    parser.add_argument("--resolution", type=int, required=True, help="square training resolution R")
    parser.add_argument("--channels", type=int, choices=(1, 3), default=3, help="1 grayscale, 3 RGB (default 3)")
    parser.add_argument("--format", choices=("auto", "images", "parquet", "webdataset"), default="auto")
    parser.add_argument("--image-column", default="image",
                        help="Parquet column with the images (default image, or where there is none the one column "
                             "that the files' Hugging Face Image feature names)")
    parser.add_argument("--labels", choices=("none", "auto"), default="none",
                        help="auto: also write each sample's class (class subfolders, the Parquet label column, "
                             "WebDataset .cls, the digit of builtin:digits); default none")
    parser.add_argument("--label-column", default="label", help="Parquet column with the labels (default label)")
    parser.add_argument("--endpoint", default=None, help="s3:// or gs:// endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--anonymous", action="store_true", help="read a public bucket without credentials")
    parser.add_argument("--max-bad-fraction", type=float, default=0.1,
                        help="stop when more than this fraction cannot be decoded (default 0.1)")
    args = parser.parse_args(argv)
    cli.refuse_empty(parser, "OUT", args.out, "a new or empty folder, or an s3:// / gs:// URI")
    if not MIN_RESOLUTION <= args.resolution <= MAX_RESOLUTION:
        parser.error(f"--resolution {args.resolution}: must be between {MIN_RESOLUTION} and {MAX_RESOLUTION}")
    if not 0 <= args.max_bad_fraction <= 1:
        parser.error(f"--max-bad-fraction {args.max_bad_fraction}: must be in [0, 1]")
    for flag, column in (("--image-column", args.image_column), ("--label-column", args.label_column)):
        if not column:
            parser.error(f"{flag} '': must name a column")
    if args.endpoint is not None and "://" not in args.endpoint:  # as data.endpoint: read as a host otherwise
        parser.error(f"--endpoint {args.endpoint!r}: must be a URL such as http://127.0.0.1:9000")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    source = open_source(args.source, format=args.format, endpoint=args.endpoint, anonymous=args.anonymous)
    if source.kind == "prepared":
        raise DataError(f"SOURCE = {args.source!r} is already prepared data")
    labels = plan_labels(source, args.label_column) if args.labels == "auto" else None
    from raydiff.data.stream import estimated_count

    estimated_count(source)  # reads each Parquet footer: a file that is none is one line here, as in training
    reason = unwritable(args.out, endpoint=args.endpoint)
    if reason:
        raise DataError(f"OUT = {args.out!r}: cannot write there ({reason})")
    refuse_occupied(args.out, endpoint=args.endpoint)  # before Ray starts (seconds), and again as it writes
    from raydiff.cluster.start import init_ray
    from raydiff.data.image_store import decode_stream

    init_ray()
    # SIGTERM / Ctrl-C stop it, and OUT is left absent, not half-written; a full disk too, told in one line
    with interrupt_on_signals(), output_errors("OUT", args.out, passing=(DataError,)):  # a source's: told as it is
        decoded = decode_stream(source, resolution=args.resolution, channels=args.channels,
                                image_column=args.image_column, labels=labels)
        manifest = write_prepared(decoded, source, args.out, shape=(args.channels, args.resolution, args.resolution),
                                  max_bad_fraction=args.max_bad_fraction, endpoint=args.endpoint, labels=labels,
                                  max_bad_setting="--max-bad-fraction")
    skipped = f"; {len(manifest['bad'])} unusable sample(s) skipped (listed in {MANIFEST})" if manifest["bad"] else ""
    classes = f" in {len(manifest['classes'])} classes" if "classes" in manifest else ""
    print(f"[raydiff] prepared {manifest['count']} images{classes} at {args.resolution}px from {source.describe()} "
          f"in {time.perf_counter() - started:.1f} s: {len(manifest['shards'])} shard(s) in {args.out}{skipped}")
    conditional = " --set data.labels=auto --set model.num_classes=auto" if labels is not None else ""
    print(f"[raydiff] train on it: python -m raydiff.train --set data.source={args.out} "
          f"--set data.resolution={args.resolution} --set data.channels={args.channels}{conditional}")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
