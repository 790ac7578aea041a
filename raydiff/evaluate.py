"""Measure the quality of a trained run's samples: FID and KID (or, for the built-in digits, the Frechet distance
of a digits classifier's features and the class coverage).

    python -m raydiff.evaluate --checkpoint RUN_OR_CHECKPOINT [--num N] [--sampler ddim|ddpm] [--steps S]
        [--metrics fid,kid] [--ref REF] [--seed S] [--features auto|inception|digits] [--weights PATH]
        [--workers N] [--endpoint URL]

Images are generated from the EMA weights in fp32 and measured in parallel on Ray tasks (one per GPU, else one
per CPU); image i is a pure function of (seed, i), so the result does not depend on the number of workers. The
result is printed as one line and written to <run>/eval/<step>-<sampler>-<steps>-<num>.json (never over
another evaluation) and as a row of <run>/eval.jsonl. Defaults come from the run's `eval` section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from raydiff import cli
from raydiff.config import Config, ConfigError, set_key
from raydiff.config.checks import validate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m raydiff.evaluate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run directory (its newest checkpoint) or checkpoint "
                                                            "folder; a path or s3:// / gs:// URI")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--num", type=int, help="images to generate (the run's eval.num; FID papers use 50000)")
    parser.add_argument("--sampler", choices=("ddim", "ddpm"), help="the run's eval.sampler")
    parser.add_argument("--steps", type=int, help="sampling steps (the run's eval.steps)")
    parser.add_argument("--metrics", help="comma-separated: fid, kid (the run's eval.metrics)")
    parser.add_argument("--ref", help="reference: an .npz with mu/sigma, or an image folder (default: the run's "
                                      "data.source at its resolution, cached)")
    parser.add_argument("--seed", type=int, help="image i is a pure function of (seed, i) (the run's eval.seed)")
    parser.add_argument("--features", choices=("auto", "inception", "digits"), help="the run's eval.features")
    parser.add_argument("--weights", help="a local copy of the Inception-v3 weights (eval.inception_weights)")
    parser.add_argument("--workers", type=int, default=None, help="Ray tasks (default: every GPU, else every CPU)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers {args.workers}: must be >= 1")
    return args


def eval_config(state: dict[str, Any], args: argparse.Namespace, storage: str) -> Config:
    """The run's config with the command line's `eval` overrides; the reference cache beside the run."""
    cfg = Config.from_dict(state["config"])
    overrides = {"num": args.num, "sampler": args.sampler, "steps": args.steps, "metrics": args.metrics,
                 "ref": args.ref, "seed": args.seed, "features": args.features, "inception_weights": args.weights}
    for key, value in overrides.items():
        if value is not None:
            set_key(cfg, f"eval.{key}", value)
    cfg.run.storage, cfg.run.endpoint = storage, args.endpoint
    try:
        validate(cfg, check_source=False)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("eval.", "--", 1) if str(exc).startswith("eval.") else str(exc)) from None
    return cfg


def evaluate(state: dict[str, Any], cfg: Config, *, features=None, workers: int | None = None) -> dict[str, Any]:
    """Generate `cfg.eval.num` images from a training state's EMA weights and score them against the reference.
    `features`: a feature extractor (`raydiff.quality.features`); default: what `eval.features` names."""
    import torch

    from raydiff.cluster.start import init_ray
    from raydiff.model.diffusion import build_diffusion, images_per_pass
    from raydiff.model.unet import build_model
    from raydiff.quality.features import features_for
    from raydiff.quality.measure import SampleJob, parallel_stats, scores
    from raydiff.quality.reference import reference_for

    e, d = cfg.eval, cfg.data
    features = features or features_for(e.features, d.source, e.inception_weights)
    keep = "kid" in e.metrics
    init_ray()
    started = time.perf_counter()
    reference = reference_for(cfg, features, keep_features=keep)
    if keep:
        reference.features_for_kid()  # refuse before generating anything
    reference_s = time.perf_counter() - started
    model = build_model(cfg)
    model.load_state_dict(state["ema"])
    job = SampleJob(model=model.float(), diffusion=build_diffusion(cfg), shape=(d.channels, d.resolution, d.resolution),
                    sampler=e.sampler, steps=e.steps, seed=e.seed, batch=images_per_pass(d.resolution))
    with torch.inference_mode():
        samples = parallel_stats("sample", job, features, e.num, workers=workers, keep_features=keep)
    result = scores(samples, reference, features, e.metrics, seed=e.seed)
    return {"step": state["step"], **result, "num": e.num, "sampler": e.sampler, "steps": e.steps, "seed": e.seed,
            "features": features.name, "reference": reference.description, "reference_images": reference.count,
            "reference_s": round(reference_s, 1), "eval_s": round(time.perf_counter() - started, 1)}


def write_result(run_dir, result: dict[str, Any]) -> str:
    """eval/<step>-<sampler>-<steps>-<num>[-k].json (a new name if taken) and a row of eval.jsonl."""
    from raydiff.runs.runlog import JsonlLog

    stem = f"eval/{result['step']}-{result['sampler']}-{result['steps']}-{result['num']}"
    name, k = f"{stem}.json", 2
    while run_dir.is_file(name):
        name, k = f"{stem}-{k}.json", k + 1
    run_dir.write_text(name, json.dumps(result, indent=2) + "\n")
    JsonlLog(run_dir, "eval.jsonl").append({**result, "file": name})
    return name


def describe(result: dict[str, Any]) -> str:
    numbers = ", ".join(f"{k} {v:.4g}" for k, v in result.items()
                        if k.endswith(("fd", "fid", "kid", "coverage", "confident")) and isinstance(v, float))
    return (f"step {result['step']}, {result['num']} images ({result['sampler']}, {result['steps']} steps, seed "
            f"{result['seed']}): {numbers}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from raydiff.quality.features import require_metrics_package
    from raydiff.runs.checkpoint import STATE_FILE, checkpoint_location

    require_metrics_package("raydiff.evaluate")
    from raydiff.runs.rundir import unwritable
    from raydiff.runs.state import read_newest

    location = checkpoint_location(args.checkpoint, args.endpoint)
    run_dir = location.parent if location.is_file(STATE_FILE) else location
    reason = unwritable(run_dir)  # the result goes there: know before sampling
    if reason:
        print(f"raydiff: error: --checkpoint {args.checkpoint}: cannot write the result into {run_dir} ({reason})",
              file=sys.stderr)
        return 2
    checkpoint, state = read_newest(location)
    cfg = eval_config(state, args, storage=str(run_dir.parent))
    print(f"[raydiff] evaluating {checkpoint} (step {state['step']}): {cfg.eval.num} images, {cfg.eval.sampler} "
          f"{cfg.eval.steps} steps, metrics {','.join(cfg.eval.metrics)}", file=sys.stderr)
    result = evaluate(state, cfg, workers=args.workers)
    name = write_result(run_dir, result)
    print(f"[raydiff] {describe(result)} in {result['eval_s']:.0f} s -> {run_dir / name}")
    return 0


def _entry() -> None:
    sys.exit(cli.run(main))


if __name__ == "__main__":
    _entry()
