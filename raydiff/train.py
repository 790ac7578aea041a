"""Train a DDPM with Ray Train.

    python -m raydiff.train [--config NAME_OR_PATH] [--set key=value ...] [--dry-run]

With no arguments: the `default` preset, DDPM on scikit-learn's handwritten digits (the README's quick start).
Results go to <run.storage>/<run.name>/: config.yaml, metrics.jsonl, samples/, checkpoints, summary.json.
"""

from __future__ import annotations

import argparse
import signal
import sys

import yaml

from raydiff import cli
from raydiff.config import load_config, preset_names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.train", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default",
                        help=f"preset name ({', '.join(preset_names())}) or path to a YAML file (default: default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.lr=1e-4 (repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the config as loaded (most auto values kept) and the model's parameter count, then "
                             "exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set, check_source=not args.dry_run)

    if args.dry_run:
        from raydiff.model.unet import build_model, count_parameters

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        if cfg.model.num_classes == "auto":  # the classes are counted when the run reads its data
            unconditional = count_parameters(build_model(cfg.replaced("model", num_classes=0)))
            embedding = build_model(cfg.replaced("model", num_classes=1)).class_embed
            assert embedding is not None  # a class-conditional UNet has one
            print(f"# model parameters: {unconditional:,}, and {embedding.embedding_dim:,} more per class "
                  "(model.num_classes = auto: one embedding row for each class the data has, and one for the null "
                  "class)")
        else:
            print(f"# model parameters: {count_parameters(build_model(cfg)):,}")
        if not cfg.data.source:
            print("# note: data.source is not set; training needs --set data.source=PATH")
        return 0

    from raydiff.training.driver import run_training

    summary = run_training(cfg)
    run_dir = summary["run_dir"]
    if summary.get("already_finished"):
        print(f"[raydiff] run {cfg.run.name!r} is already finished ({summary['steps']} steps): results in {run_dir}")
        print("[raydiff] to train it longer raise train.total_steps; for a new run set run.name")
        return 0
    if summary["status"] == "stopped":
        print(f"[raydiff] stopped at step {summary['steps']} ({summary.get('signal') or 'stop request'}) after a final "
              f"checkpoint: {summary['checkpoint']}", file=sys.stderr)
        print("[raydiff] re-run the same command to continue from it", file=sys.stderr)
        return 128 + signal.Signals[summary["signal"]].value if summary.get("signal") else 1
    if summary["status"] != "finished":
        print(f"[raydiff] run {summary['status']} at step {summary['steps']}: {summary.get('error', 'unknown error')}",
              file=sys.stderr)
        if summary["status"] == "failed":
            print(f"[raydiff] re-run the same command to continue from the newest checkpoint in {run_dir}",
                  file=sys.stderr)
        return 1
    resumed = f", continued from step {summary['resumed_from_step']}" if summary["resumed_from_step"] else ""
    restarts = f", {summary['restarts']} restart(s)" if summary["restarts"] else ""
    loss = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"  # None: no step of it trained
    print(f"[raydiff] finished: {summary['steps']} steps, {summary['images_seen']:,} images, final loss {loss}, "
          f"{summary['wall_s']:.0f} s{resumed}{restarts}")
    if summary.get("quality"):
        from raydiff.quality.measure import result_line

        e = cfg.eval
        settings = {"step": summary["steps"], "num": e.num, "sampler": e.sampler, "steps": e.steps, "seed": e.seed}
        if cfg.model.num_classes:
            settings["guidance"] = e.guidance
        print(f"[raydiff] quality:    {result_line({**summary['quality'], **settings})}")
    print(f"[raydiff] results:    {run_dir}")
    print(f"[raydiff] samples:    {run_dir}/samples/")
    print(f"[raydiff] checkpoint: {summary['checkpoint']}")
    print(f"[raydiff] more samples: python -m raydiff.sample --checkpoint {run_dir} --num 64 --out samples.png")
    return 0


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
