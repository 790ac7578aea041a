"""Write the built-in datasets to disk (see `raydiff.data.builtin`).

    python -m raydiff.datasets digits                       # prints the cached folder
    python -m raydiff.datasets synthetic OUT --num 500 --resolution 64 --format jpg
"""

from __future__ import annotations

from pathlib import Path

from raydiff import cli
from raydiff.config.checks import MAX_RESOLUTION, MIN_RESOLUTION
from raydiff.data.builtin import digits_folder, write_synthetic
from raydiff.data.shard_format import refuse_occupied
from raydiff.storage.atomic import new_folder
from raydiff.storage.errors import output_errors


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m raydiff.datasets",
                        description="Write the built-in datasets to disk.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("digits", help="write the digits into the cache (once) and print the folder")
    syn = sub.add_parser("synthetic", help="write synthetic RGB images into a folder")
    syn.add_argument("out")
    syn.add_argument("--num", type=int, default=256)
    syn.add_argument("--resolution", type=int, default=32)
    syn.add_argument("--format", choices=("png", "jpg"), default="png")
    syn.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "digits":
        print(digits_folder())
        return 0
    cli.refuse_empty(syn, "OUT", args.out, "a new or empty folder")
    args.out = Path(args.out)
    if args.num < 1:
        syn.error(f"--num {args.num}: must be >= 1")
    # The sizes a run trains at (data.resolution's bounds, as raydiff.prepare's): far larger, one image alone would
    # take all the memory there is.
    if not MIN_RESOLUTION <= args.resolution <= MAX_RESOLUTION:
        syn.error(f"--resolution {args.resolution}: must be between {MIN_RESOLUTION} and {MAX_RESOLUTION}")
    if args.seed < 0:  # numpy's generator takes any integer from 0 up
        syn.error(f"--seed {args.seed}: must be >= 0")
    refuse_occupied(str(args.out))  # a Path's text is a local path (a URI's "//" is gone): as raydiff.export
    out = args.out.resolve()  # built beside its full path: "." has no name to build beside
    with output_errors("OUT", args.out), new_folder(out) as folder:  # whole, or absent
        write_synthetic(folder, num=args.num, resolution=args.resolution, fmt=args.format, seed=args.seed)
    print(f"wrote {args.num} {args.format} images of {args.resolution}x{args.resolution} to {out}")
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
