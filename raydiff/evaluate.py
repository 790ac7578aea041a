"""Measure the quality of a trained run's samples: FID and KID (or, for the built-in digits, the Frechet distance
of a digits classifier's features and the class coverage).

    python -m raydiff.evaluate --checkpoint RUN_OR_CHECKPOINT [--num N]
        [--sampler ddim|ddpm|dpmpp_2m|dpmpp_2m_sde|heun] [--steps S] [--metrics fid,kid] [--ref REF] [--seed S]
        [--features auto|inception|digits] [--weights PATH]
        [--guidance W[,W...]] [--guide GUIDE] [--sigma-rel S[,S...]] [--workers N] [--endpoint URL]

Images are generated from the EMA weights in fp32 and measured in parallel on Ray tasks (one per free GPU, else one
per free CPU); image i is a pure function of (seed, i), so the result does not depend on the number of workers. The
result is printed as one line and written to <run>/eval/<step>-<sampler>-<steps>-<num>.json (never over
another evaluation) and as a row of <run>/eval.jsonl. Defaults come from the run's `eval` section.

A class-conditional model's images are asked for classes drawn in the training data's class frequencies (image
i's class too is a pure function of (seed, i)) and measured once per classifier-free guidance W (default: the
run's eval.guidance), against the same reference: one line and one eval.jsonl row per W, and one result file
with them all. On the built-in digits, `digits_class_match` is the share of images the digits classifier reads as
the class they were asked for.

A run trained with `train.ema: posthoc` can be measured at several EMA widths without writing any weights:
`--sigma-rel S[,S...]` rebuilds each average from the run's snapshots (as `raydiff.ema` does) and gives one
result per width, then, for more than one, the best.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from typing import Any

from raydiff import cli
from raydiff.config import Config, ConfigError, set_key
from raydiff.config.checks import check_source_uri, parse_numbers, parse_sigma_rels, validate
from raydiff.config.schema import SAMPLERS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.evaluate", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run directory (its newest checkpoint) or checkpoint "
                                                            "folder; a path or s3:// / gs:// URI")
    parser.add_argument("--endpoint", default=None, help="S3/GCS endpoint URL (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--num", type=int, help="images to generate (the run's eval.num; FID papers use 50000)")
    parser.add_argument("--sampler", choices=SAMPLERS, help="the run's eval.sampler")
    parser.add_argument("--steps", type=int, help="sampling steps (the run's eval.steps)")
    parser.add_argument("--metrics", help="comma-separated: fid, kid (the run's eval.metrics)")
    parser.add_argument("--ref", help="reference: an .npz with mu/sigma, or an image folder (default: the run's "
                                      "data.source at its resolution, cached)")
    parser.add_argument("--seed", type=int, help="image i is a pure function of (seed, i) (the run's eval.seed)")
    parser.add_argument("--features", choices=("auto", "inception", "digits"), help="the run's eval.features")
    parser.add_argument("--weights", help="a local copy of the Inception-v3 weights (eval.inception_weights)")
    parser.add_argument("--guidance", help="class-conditional models: classifier-free guidance, one result per "
                                           "comma-separated W (1 = conditional, 0 = unconditional; the run's "
                                           "eval.guidance); with --guide, autoguidance weights (1 = the model "
                                           "alone; default 2)")
    parser.add_argument("--guide", default=None, help="autoguidance: a weaker model of the same data (an earlier "
                                                     "checkpoint of the run, or a smaller or shorter-trained run)")
    parser.add_argument("--sigma-rel", default=None, help="a run trained with train.ema=posthoc: one result per "
                                                          "comma-separated width of the EMA rebuilt from its "
                                                          "snapshots (raydiff.ema), and the best of them")
    parser.add_argument("--workers", type=int, default=None,
                        help="Ray tasks (default: every free GPU, else every free CPU)")
    args = parser.parse_args(argv)
    cli.refuse_empty(parser, "--checkpoint", args.checkpoint, "a run directory or checkpoint")
    if args.guide is not None:
        cli.refuse_empty(parser, "--guide", args.guide, "a run directory or checkpoint")
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers {args.workers}: must be >= 1")
    return args


def parse_guidance(text: str) -> tuple[float, ...]:
    """--guidance W[,W...]: different numbers >= 0 (each is a whole evaluation), in the order given."""
    return tuple(parse_numbers("--guidance", text, ok=lambda w: w >= 0, different=True,
                               allowed="must be comma-separated different numbers >= 0 (1 = conditional without "
                               "guidance, 0 = unconditional)"))


def model_classes(state: dict[str, Any]) -> dict[str, list] | None:
    """A class-conditional checkpoint's classes ({"names": [...], "counts": [...]}); None: unconditional."""
    classes = state.get("classes")
    return classes if classes and int(state["config"].get("model", {}).get("num_classes") or 0) > 0 else None


def eval_config(state: dict[str, Any], args: argparse.Namespace, storage: str,
                guidance: tuple[float, ...] | None = None) -> Config:
    """The run's config with the command line's `eval` overrides; the reference cache beside the run. Checked with
    each classifier-free `guidance` the evaluation will use (default: the run's own)."""
    cfg = Config.from_dict(state["config"])
    # Blank texts meant none in the runs of before 2026-12-07 (refused in configs since): read them so.
    cfg.eval.ref = cfg.eval.ref if cfg.eval.ref and cfg.eval.ref.strip() else None
    cfg.log.wandb_project = cfg.log.wandb_project if cfg.log.wandb_project and cfg.log.wandb_project.strip() else None
    overrides = {"num": args.num, "sampler": args.sampler, "steps": args.steps, "metrics": args.metrics,
                 "ref": args.ref, "seed": args.seed, "features": args.features, "inception_weights": args.weights}
    cfg.run.storage, cfg.run.endpoint = storage, args.endpoint
    try:
        for key, value in overrides.items():
            if value is not None:
                set_key(cfg, f"eval.{key}", value)
        if args.ref is not None:  # the run's data.source need not be here (not checked); a reference given must
            check_source_uri(args.ref, "eval.ref")
        for w in guidance or (cfg.eval.guidance,):
            validate(cfg.replaced("eval", guidance=w), check_source=False)
    except ConfigError as exc:  # told by the flag the user gave: eval.num is --num, eval.inception_weights --weights
        message = str(exc).replace("eval.inception_weights", "eval.weights", 1)
        raise ConfigError(message.replace("eval.", "--", 1) if message.startswith("eval.") else message) from None
    return cfg


def evaluate(state: dict[str, Any], cfg: Config, *, features=None, workers: int | None = None,
             guidance: tuple[float, ...] | None = None, guide: dict[str, Any] | None = None,
             ref_named: str = "eval.ref") -> dict[str, Any]:
    """Generate `cfg.eval.num` images from a training state's EMA weights and score them against the reference.
    `features`: a feature extractor (`raydiff.quality.features`); default: what `eval.features` names.
    A class-conditional state is measured once per `guidance` value (default: `eval.guidance`): the result then
    holds `classes` and `results`, one metrics row per value (see `rows`). With `guide` (a guiding model's training
    state), each value of `guidance` is an autoguidance weight instead (default 2), for any model. `ref_named`: the
    setting the reference's errors name it by (`--ref` where the command's flag gave it)."""
    import torch

    from raydiff.cluster.start import init_ray
    from raydiff.model.diffusion import build_diffusion, images_per_pass
    from raydiff.model.guidance import AUTOGUIDANCE, AutoGuided
    from raydiff.model.unet import build_model
    from raydiff.quality.features import features_for
    from raydiff.quality.measure import SampleJob, class_targets, parallel_stats, scores
    from raydiff.quality.reference_stats import reference_for

    e, d = cfg.eval, cfg.data
    features = features or features_for(e.features, d.source, e.inception_weights)
    keep = "kid" in e.metrics
    init_ray()
    started = time.perf_counter()
    reference = reference_for(cfg, features, keep_features=keep, named=ref_named)
    if keep:
        reference.features_for_kid()  # refuse before generating anything
    reference_s = time.perf_counter() - started
    model = build_model(cfg)
    model.load_state_dict(state["ema"])
    classes = model_classes(state)
    job = SampleJob(model=model.float(), diffusion=build_diffusion(cfg), shape=(d.channels, d.resolution, d.resolution),
                    sampler=e.sampler, steps=e.steps, seed=e.seed, batch=images_per_pass(d.resolution))
    if classes is not None:
        job.class_counts = tuple(int(c) for c in classes["counts"])
        job.class_targets = class_targets(features, classes["names"], job.class_counts)
    results = []
    values: tuple[float | None, ...] = (guidance or (e.guidance,)) if classes is not None else (None,)
    guide_model = None
    if guide is not None:
        values = guidance or (AUTOGUIDANCE,)
        guide_model = build_model(Config.from_dict(guide["config"]))
        guide_model.load_state_dict(guide["ema"])
    for w in values:  # None: an unconditional model
        job.guidance, w_started = 1.0 if w is None else w, time.perf_counter()
        if guide_model is not None:  # autoguidance, the model conditioned on the classes asked (no CFG)
            # A weight of 0 is the guide alone, as raydiff.sample takes it (not the model alone: `w or 1.0` was).
            weight = 1.0 if w is None else float(w)
            job.model, job.guidance = AutoGuided(model.float(), guide_model.float(), weight), 1.0
        with torch.inference_mode():
            samples = parallel_stats("sample", job, features, e.num, host_memory=cfg.train.keep_host_memory,
                                     workers=workers, keep_features=keep)
        metrics = scores(samples, reference, features, e.metrics, seed=e.seed)
        results.append(metrics if w is None else {"guidance": w, **metrics,
                                                  "eval_s": round(time.perf_counter() - w_started, 1)})
    common = {"num": e.num, "sampler": e.sampler, "steps": e.steps, "seed": e.seed, "features": features.name,
              "reference": reference.description, "reference_images": reference.count,
              "reference_s": round(reference_s, 1), "eval_s": round(time.perf_counter() - started, 1)}
    if guide is not None:
        common["guide_step"] = guide["step"]
    if classes is None and guide is None:
        return {"step": state["step"], **results[0], **common}
    return {"step": state["step"], **common, **({"classes": list(classes["names"])} if classes else {}),
            "results": results}


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat metrics row per guidance value of a result (the result itself for an unconditional model)."""
    if "results" not in result:
        return [result]
    common = {k: v for k, v in result.items() if k not in ("results", "classes")}
    return [{**common, **row} for row in result["results"]]


def write_result(run_dir, result: dict[str, Any]) -> str:
    """eval/<step>-<sampler>-<steps>-<num>[-k].json (a new name if taken) and a row of eval.jsonl (one per
    guidance value)."""
    from raydiff.runs.runlog import JsonlLog, json_safe

    stem = f"eval/{result['step']}-{result['sampler']}-{result['steps']}-{result['num']}"
    name, k = f"{stem}.json", 2
    while run_dir.is_file(name):
        name, k = f"{stem}-{k}.json", k + 1
    run_dir.write_text(name, json.dumps(json_safe(result), indent=2) + "\n")
    try:
        JsonlLog(run_dir, "eval.jsonl").extend([{**row, "file": name} for row in rows(result)])  # all or none
    except BaseException:
        with contextlib.suppress(OSError):  # its rows are not in eval.jsonl: nor is it (a re-run writes both)
            run_dir.remove(name)
        raise
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guidance = parse_guidance(args.guidance) if args.guidance is not None else None
    sigma_rels = parse_sigma_rels(args.sigma_rel) if args.sigma_rel is not None else None
    from raydiff.model.guidance import AUTOGUIDANCE
    from raydiff.quality.features import require_metrics_package
    from raydiff.quality.measure import result_line
    from raydiff.runs.checkpoint import STATE_FILE, checkpoint_location

    require_metrics_package("raydiff.evaluate")
    from raydiff.runs.state import read_guide, read_newest
    from raydiff.storage.errors import StorageFailure, permanent_reason
    from raydiff.storage.rundir import unwritable

    location = checkpoint_location(args.checkpoint, args.endpoint)
    run_dir = location.parent if location.is_file(STATE_FILE) else location
    reason = unwritable(run_dir)  # the result goes there: know before sampling
    if reason:
        print(f"raydiff: error: --checkpoint {args.checkpoint}: cannot write the result into {run_dir} ({reason})",
              file=sys.stderr)
        return 2
    checkpoint, state = read_newest(location, where=f"--checkpoint {args.checkpoint}")
    states = [state] if sigma_rels is None else posthoc_states(run_dir, state, sigma_rels,
                                                                 f"--checkpoint {args.checkpoint}")
    guide = None
    if args.guide is not None:
        guide_at, guide = read_guide(args.guide, args.endpoint, state)
    classes = model_classes(state)
    if guidance is not None and classes is None and guide is None:
        raise ConfigError(f"--guidance = {args.guidance!r}: {checkpoint} holds an unconditional model; guidance "
                          f"applies to class-conditional models only (trained with model.num_classes > 0), or "
                          f"with --guide")
    # Autoguidance conditions the model on the classes asked for: no classifier-free guidance.
    cfg = eval_config(state, args, storage=str(run_dir.parent), guidance=(1.0,) if guide is not None else guidance)
    guided = f", guidance {','.join(f'{w:g}' for w in guidance or (cfg.eval.guidance,))}" if classes else ""
    if guide is not None:
        guided = (f", autoguidance {','.join(f'{w:g}' for w in guidance or (AUTOGUIDANCE,))} by {guide_at} (step "
                  f"{guide['step']})")
    print(f"[raydiff] evaluating {checkpoint} (step {state['step']}): {cfg.eval.num} images, {cfg.eval.sampler} "
          f"{cfg.eval.steps} steps, metrics {','.join(cfg.eval.metrics)}{guided}"
          + (f", post-hoc EMA sigma_rel {args.sigma_rel}" if sigma_rels else ""), file=sys.stderr)
    measured = []
    for weights in states:
        result = evaluate(weights, cfg, workers=args.workers, guidance=guidance, guide=guide,
                          ref_named="--ref" if args.ref is not None else "eval.ref")
        if "posthoc" in weights:
            result = {"sigma_rel": weights["posthoc"]["sigma_rel"], **result}
        try:
            name = write_result(run_dir, result)
        except OSError as exc:  # a full disk: the minutes of sampling are not lost with the file
            reason = permanent_reason(exc)
            if reason is None:
                raise
            measured_lines = "; ".join(result_line(row) for row in rows(result))
            raise StorageFailure(f"--checkpoint {args.checkpoint}: writing the result into {run_dir} failed: "
                                 f"{reason}; nothing half-written was left there. The result, not saved: "
                                 f"{measured_lines}") from None
        for row in rows(result):
            print(f"[raydiff] {result_line(row)} in {row['eval_s']:.0f} s -> {run_dir / name}")
            measured.append(row)
    if sigma_rels is not None and len(measured) > 1:
        print(f"[raydiff] best: {best_line(measured)}")
    return 0


def posthoc_states(run_dir, state: dict[str, Any], sigma_rels: list[float],
                   where: str) -> list[dict[str, Any]]:
    """The averages of widths `sigma_rels` rebuilt from the run's snapshots at the checkpoint's step (or the
    newest snapshot before it), as training states to evaluate (`where`: the flag that named the run)."""
    from raydiff.runs.ema_snapshots import list_snapshots, rebuild

    snapshots = list_snapshots(run_dir, where=where)
    steps = [s for s in snapshots if s <= state["step"]]
    if not steps:
        tracked = state["config"].get("train", {}).get("ema") == "posthoc"
        how = ("its first is written at train.ema_snapshot_every steps" if tracked else
               "train it with --set train.ema=posthoc to record them")
        raise ConfigError(f"--sigma-rel: {run_dir} has no post-hoc EMA snapshots at or before step {state['step']} "
                          f"({how})")
    if steps[-1] != state["step"]:
        print(f"[raydiff] note: the newest snapshot at or before step {state['step']} is step {steps[-1]}; "
              f"rebuilding there", file=sys.stderr)
    try:
        rebuilt = rebuild(run_dir, sigma_rels, steps[-1], steps=snapshots, where=where)
    except ValueError as exc:  # a damaged snapshot, or snapshots of different widths: the line names them
        raise ConfigError(str(exc)) from None
    return [average.state for average in rebuilt]


def best_line(measured: list[dict[str, Any]]) -> str:
    """The row with the lowest Frechet distance (fid, digits_fd, features_fd; the KID where only it was measured),
    in one line; a NaN (non-finite samples) is never the lowest."""
    names = list(measured[0])
    key = next((k for k in names if k == "fid" or k.endswith("_fd")), None) or next(
        k for k in names if k == "kid" or k.endswith("_kid"))
    finite = [row for row in measured if isinstance(row[key], (int, float)) and math.isfinite(row[key])]
    best = min(finite, key=lambda row: row[key]) if finite else measured[0]
    where = ", ".join(f"{k} {best[k]:g}" for k in ("sigma_rel", "guidance") if best.get(k) is not None)
    return f"{where}: {key} {best[key]:.4g}"


def _entry() -> None:
    cli.exit_with(main)


if __name__ == "__main__":
    _entry()
