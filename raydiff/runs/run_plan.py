"""What a train command means for an existing run directory: start, continue, already finished, or refused.

Re-running the same command continues the run from its newest checkpoint (Ray Train finds the run by
`run.name` and `run.storage`). Continuing is refused when a key that fixes what the checkpoint means has
changed (model shape, diffusion, data, global batch, seed): the result would be neither the old run nor a new
one; when the records it is checked against (config.yaml, data.json) or summary.json are damaged, rather
than the check being skipped; and when its newest checkpoint is past `train.total_steps` (it would train nothing and
end unfinished). `run.resume=false` moves the old run directory aside (nothing is deleted) and starts
over. The caller holds the run directory's lease (`raydiff.storage.lease`) while it decides and moves.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

from raydiff.config import Config, ConfigError, all_keys, sections_problem
from raydiff.config.learning_rate import lr_at
from raydiff.config.load import read_record
from raydiff.runs.checkpoint import checkpoint_step, list_checkpoints
from raydiff.storage.atomic import whole_lines
from raydiff.storage.rundir import RunDir

# Keys whose change makes a checkpoint mean something else; every other key may change between runs
# (learning rate, cadences, total_steps to extend a run, world size, precision, ...).
IDENTITY_SECTIONS = ("model", "diffusion")
IDENTITY_KEYS = ("data.source", "data.format", "data.image_column", "data.resolution", "data.channels", "data.flip",
                 "data.labels", "data.label_column", "data.val_images", "train.global_batch", "train.seed",
                 "train.ema", "train.ema_sigma_rels")  # the post-hoc profiles are tracked from step 0
POSTHOC_KEYS = ("train.ema_sigma_rels",)  # identity keys only where train.ema is posthoc: a classic run tracks none
# Keys of identity sections that a continuing run may change: model.init_from only initialises a new run.
NOT_IDENTITY_KEYS = ("model.init_from",)
LR_KEYS = ("lr", "warmup_steps", "total_steps", "lr_decay", "lr_decay_steps")  # what lr_at reads of train.*
DATA_FILE = "data.json"  # the data's identity (and, see `raydiff.data.stream`, its resolved layout)
DRIVER_FILE = "driver.json"  # the driver of the newest start, and the name its run reserves resources under

# What every refusal to continue a run offers instead.
WAYS_OUT = ("--set run.name=NEW for a new run, or --set run.resume=false to start this one over (the old run is moved "
            "aside, not deleted)")


def _flatten(tree: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, section in tree.items() for k, v in (section or {}).items()}


def _recorded(old: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded config, flat; a key missing from an older run's had its default then (keys are only ever
    added)."""
    return {**_flatten(Config().to_dict()), **_flatten(old)}


def identity_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    old_flat, new_flat = _recorded(old), _flatten(new)
    # The widths count where both runs are post-hoc (a run's config records them whatever train.ema is); where
    # train.ema changed, that is the change named.
    posthoc = old_flat.get("train.ema") == new_flat.get("train.ema") == "posthoc"
    keys = [k for k in new_flat if (k.split(".")[0] in IDENTITY_SECTIONS or k in IDENTITY_KEYS)
            and k not in NOT_IDENTITY_KEYS and (posthoc or k not in POSTHOC_KEYS)]
    return [f"{k} = {old_flat.get(k)!r}, now {new_flat[k]!r}" for k in keys if old_flat.get(k) != new_flat[k]]


def other_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    old_flat, new_flat = _flatten(old), _flatten(new)
    return [f"{k} {old_flat.get(k)!r} -> {v!r}" for k, v in new_flat.items()
            if k in old_flat and old_flat[k] != v and k != "run.resume"]


@dataclass(frozen=True)
class RunPlan:
    action: Literal["start", "continue", "finished"]
    step: int  # newest checkpoint's step (0 when starting)
    notes: tuple[str, ...] = ()
    replace: bool = False  # start over: the previous run is to be moved aside first (`move_aside`)
    layout: dict[str, Any] | None = None  # continuing: how the run's data was laid out (data.json), to keep


def plan_run(cfg: Config, run_dir: RunDir, data: dict[str, Any]) -> RunPlan:
    """Decide what to do with `run_dir`, reading only; raises ConfigError when continuing would be meaningless."""
    if run_dir.is_empty():
        return RunPlan("start", 0)
    if not cfg.run.resume:
        return RunPlan("start", 0, replace=True)

    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:  # nothing to continue: the records of an earlier start are not read, nor checked,
        summary = _read_record(cfg, run_dir, "summary.json") or {}
        if summary.get("status") == "finished" and summary.get("steps"):  # unless they are a finished run's
            raise ConfigError(
                f"run.name = {cfg.run.name!r}: {run_dir} holds a run that finished {summary['steps']} steps and "
                f"whose checkpoints are gone: starting over there would overwrite its records. Use {WAYS_OUT}")
        return RunPlan("start", 0)
    notes: list[str] = []
    previous = _read_record(cfg, run_dir, "config.yaml", sections=True)
    previous_data = _read_record(cfg, run_dir, DATA_FILE, keys=("fingerprint",))
    changes = identity_changes(previous, cfg.to_dict()) if previous else []
    if previous_data and previous_data["fingerprint"] != data["fingerprint"] and not changes:
        changes.append(f"the files of data.source ({previous_data.get('num_files')} files, now {data['num_files']}, "
                       f"or their names or sizes)")
    layout = (previous_data or {}).get("layout")
    if layout is not None and _layout_problem(layout):
        raise _damaged(cfg, run_dir, DATA_FILE, str(_layout_problem(layout)))
    if layout and not changes:
        changes += layout_changes(cfg.data, layout)
    if changes:
        raise ConfigError(
            f"run.name = {cfg.run.name!r}: {run_dir} holds a run trained with {'; '.join(changes)}; continuing it "
            f"would be meaningless. Use {WAYS_OUT}")

    step = checkpoint_step(checkpoints[-1])  # the folder's name: the run's records may be gone
    summary = _read_record(cfg, run_dir, "summary.json") or {}
    # Finished where the summary is of the newest checkpoint: a finished run trained longer and stopped keeps its
    # old summary until it ends again.
    finished = summary.get("status") == "finished" and summary.get("steps", step) == step
    if step >= cfg.train.total_steps and not finished:
        _refuse_ending_at_or_before(cfg, run_dir, step, previous)
    if previous:
        notes += [f"changed since the last start: {c}" for c in other_changes(previous, cfg.to_dict())]
        notes += lr_change(previous, cfg, step)
    if step >= cfg.train.total_steps and finished:
        return RunPlan("finished", step, tuple(notes), layout=layout)
    return RunPlan("continue", step, tuple(notes), layout=layout)


def _refuse_ending_at_or_before(cfg: Config, run_dir: RunDir, step: int, previous: dict[str, Any] | None) -> None:
    """The refusal of an unfinished run whose newest checkpoint (at `step`) is at or past train.total_steps, if it
    is one: past it, the workers would restore it and train nothing, and a run that ends past train.total_steps has
    not finished it (every re-run would fail, with no reason given); at it, where the checkpoint was cut short of
    its start's end, no step would be trained, so the end's work would never run, and the run would say it
    finished."""
    # A checkpoint before the end its start trained towards (a stop, a preemption, a scheduled one) holds no end of
    # run: no final validation, evaluation, samples or snapshot. The start that wrote it says (its event), or an
    # older run's last config.yaml; without the records it is taken as an end.
    planned = _planned_end(run_dir, step) or ((previous or {}).get("train") or {}).get("total_steps")
    cut_short = isinstance(planned, int) and planned > step
    if step > cfg.train.total_steps:
        asked = step + 1 if cut_short else step
        raise ConfigError(
            f"run.name = {cfg.run.name!r}: the newest checkpoint in {run_dir} is at step {step}, past "
            f"train.total_steps = {cfg.train.total_steps}. Use --set train.total_steps={asked} (or more) to continue "
            f"it, {WAYS_OUT}")
    if cut_short:
        raise ConfigError(
            f"run.name = {cfg.run.name!r}: the newest checkpoint in {run_dir} is at step {step}, before the end its "
            f"run trained towards ({planned}): ending it at train.total_steps = {step} would train nothing and "
            f"skip the end's validation, evaluation, samples and final checkpoint. Use --set "
            f"train.total_steps={step + 1} (or more) to continue it, {WAYS_OUT}")


def _planned_end(run_dir: RunDir, step: int) -> int | None:
    """The step that the start which wrote the checkpoint of `step` trained towards: the last start before that step,
    as its event records it; None where the events do not say (an older run's, or none left), for the last start's
    config.yaml to say. A line that is not JSON (a hand edit gone wrong) is passed over: this is only a hint."""
    if not run_dir.is_file("events.jsonl"):
        return None
    planned = None
    for line in whole_lines(run_dir.read_text("events.jsonl")):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "start" and isinstance(event.get("step"), int) \
                and event["step"] < step:
            planned = event.get("total_steps") if isinstance(event.get("total_steps"), int) else None
    return planned


def _read_record(cfg: Config, run_dir: RunDir, name: str, *, sections: bool = False,
                 keys: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """A file the run recorded beside its checkpoints (None where there is none), as the mapping raydiff wrote
    (`sections`: of config sections; `keys`: with these); a ConfigError naming it where it is cut short, empty
    or otherwise damaged, rather than the parser's traceback. An empty config.yaml would skip the check that
    the run continues with its own settings, so it is damaged too."""
    if not run_dir.is_file(name):
        return None
    value, problem = read_record(lambda: run_dir.read_text(name), "YAML" if name.endswith(".yaml") else "JSON")
    if problem is None:
        problem = _shape_problem(value, sections=sections, keys=keys)
        if problem is None and sections:
            value, problem = _read_as_config(value)
        if problem is None:
            return value
    raise _damaged(cfg, run_dir, name, problem)


def _read_as_config(tree: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A recorded config read as raydiff reads a YAML file (`lr: '1e-4'` is a number), each value in its key's type,
    with the first value its key does not admit (a hand edit gone wrong); keys removed since the run was recorded
    are kept as they are."""
    known = set(all_keys())
    try:
        plain = Config.from_dict({s: {k: v for k, v in (values or {}).items() if f"{s}.{k}" in known}
                                  for s, values in tree.items()}).to_dict()
    except ConfigError as error:
        return tree, str(error)
    return {s: {k: plain[s][k] if f"{s}.{k}" in known else v for k, v in (values or {}).items()}
            for s, values in tree.items()}, None


def _damaged(cfg: Config, run_dir: RunDir, name: str, problem: str) -> ConfigError:
    """The one line of a record of the run (`name`) that is not what raydiff wrote, with the ways out."""
    # summary.json is only read to know whether the run finished; the others hold what a continuing run is checked
    # against (without them the check is skipped, so removing them is no advice).
    fix = "remove it to continue the run (it is written again when the run ends)" if name == "summary.json" else \
        "fix it to continue the run"
    return ConfigError(f"run.name = {cfg.run.name!r}: {run_dir / name} is damaged: {problem}; {fix}, or use "
                       f"{WAYS_OUT}")


def _layout_problem(layout: Any) -> str | None:
    """What in data.json's `layout` is not what raydiff writes (a hand edit gone wrong), as far as a continuing run
    reads it; None where it is fine."""
    if not isinstance(layout, dict) or layout.get("cache") not in ("memory", "stream"):
        return f"its layout is {json.dumps(layout)}, not {{\"cache\": \"memory\"}} or a stream's"
    windows = layout.get("window_shards")
    if layout["cache"] == "stream" and not (isinstance(windows, int) and not isinstance(windows, bool)
                                             and windows >= 1):
        return f"its stream layout's window_shards is {json.dumps(windows)}, not a number of shards"
    return None


def _shape_problem(value: Any, *, sections: bool, keys: tuple[str, ...]) -> str | None:
    if value is None or value == {}:
        return "it holds nothing"
    if not isinstance(value, dict):
        return f"it holds a {type(value).__name__}, not a mapping of keys to values"
    if sections and sections_problem(value):
        return sections_problem(value)
    missing = [k for k in keys if k not in value]
    return f"no {', '.join(map(repr, missing))} in it" if missing else None


def lr_change(previous: dict[str, Any], cfg: Config, step: int) -> list[str]:
    """The learning rate a continuing run takes at `step`, where a changed key moves it ([] if none does): a
    cosine decay follows train.total_steps, so extending such a run raises it."""
    recorded = _recorded(previous)
    if recorded["train.lr"] is None:
        return []
    was = lr_at(step, replace(cfg.train, **{k: recorded[f"train.{k}"] for k in LR_KEYS}))
    now = lr_at(step, cfg.train)
    if math.isclose(was, now, rel_tol=1e-9):
        return []
    return [f"the learning rate continues at {now:.3g} ({was:.3g} before the change, at step {step})"]


def layout_changes(data, layout: dict[str, Any]) -> list[str]:
    """What in `data` contradicts the layout a run's data was trained in (data.json): the cache mode and, when
    streamed, the shuffle windows fix the sample order (and memory and stream number the samples differently
    when some cannot be decoded, so the held-out split would move). `auto` keeps what the run began with."""
    if data.cache not in ("auto", layout["cache"]):
        return [f"data.cache = {layout['cache']!r}, now {data.cache!r} (data.json; the sample order would change)"]
    if layout["cache"] == "stream" and data.stream_window_shards < layout["window_shards"]:
        return [f"shuffle windows of {layout['window_shards']} shards, now data.stream_window_shards = "
                f"{data.stream_window_shards} (data.json; the sample order would change)"]
    return []


def move_aside(run_dir: RunDir) -> str:
    """Move a run directory aside (run.resume=false; nothing is deleted); returns a note saying where. The name is
    a new one (a second move within the same second, once merged into the first on an object store)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved, n = run_dir.parent / f"{run_dir.name}.replaced-{stamp}", 1
    while moved.exists():
        n += 1
        moved = run_dir.parent / f"{run_dir.name}.replaced-{stamp}-{n}"
    run_dir.move_to(moved)
    return f"run.resume=false: moved the previous run to {moved}"
