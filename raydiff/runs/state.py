"""The full training state: what a checkpoint holds, putting it back all or nothing, and choosing which to use.

A checkpoint holds everything that is not a pure function of (config, step): weights, EMA, optimizer and
loss-scaler state, counters, and the partial sums of the current logging window. The learning rate, the sample
order and every random draw are functions of (seed, step, stream offset), so restoring them restores the run.

Restoring is all or nothing: a checkpoint is first loaded into twins of the model, EMA and optimizer that hold no
memory (`model.meta_twin`), and only applied when every part fits. If checkpoints exist and none of them loads, the
run refuses to start rather than train from scratch on top of them (`Unresumable`).

Only a checkpoint that is itself bad (cut short, empty, not a torch file, a torch file raydiff did not write, or a
state that does not fit) is passed over for an older one. A read that fails this time (storage beyond its
retries, the network, memory) raises: the worker fails and Ray Train restarts it (`run.max_failures`) from the
same checkpoint, where falling back would silently throw away the newest progress, or refuse a run whose
checkpoints are fine.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from raydiff.cluster.devices import out_of_memory
from raydiff.config import sections_problem
from raydiff.model.meta_twin import check_load, meta_twin
from raydiff.model.weight_averages import PowerEma
from raydiff.runs.checkpoint import (
    STATE_FILE,
    Location,
    as_rundir,
    checkpoint_order,
    input_errors,
    list_checkpoints,
    read_state,
)
from raydiff.runs.errors import Unresumable
from raydiff.storage.errors import StorageFailure, permanent_reason
from raydiff.storage.rundir import RunDir

if TYPE_CHECKING:
    import ray.train

logger = logging.getLogger("raydiff")
REQUIRED_KEYS = ("model", "ema", "optimizer", "scaler", "step", "images_seen", "counters", "window", "config")
# What every state.pt raydiff writes holds, a training checkpoint's (`checkpoint_state`) and a post-hoc average's
# that `raydiff.ema` rebuilt (no online weights) alike, and what every command reading one takes: the weights, the
# config that builds their model, the step it names. A file torch loads without them is not raydiff's.
STATE_KEYS = ("config", "ema", "step")
READ_ATTEMPTS = 3  # attempts at a read that meets a storage error (OSError), with a growing pause between them
READ_RETRY_S = 1.0
NOT_READABLE = "not a readable {what} (truncated, empty, or not a torch file)"
# OSErrors that torch.load raises for the file's content: a seek before the start of a zip cut short.
CONTENT_ERRNOS = {errno.EINVAL}


@dataclass
class Progress:
    """Counters that travel in checkpoints."""

    step: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {"skipped_steps": 0, "rollbacks": 0, "stream_offset": 0})
    # Global partial sums of the logging window (over all workers), so that a resumed run logs the same numbers as
    # an uninterrupted one; restored on rank 0 only.
    window: dict[str, Any] = field(default_factory=lambda: {"loss_sum": 0.0, "samples": 0, "grad_norm_sum": 0.0,
                                                            "finite_steps": 0})
    # The newest measurements (val_loss, quality, the last logged loss), so that a resumed run reports them as an
    # uninterrupted one would, and one resumed at its last step still ends with them.
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def stream_step(self) -> int:
        """Where in the sample stream the next step reads: the step, plus the steps a rollback skipped."""
        return self.step + self.counters.get("stream_offset", 0)


class TrainingState(NamedTuple):
    """The objects a checkpoint saves and restores besides the progress counters."""

    model: torch.nn.Module  # the bare model, not its DDP or compiled wrapper
    ema: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    posthoc: PowerEma | None = None  # train.ema: posthoc: the tracked power-function averages


@dataclass
class Restored:
    progress: Progress
    checkpoint: RunDir
    notes: list[str]


def checkpoint_state(objects: TrainingState, progress: Progress, global_batch: int,
                     config: dict[str, Any], classes: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint file holds: the objects' state dicts, the progress and the run's config; for a
    class-conditional run, its classes ({"names", "counts"}: what sampling by name and evaluation in the data's
    class frequencies need, without the run's data)."""
    model, ema, optimizer, scaler, posthoc = objects
    state = {
        "model": model.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "step": progress.step, "images_seen": progress.step * global_batch,
        "counters": dict(progress.counters), "window": dict(progress.window), "config": config,
        "measured": _plain_numbers(progress.measured),
    }
    if posthoc is not None:
        state["posthoc_ema"] = posthoc.state_dict()
    if classes:
        state["classes"] = {"names": list(classes["names"]), "counts": list(classes["counts"])}
    return state


def _plain_numbers(value: Any) -> Any:
    """Measurements with numpy scalars as Python numbers: a metric computed in numpy would otherwise make the
    checkpoint unreadable with `weights_only=True`."""
    if isinstance(value, dict):
        return {key: _plain_numbers(item) for key, item in value.items()}
    return value.item() if isinstance(value, np.generic) else value


class DamagedCheckpoint(ValueError):
    """A state file torch cannot read (cut short, empty, or not a torch file), or one it reads that raydiff did not
    write (a model's bare state_dict, a list); the message says so in words (torch's own would tell the user to
    switch the safe loader off)."""


def read_with_retries(path: RunDir) -> dict[str, Any]:
    """`read_state`, retrying storage errors (a flaky network, a throttled bucket) before giving up. A file that is
    not a checkpoint raises DamagedCheckpoint at once; a missing one FileNotFoundError; running out of memory
    its own error."""
    for attempt in range(READ_ATTEMPTS):
        try:
            state = read_state(path)
        except FileNotFoundError:
            raise
        except Exception as exc:
            reason = bad_file_reason(exc)
            if reason is not None:
                raise DamagedCheckpoint(reason) from exc
            if not isinstance(exc, OSError) or attempt == READ_ATTEMPTS - 1 or permanent_reason(exc) is not None:
                raise  # memory, or storage no retry can fix (refused permission), or beyond the retries
            time.sleep(READ_RETRY_S * 2**attempt)
            continue
        # Checked here, where every reader passes: a caller's state["config"] would be a KeyError's traceback.
        reason = foreign_reason(state, STATE_KEYS)
        if reason is not None:
            raise DamagedCheckpoint(reason)
        return state
    raise AssertionError("unreachable")


def foreign_reason(state: object, keys: tuple[str, ...], *, what: str = "checkpoint") -> str | None:
    """Why `state`, a file that torch loaded, is not a raydiff `what` (not a dict with `keys`, or an entry of
    another shape than `ENTRY_SHAPES` says raydiff writes), in words; None where it has raydiff's shape."""
    if not isinstance(state, dict):
        return f"not a raydiff {what} (it holds a {type(state).__name__}, not a dict with {_quoted(keys)})"
    missing = tuple(k for k in keys if k not in state)
    if missing:
        return f"not a raydiff {what} (no {_quoted(missing)})"
    for key, (fits, shape) in ENTRY_SHAPES.items():
        if key in state and not fits(state[key]):
            return f"not a raydiff {what} (its {key!r} is not {shape})"
    return None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_weights(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def _is_classes(value: object) -> bool:
    if value is None:  # none recorded: an unconditional run's, or ids for names
        return True
    if not isinstance(value, dict):
        return False
    names, counts = value.get("names", []), value.get("counts", [])
    return isinstance(names, list) and isinstance(counts, list) and all(map(_is_count, counts))


def _is_posthoc(value: object) -> bool:
    return isinstance(value, dict) and _is_number(value.get("sigma_rel")) and _is_count(value.get("snapshots"))


# What each entry that the commands read holds, as raydiff writes it (`checkpoint_state`; a snapshot,
# `snapshot_bytes`; an average `raydiff.ema` rebuilt): judged wherever a file holds it, so that a file with an
# entry of another shape is named and passed over as a damaged one, not a traceback in whichever command reads it.
ENTRY_SHAPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "config": (lambda v: isinstance(v, dict) and sections_problem(v) is None, "a mapping of sections"),
    "ema": (_is_weights, "a mapping of names to tensors"),
    "model": (_is_weights, "a mapping of names to tensors"),
    "step": (_is_count, "an int >= 0"),
    "images_seen": (_is_count, "an int >= 0"),
    "classes": (_is_classes, "a mapping of 'names' and 'counts' lists"),
    "posthoc": (_is_posthoc, "a mapping of a 'sigma_rel' number and a 'snapshots' count"),
    "sigma_rels": (lambda v: isinstance(v, list) and all(map(_is_number, v)), "a list of numbers"),
    "profiles": (lambda v: isinstance(v, list) and all(map(_is_weights, v)), "a list of mappings of names to tensors"),
}


def _quoted(keys: tuple[str, ...]) -> str:
    return ", ".join(map(repr, keys))


def bad_file_reason(exc: BaseException, what: str = "checkpoint") -> str | None:
    """Why `exc`, from torch.load, says the file itself is bad, in words (torch's own would tell the user to switch
    the safe loader off): the Python class it holds that the safe loader does not load, or NOT_READABLE
    (unpickling errors, EOFError, a zip torch cannot read, a seek before a cut-short zip's start); None where
    storage or memory failed, not the file."""
    if isinstance(exc, OSError):
        return NOT_READABLE.format(what=what) if exc.errno in CONTENT_ERRNOS else None
    if out_of_memory(exc):
        return None
    text = str(exc)
    if "Unsupported global: GLOBAL " in text:
        name = text.split("Unsupported global: GLOBAL ", 1)[1].split()[0]
        return f"it holds a Python object ({name}), which raydiff does not load: only tensors and plain data"
    return NOT_READABLE.format(what=what)


def _unusable(exc: BaseException) -> bool:
    """Whether `exc`, met restoring a checkpoint, says that the checkpoint itself cannot be used (cut short, gone,
    or a state that does not fit: a missing key, another shape), so that an older one is tried; False for what
    failed this time only (storage, network, memory, a device error: anything else)."""
    if isinstance(exc, DamagedCheckpoint | FileNotFoundError | KeyError | ValueError | TypeError):
        return True  # unreadable, gone, a part missing, or an optimizer's groups or a value of another kind
    # Module.load_state_dict's misfit (another shape, keys missing or unexpected)
    return isinstance(exc, RuntimeError) and str(exc).startswith("Error(s) in loading state_dict")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, DamagedCheckpoint):
        return str(exc)
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def read_newest(location: Location, *, where: str | None = None) -> tuple[RunDir, dict[str, Any]]:
    """(checkpoint, state) of a checkpoint folder, or of a run folder's newest checkpoint that reads: a damaged one
    (or one an older raydiff was still uploading file by file, or one whose weights do not fit the model its config
    describes) is named in one line on stderr and the previous one is used, as training does. Raises
    FileNotFoundError (one line) when none reads, StorageFailure (one line) when storage fails beyond its retries
    or a folder or file cannot be read (a refused permission): an older checkpoint is used only in place of a bad
    one; and ConfigError (one line naming the checkpoint, after
    `where`: the flag or key that named it) for a config this raydiff cannot read (a key a newer one wrote)."""
    run = as_rundir(location)
    with input_errors(where, run):  # a folder this user may not read: one line naming it, as a state.pt's below
        single = run.is_file(STATE_FILE)
        found = single or run.exists()
    if single:
        candidates = [run]
    elif not found:
        raise FileNotFoundError(f"{run}: no such run or checkpoint folder")
    else:
        candidates = list_checkpoints(run, where=where)[::-1]
        if not candidates and (run.is_file("model_index.json") or run.is_file("unet/config.json")):
            raise FileNotFoundError(f"{run}: a diffusers pipeline folder, not a raydiff run or checkpoint folder "
                                    f"(raydiff.sample and model.init_from read it)")
        if not candidates:
            raise FileNotFoundError(f"{run}: no checkpoint_* folder with {STATE_FILE} in it")
    failures = []
    for i, checkpoint in enumerate(candidates):
        try:
            state = read_with_retries(checkpoint)
            check_weights_fit(state, checkpoint, where=where)
            return checkpoint, state
        except (DamagedCheckpoint, FileNotFoundError) as exc:  # a partial, damaged or gone file: try the previous one
            reason = _reason(exc)
        except OSError as exc:  # storage beyond its retries: an older checkpoint would be the wrong answer
            why = permanent_reason(exc) or _reason(exc)
            raise StorageFailure(f"checkpoint {checkpoint}: reading it failed ({why}); no older checkpoint was used "
                                 f"in its place: check the storage and the network, then run the same command "
                                 f"again") from None
        failures.append(f"{checkpoint.name} ({reason})")
        if i + 1 < len(candidates):
            print(f"[raydiff] warning: checkpoint {checkpoint} cannot be read ({reason}); using "
                  f"{candidates[i + 1].name}", file=sys.stderr)
    raise FileNotFoundError(f"{run}: no checkpoint can be read: {'; '.join(failures)}")


def check_weights_fit(state: dict[str, Any], checkpoint: RunDir, *, where: str | None = None) -> None:
    """Refuse a state whose weights the commands could not load into the model its config describes, in one line:
    ConfigError (naming the checkpoint, after `where`) for a config this raydiff cannot read, where every command
    would stop; DamagedCheckpoint for an "ema" (or "model") of other names or shapes (a file raydiff did not
    write), where an older checkpoint may serve."""
    from raydiff.config import Config, ConfigError
    from raydiff.model.unet import build_model

    try:
        cfg = Config.from_dict(state["config"])
        with torch.device("meta"):  # names and shapes only: nothing allocated
            expected = build_model(cfg).state_dict()
    except ValueError as exc:  # a key this raydiff does not know, a value of another kind, num_classes = auto
        raise ConfigError(f"{where + ': ' if where else ''}the config in {checkpoint} cannot be read ({exc})") from None
    for key in ("ema", "model"):
        problem = _misfit(state[key], expected) if key in state else None
        if problem:
            raise DamagedCheckpoint(f"its {key!r} does not fit the model its config describes ({problem})")


def _misfit(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str | None:
    """How `weights` differ from a model's (`expected`: its state_dict) in names or shapes, in words; None where
    they fit."""
    for names, what in (([k for k in expected if k not in weights], "no {!r}"),
                        ([k for k in weights if k not in expected], "{!r}, which the model lacks")):
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            return what.format(names[0]) + more
    for key, value in expected.items():
        if weights[key].shape != value.shape:
            return f"{key!r} of shape {list(weights[key].shape)}, where the model's is {list(value.shape)}"
    return None


@contextlib.contextmanager
def not_found_named(where: str) -> Iterator[None]:
    """A folder or checkpoint not found, in one line that names the flag that named it (`where`, "--guide X"):
    the path alone reads as the model's own where a command takes two."""
    try:
        yield
    except FileNotFoundError as exc:
        message = str(exc)
        raise FileNotFoundError(message if message.startswith(where) else f"{where}: {message}") from None


def read_guide(guide: str, endpoint: str | None, model: dict[str, Any]) -> tuple[RunDir, dict[str, Any]]:
    """(checkpoint, state) of an autoguidance guide (`--guide`), read as `read_newest` reads, and refused in one line
    (ConfigError) unless its network predicts what the model's (`model`, its state) does (`check_guide`)."""
    from raydiff.config import ConfigError
    from raydiff.model.guidance import check_guide, state_class_names
    from raydiff.runs.checkpoint import checkpoint_location

    where = f"--guide {guide}"
    with not_found_named(where):
        checkpoint, state = read_newest(checkpoint_location(guide, endpoint, where=where), where=where)
    try:
        check_guide(model["config"], state["config"], guide,
                    class_names=(state_class_names(model), state_class_names(state)))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return checkpoint, state


def _scaler_state(state: dict[str, Any], scaler: torch.amp.GradScaler, notes: list[str]) -> dict[str, Any] | None:
    """The saved loss-scaler state if it applies to this scaler; None (with a note) when the precision changed."""
    saved = state["scaler"]
    if scaler.is_enabled() and not saved:
        notes.append("the checkpoint has no loss scale (it was not trained in fp16): the fp16 loss scale starts afresh")
        return None
    return saved if scaler.is_enabled() else None


def restore(state: dict[str, Any], objects: TrainingState) -> tuple[Progress, list[str]]:
    """Load `state` into the objects, all or nothing: raises (changing nothing) if any part does not fit.
    Returns the progress and notes about parts that were dropped because a setting changed."""
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise KeyError(f"missing {', '.join(missing)}")
    model, ema, optimizer, scaler, posthoc = objects
    if posthoc is not None and "posthoc_ema" not in state:
        raise KeyError("missing posthoc_ema (train.ema: posthoc tracks its averages from step 0)")
    notes: list[str] = []
    scaler_state = _scaler_state(state, scaler, notes)
    # Load into memoryless twins first: a load that fails half way must not leave the live objects half restored.
    model_twin, ema_twin, optimizer_twin = meta_twin((model, ema, optimizer))
    check_load(model_twin, state["model"])
    check_load(ema_twin, state["ema"])
    check_load(optimizer_twin, state["optimizer"])
    if scaler_state is not None:
        copy.deepcopy(scaler).load_state_dict(scaler_state)
    if posthoc is not None:
        posthoc.load_state_dict(state["posthoc_ema"], check_only=True)
    counters = {**Progress().counters, **state["counters"]}
    window = {**Progress().window, **state["window"]}

    # Everything fits: apply.
    model.load_state_dict(state["model"])
    ema.load_state_dict(state["ema"])
    optimizer.load_state_dict(state["optimizer"])
    match_parameter_layout(optimizer)
    if scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    if posthoc is not None:
        posthoc.load_state_dict(state["posthoc_ema"])
    measured = dict(state.get("measured", {}))  # none in checkpoints written before raydiff kept them
    return Progress(step=state["step"], counters=counters, window=window, measured=measured), notes


def match_parameter_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each per-parameter state tensor (AdamW's moments) its parameter's memory layout. A checkpoint holds
    them contiguous; a channels_last model's parameters are not, and the fused and foreach kernels pair elements
    by position in memory, so moments of another layout would update the wrong weights."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                    optimizer.state[param][name] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def restore_newest(candidates: list[RunDir], objects: TrainingState) -> Restored | None:
    """Restore the newest candidate that reads and fits, warning about each one skipped. None when there are no
    candidates; raises `Unresumable` when there are some and none can be restored. A failure that is not the
    checkpoint's own (storage beyond its retries, the network, memory) raises as it is: the worker fails, and Ray
    Train restarts it from this same checkpoint (`run.max_failures`)."""
    failures = []
    for path in candidates:
        try:
            progress, notes = restore(read_with_retries(path), objects)
            return Restored(progress, path, notes)
        except Exception as exc:
            if not _unusable(exc):
                logger.warning(f"[raydiff] WARNING: checkpoint {path} could not be read this time ({_reason(exc)}); "
                               f"not falling back to an older one: the worker fails and is restarted "
                               f"(run.max_failures)")
                raise
            reason = _reason(exc)  # a truncated file, a missing key, a misfit: try the previous one
            failures.append(f"{path.name} ({reason})")
            logger.warning(f"[raydiff] WARNING: checkpoint {path} is unreadable ({reason}); falling back to the "
                           f"previous one")
    if candidates:
        raise Unresumable(f"none of the {len(candidates)} checkpoint(s) of this run can be restored, so it will not "
                          f"start over on top of them: {'; '.join(failures)}. Nothing was changed; fix or remove "
                          f"them, or use --set run.name=NEW")
    return None


def apply_config(optimizer: torch.optim.Optimizer, *, weight_decay: float) -> None:
    """Settings a re-run may change take effect after the optimizer state is restored (the learning rate is set
    every step)."""
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay


def checkpoint_candidates(run_dir: RunDir, latest: ray.train.Checkpoint | None = None) -> list[RunDir]:
    """Checkpoints to restore, newest first: every checkpoint of the run on storage, plus Ray Train's latest.

    Storage can be ahead of Ray's bookkeeping: a checkpoint uploaded just before a crash may never have
    reached the controller. It is complete (or fails to load and is skipped), so it is used.
    """
    run_dir = as_rundir(run_dir)
    found = set(list_checkpoints(run_dir))
    if latest is not None:  # Ray's checkpoints live in the run directory, on the same storage
        found.add(run_dir / PurePosixPath(latest.path).name)
    return sorted(found, key=checkpoint_order, reverse=True)
