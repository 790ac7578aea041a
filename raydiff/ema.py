"""Rebuild a run's EMA at any width after training, from its post-hoc EMA snapshots (EDM2's post-hoc EMA).

    python -m raydiff.ema --checkpoint RUN --sigma-rel S[,S...] --out DIR [--step N] [--endpoint URL]

RUN is a run trained with `train.ema: posthoc` (a path or s3:// / gs:// URI). For each relative width S (the
average's standard deviation over its length; the run tracked `train.ema_sigma_rels`, EDM2's 0.05 and 0.10), the
average at snapshot step N (default: the newest) is the least-squares combination of the run's snapshots up to N,
computed in float64, and written as DIR/sigma_rel-S/state.pt (S to 3 decimals: widths that agree to 3 decimals
are refused before anything is written): a checkpoint folder that `raydiff.sample`, `raydiff.evaluate` and
`raydiff.export` take as --checkpoint (its EMA weights are the rebuilt average; it holds no online weights). DIR
is a local folder; each folder appears complete or not at all. To choose S by measured quality,
`raydiff.evaluate --checkpoint RUN --sigma-rel S[,S...]` measures each without writing weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raydiff import cli
from raydiff.config.checks import parse_sigma_rels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.ema", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the run directory (a path or s3:// / gs:// URI)")
    parser.add_argument("--sigma-rel", required=True, help="comma-separated widths, each in [0.0001, 0.28)")
    parser.add_argument("--out", required=True, help="local folder for one checkpoint folder per width")
    parser.add_argument("--step", type=int, default=None, help="a snapshot's step (default: the newest)")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    args = parser.parse_args(argv)
    cli.refuse_empty(parser, "--checkpoint", args.checkpoint, "a run directory or checkpoint")
    cli.refuse_empty(parser, "--out", args.out, "a local folder")
    cli.refuse_remote(parser, "--out", args.out)
    args.out = Path(args.out)
    return args


def folder_name(sigma_rel: float) -> str:
    """3 decimals (sigma_rel-0.070), or 3 significant digits below 0.001 (which 3 decimals would all write as
    sigma_rel-0.000)."""
    return f"sigma_rel-{sigma_rel:.3f}" if sigma_rel >= 0.001 else f"sigma_rel-{sigma_rel:.3g}"


def shared_folder(sigma_rels: list[float]) -> str | None:
    """What is wrong where two widths would be written to one folder (they agree to 3 decimals: the second would
    fail once the first was written); None where each has its own."""
    first: dict[str, float] = {}
    for s in sigma_rels:
        name = folder_name(s)
        if name in first:
            return (f"{first[name]:g} and {s:g} would both be written to {name}; give widths that differ in their "
                    f"first 3 decimals (3 significant digits below 0.001)")
        first[name] = s
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sigma_rels = parse_sigma_rels(args.sigma_rel)
    from raydiff.config import ConfigError
    from raydiff.runs.checkpoint import checkpoint_location, write_state
    from raydiff.runs.ema_snapshots import NoSuchSnapshot, rebuild
    from raydiff.storage.atomic import new_folder
    from raydiff.storage.errors import output_errors
    from raydiff.storage.rundir import unwritable

    shared = shared_folder(sigma_rels)
    if shared:
        raise ConfigError(f"--sigma-rel = {args.sigma_rel!r}: {shared}")
    out = args.out.expanduser().resolve()
    taken = [folder_name(s) for s in sigma_rels if (out / folder_name(s)).exists()]
    if taken:
        print(f"raydiff: error: --out {args.out}: {', '.join(taken)} exists already; choose another --out",
              file=sys.stderr)
        return 2
    reason = unwritable(out)
    if reason:
        print(f"raydiff: error: --out {args.out}: cannot write there ({reason})", file=sys.stderr)
        return 2
    run = checkpoint_location(args.checkpoint, args.endpoint, runs_only=True)
    try:
        rebuilt = rebuild(run, sigma_rels, args.step, where=f"--checkpoint {args.checkpoint}")
    except NoSuchSnapshot as exc:
        raise ConfigError(f"--step {args.step}: {exc}") from None
    except ValueError as exc:  # a damaged snapshot, or snapshots of different widths: the line names them
        raise ConfigError(str(exc)) from None
    for average in rebuilt:
        folder = out / folder_name(average.sigma_rel)
        with output_errors("--out", args.out), new_folder(folder) as tmp:  # a checkpoint folder once it is there
            write_state(tmp, average.state)
        snapshots = average.state['posthoc']['snapshots']
        print(f"[raydiff] sigma_rel {average.sigma_rel:g} at step {average.state['step']} (from {snapshots} "
              f"snapshot{'' if snapshots == 1 else 's'}) -> {folder}")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
