"""Checkpoint files: the full training state in one `state.pt`, loaded with `weights_only=True`.

Ray Train persists each checkpoint directory to `<run.storage>/<run.name>/checkpoint_<step>` (a local or NFS
folder, or an object store); this module writes the file inside, reads it back from any of those, and finds
the checkpoints of a run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from raydiff.runs.rundir import RunDir

STATE_FILE = "state.pt"
_NAME = re.compile(r"checkpoint_(\d{8})(?:-(\d+))?$")

Location = str | os.PathLike | RunDir


def as_rundir(location: Location) -> RunDir:
    return location if isinstance(location, RunDir) else RunDir(location)


def checkpoint_name(step: int, run_dir: Location | None = None) -> str:
    """`checkpoint_<step>`; a step reported again after a rollback or a fallback gets `-1`, `-2`, ... so that it
    never shares a folder with a checkpoint Ray Train already tracks (and may delete)."""
    name, n = f"checkpoint_{step:08d}", 0
    run = as_rundir(run_dir) if run_dir is not None else None
    while run is not None and run.exists(name):
        n += 1
        name = f"checkpoint_{step:08d}-{n}"
    return name


def checkpoint_step(location: Location) -> int:
    match = _NAME.search(as_rundir(location).name)
    assert match is not None, f"not a checkpoint folder: {location}"
    return int(match.group(1))


def checkpoint_order(location: Location) -> tuple[int, int]:
    """Sort key: step, then the repeat suffix (`checkpoint_00000010-1` comes after `checkpoint_00000010`)."""
    match = _NAME.search(as_rundir(location).name)
    assert match is not None, f"not a checkpoint folder: {location}"
    step, repeat = match.groups()
    return int(step), int(repeat or 0)


def write_state(directory: Path, state: dict[str, Any]) -> Path:
    """Save `state` (tensors, numbers, strings, lists, dicts only) into a local folder so that a reader sees all
    of it or none."""
    path = Path(directory) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_state(directory: Location) -> dict[str, Any]:
    """The state of a checkpoint folder, local or on an object store; only tensors and plain data are loaded."""
    run = as_rundir(directory)
    if run.local is not None:
        return torch.load(run.local / STATE_FILE, map_location="cpu", weights_only=True)
    return torch.load(run.open_binary(STATE_FILE), map_location="cpu", weights_only=True)


def list_checkpoints(run_dir: Location) -> list[RunDir]:
    """Checkpoint folders of a run that hold a state file, oldest first."""
    found = [c for c in as_rundir(run_dir).subdirs("checkpoint_") if _NAME.search(c.name) and c.is_file(STATE_FILE)]
    return sorted(found, key=checkpoint_order)


def checkpoint_location(uri: str, endpoint: str | None) -> RunDir:
    """The RunDir of a command's --checkpoint (a local path or an s3:// / gs:// URI); FileNotFoundError (a user
    error, one line) for an unsupported URI scheme."""
    try:
        return RunDir(uri, endpoint=endpoint)
    except ValueError as exc:
        raise FileNotFoundError(f"--checkpoint {uri}: {exc}") from None
