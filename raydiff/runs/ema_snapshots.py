"""The post-hoc EMA's snapshots in a run directory, and the averages rebuilt from them.

Why a module: training writes the snapshots (`raydiff.training.cadence`), and `raydiff.ema`, `raydiff.evaluate`
and the tests read them; the file layout, what a snapshot holds and how a rebuilt average becomes a training
state that `raydiff.sample`, `raydiff.evaluate` and `raydiff.export` take live here once.

A snapshot is `ema_snapshots/step_<step>.pt` (torch.save, read with `weights_only=True`): every tracked average
at that step, with the run's config (and classes). Snapshots are written whole and atomically by rank 0's
background writer; a run that resumes replays the steps after its checkpoint bit for bit, so a snapshot written
again is the same file. The snapshots after the step a run continues from (a resume, a rollback) are removed as
it continues: they are of work it takes again (differently after a resize or a rollback) or, with a smaller
`train.total_steps`, not at all, and a rebuild would mix them with its own.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from raydiff.config import Config
from raydiff.config.load import read_record
from raydiff.model.weight_averages import PowerEma, combine, solve_coefficients
from raydiff.runs.checkpoint import STATE_FILE, input_errors, parameters_known_now
from raydiff.runs.state import bad_file_reason, foreign_reason
from raydiff.storage.rundir import RunDir

SNAPSHOT_DIR = "ema_snapshots"
_NAME = re.compile(r"step_(\d{8})\.pt$")
SNAPSHOT_KEYS = ("step", "images_seen", "sigma_rels", "profiles", "config")  # what `snapshot_bytes` writes


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_DIR}/step_{step:08d}.pt"


def snapshot_bytes(posthoc: PowerEma, *, step: int, images_seen: int, config: dict[str, Any],
                   classes: dict[str, Any] | None) -> bytes:
    """One snapshot file's contents: the averages' state dicts (on the CPU) at `step`."""
    state = {"step": step, "images_seen": images_seen, "sigma_rels": list(posthoc.sigma_rels),
             "profiles": [{k: v.detach().cpu() for k, v in p.state_dict().items()} for p in posthoc.profiles],
             "config": config}
    if classes:
        state["classes"] = {"names": list(classes["names"]), "counts": list(classes["counts"])}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def snapshot_size(cfg: Config) -> tuple[int, int]:
    """(bytes per snapshot, snapshots in the run) of `train.ema: posthoc` with this (resolved) config: 4 bytes per
    parameter per tracked average (fp32), one snapshot every `train.ema_snapshot_every` steps and one at the end
    (`auto` classes, before the data is read, counted as none)."""
    t = cfg.train
    every = t.ema_snapshot_every
    assert isinstance(every, int), "Config.resolve sets train.ema_snapshot_every"
    count = t.total_steps // every + (t.total_steps % every != 0)
    return 4 * parameters_known_now(cfg) * len(t.ema_sigma_rels), count


def describe_snapshots(cfg: Config) -> str:
    """For the start line: what the post-hoc EMA tracks and what its snapshots will take on storage."""
    t = cfg.train
    size, count = snapshot_size(cfg)
    widths = ", ".join(f"{s:g}" for s in t.ema_sigma_rels)
    return (f"post-hoc EMA sigma_rel {widths}: a snapshot every {t.ema_snapshot_every} steps, {_size(size)} each, "
            f"{count} in the run ({_size(count * size)})")


def _size(n: int) -> str:
    return f"{n / 1e6:.3g} MB" if n < 1e9 else f"{n / 1e9:.3g} GB"


def list_snapshots(run_dir: RunDir, *, where: str | None = None) -> list[int]:
    """The steps of the run's snapshots, in order. `where`: the flag of a command that named the run, for a
    folder it cannot read to be one line (`input_errors`)."""
    with input_errors(where, run_dir / SNAPSHOT_DIR):
        names = (run_dir / SNAPSHOT_DIR).files("step_")
    return sorted(int(m.group(1)) for m in map(_NAME.search, names) if m)


def removed_note(removed: list[int], step: int, where: str) -> str:
    """The note of `remove_snapshots_after`'s removal: of work after `step`, `where` the run goes on or ended."""
    return (f"[raydiff] note: removed the post-hoc EMA snapshots of step(s) {', '.join(map(str, removed))}: of work "
            f"after step {step}, {where}")


def remove_snapshots_after(run_dir: RunDir, step: int) -> list[int]:
    """Remove the snapshots of steps after `step`; their steps."""
    later = [s for s in list_snapshots(run_dir) if s > step]
    for s in later:
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile: what was asked for
            run_dir.remove(snapshot_name(s))
    return later


def read_snapshot(run_dir: RunDir, step: int, *, where: str | None = None) -> dict[str, Any]:
    """The snapshot of `step`; ValueError (one line) for a file that is not one (cut short, empty, not a torch
    file, or a torch file raydiff did not write), rather than torch's advice to switch its safe loader off or a
    KeyError's traceback; with `where`, StorageFailure (one line) for one it cannot read (`input_errors`)."""
    with input_errors(where, run_dir / snapshot_name(step)):
        data = run_dir.open_binary(snapshot_name(step))
    try:
        snapshot = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = bad_file_reason(exc, "snapshot")
        if reason is None:  # storage or memory, not the file: as they are
            raise
        raise ValueError(f"{run_dir / snapshot_name(step)}: {reason}") from None
    reason = foreign_reason(snapshot, SNAPSHOT_KEYS, what="snapshot")
    if reason is None and len(snapshot["profiles"]) != len(snapshot["sigma_rels"]):
        reason = "not a raydiff snapshot (its 'sigma_rels' and 'profiles' are not lists of one length)"
    if reason is not None:
        raise ValueError(f"{run_dir / snapshot_name(step)}: {reason}; move it out of {SNAPSHOT_DIR}/, where each "
                         f"step_NNNNNNNN.pt is read as a snapshot")
    return snapshot


class NoSuchSnapshot(ValueError):
    """The step asked for is none of the run's snapshots'."""


@dataclass(frozen=True)
class Rebuilt:
    """An average rebuilt from a run's snapshots, as a training state (`state`: what a checkpoint's state.pt holds
    for sampling, evaluating and exporting: the average as `ema`, no online weights or optimizer)."""

    sigma_rel: float
    state: dict[str, Any]


def rebuild(run_dir: RunDir, sigma_rels: list[float], step: int | None = None,
            steps: list[int] | None = None, where: str | None = None) -> list[Rebuilt]:
    """The averages of widths `sigma_rels` at snapshot step `step` (default: the newest), from every snapshot of
    the run up to it (`steps`: the run's snapshot steps, if the caller listed them already). Raises
    FileNotFoundError (one line) when the run folder does not exist or has no snapshots, ValueError when `step`
    is not a snapshot's; with `where` (the flag that named the run), StorageFailure (one line) for a snapshot or
    their folder that cannot be read.

    The coefficients come first, from the snapshots' steps and the widths the run tracked (the snapshot at `step`
    names them; every snapshot of a run tracks the same, which each is checked for as it is read); then the
    snapshots are read and added in one at a time. Why: a long run has hundreds of snapshots of hundreds of MB
    each, more than a host's memory held at once."""
    steps = list_snapshots(run_dir, where=where) if steps is None else steps
    if not steps and not run_dir.exists():  # a mistyped path: no reason to train again
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    if not steps and run_dir.is_file(STATE_FILE) and run_dir.name.startswith("sigma_rel-"):  # raydiff.ema's --out
        raise FileNotFoundError(f"{run_dir}: an average raydiff.ema rebuilt; the post-hoc EMA's snapshots are its "
                                f"run's: give the run folder it was rebuilt from")
    if not steps and run_dir.is_file(STATE_FILE):  # the snapshots are the run's, beside its checkpoints
        raise FileNotFoundError(f"{run_dir}: a checkpoint folder; the post-hoc EMA's snapshots are its run's: give "
                                f"the run folder, {run_dir.parent} (and --step for this checkpoint's step)")
    if not steps and _tracks_posthoc(run_dir):
        raise FileNotFoundError(f"{run_dir}: no post-hoc EMA snapshot yet ({SNAPSHOT_DIR}/): the run writes one "
                                f"every train.ema_snapshot_every steps and at its end")
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no post-hoc EMA snapshots ({SNAPSHOT_DIR}/); train with "
                                f"--set train.ema=posthoc to record them")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise NoSuchSnapshot(f"no snapshot of {run_dir} at that step (snapshots: {_span(steps)})")
    used = [s for s in steps if 0 < s <= step]
    if not used:
        raise ValueError(f"no snapshot at or before step {step}")
    last = read_snapshot(run_dir, step, where=where)
    tracked = [float(s) for s in last["sigma_rels"]]
    common = {k: v for k, v in last.items() if k not in ("profiles", "sigma_rels")}
    del last  # its weights are read again in turn: one snapshot in memory at a time
    coefficients = solve_coefficients([s for s in used for _ in tracked], tracked * len(used), step, sigma_rels)
    averages = combine(_profiles(run_dir, used, tracked, step, where), coefficients)
    # "snapshots": the files (each holds an average per width tracked: `profiles` of them were combined).
    posthoc = {"snapshots": len(used), "profiles": len(coefficients), "run": str(run_dir)}
    return [Rebuilt(sigma, {**common, "ema": average, "posthoc": {"sigma_rel": sigma, **posthoc}})
            for sigma, average in zip(sigma_rels, averages, strict=True)]


def _tracks_posthoc(run_dir: RunDir) -> bool:
    """Whether the run's recorded config (config.yaml, where it reads) has train.ema: posthoc."""
    try:
        recorded, _ = read_record(lambda: run_dir.read_text("config.yaml"), "YAML") if run_dir.is_file(
            "config.yaml") else (None, None)  # not UTF-8, not YAML: None, and the plain line then
    except OSError:
        return False
    return isinstance(recorded, dict) and isinstance(recorded.get("train"), dict) and \
        recorded["train"].get("ema") == "posthoc"


def _profiles(run_dir: RunDir, steps: list[int], tracked: list[float], out_step: int,
              where: str | None) -> Iterator[dict[str, torch.Tensor]]:
    """The averages of the snapshots at `steps`, in order, each snapshot read only once the previous one's were
    all taken (and let go of); each must track the widths `tracked`, as the snapshot at `out_step` does, and hold
    weights of the same names and shapes as the first (a snapshot of another model would be added in, broadcast, or
    fail half-way)."""
    shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None
    for step in steps:
        snapshot = read_snapshot(run_dir, step, where=where)
        if [float(s) for s in snapshot["sigma_rels"]] != tracked:
            raise ValueError(f"{run_dir}: {snapshot_name(step)} tracks sigma_rel {snapshot['sigma_rels']}, "
                             f"{snapshot_name(out_step)} {tracked}: snapshots of different widths cannot be "
                             f"combined")
        profiles = snapshot.pop("profiles")
        del snapshot
        for these in map(_shapes, profiles):  # names the profiles only here: each is let go of once taken
            shapes = these if shapes is None else shapes
            if these != shapes:
                raise ValueError(f"{run_dir}: {snapshot_name(step)} holds weights of other names or shapes than "
                                 f"{snapshot_name(steps[0])}: snapshots of different models cannot be combined")
        while profiles:
            yield profiles.pop(0)


def _shapes(profile: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (value.shape, value.dtype) for name, value in profile.items()}


def _span(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


def weights_of(state: dict[str, Any], checkpoint: object, *, use_ema: bool) -> str:
    """Which weights of a training state a command uses, for its output line: "EMA", "online", or the post-hoc
    average's width. Raises ValueError (one line) for --no-ema on a rebuilt average or a diffusers folder, which hold
    one set of weights, not the online ones beside the EMA."""
    exported = state.get("weights")  # a diffusers folder's (`diffusers_folder.state_from_folder`)
    if exported is not None and not use_ema:
        raise ValueError(f"--no-ema: {checkpoint} is a diffusers folder and holds one set of weights ({exported}); "
                         f"leave out --no-ema, or use a checkpoint of the run")
    if exported is not None:
        return exported
    posthoc = state.get("posthoc")
    if posthoc is None:
        return "EMA" if use_ema else "online"
    if not use_ema:
        raise ValueError(f"--no-ema: {checkpoint} is a post-hoc EMA average rebuilt by raydiff.ema and holds no "
                         f"online weights; leave out --no-ema, or use a checkpoint of the run")
    return f"post-hoc EMA sigma_rel {posthoc['sigma_rel']:g}"
