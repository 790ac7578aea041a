"""Checkpoint files: the full training state in one `state.pt`, loaded with `weights_only=True`.

Ray Train persists each checkpoint directory to `<run.storage>/<run.name>/checkpoint_<step>`; this module
writes and reads the file inside and finds checkpoints in a run directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
_NAME = re.compile(r"checkpoint_(\d{8})(?:-(\d+))?$")


def checkpoint_name(step: int, run_dir: Path | None = None) -> str:
    """`checkpoint_<step>`; a step reported again after a rollback or a fallback gets `-1`, `-2`, ... so that it
    never shares a folder with a checkpoint Ray Train already tracks (and may delete)."""
    name, n = f"checkpoint_{step:08d}", 0
    while run_dir is not None and (Path(run_dir) / name).exists():
        n += 1
        name = f"checkpoint_{step:08d}-{n}"
    return name


def checkpoint_step(path: Path) -> int:
    return int(_NAME.search(Path(path).name).group(1))


def write_state(directory: Path, state: dict[str, Any]) -> Path:
    """Save `state` (tensors, numbers, strings, lists, dicts only) so that a reader sees all of it or none."""
    path = Path(directory) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_state(directory: Path) -> dict[str, Any]:
    return torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run that hold a state file, oldest first."""
    found = [p for p in Path(run_dir).glob("checkpoint_*") if _NAME.search(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_order)


def checkpoint_order(path: Path) -> tuple[int, int]:
    """Sort key: step, then the repeat suffix (`checkpoint_00000010-1` comes after `checkpoint_00000010`)."""
    step, repeat = _NAME.search(Path(path).name).groups()
    return int(step), int(repeat or 0)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint). Raises FileNotFoundError."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    if path.is_dir():
        checkpoints = list_checkpoints(path)
        if checkpoints:
            return checkpoints[-1]
        raise FileNotFoundError(f"{path}: no checkpoint_* folder with {STATE_FILE} in it")
    raise FileNotFoundError(f"{path}: no such run or checkpoint folder")
