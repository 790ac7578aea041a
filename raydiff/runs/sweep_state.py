"""A sweep's Ray Tune experiment state, checked before Tune restores it.

Why a check of our own: Tune saves its experiment state (`tuner.pkl`, then `experiment_state-<time>.json` and the
grid's `basic-variant-state-<time>.json`) by writing or copying each file in place, not atomically. A sweep driver
killed during a save, or a disk that fills, leaves a file cut short, and a driver killed before Tune's first save
leaves `tuner.pkl` with no experiment state. Tune's own
`Tuner.can_restore` looks at `tuner.pkl` alone; the restore then either raises (a cut `tuner.pkl`) or, worse,
continues an experiment that has lost its trials, running one trial with an empty config. raydiff does not
need Tune's state to continue a sweep: every trial is a raydiff run that continues from its own newest
checkpoint, and a finished one reports its final result again. So an unusable state is set aside (renamed,
nothing deleted) and the sweep starts Tune afresh over the same grid.
"""

from __future__ import annotations

import json
import pickletools
import time
from pathlib import Path

TUNER_FILE = "tuner.pkl"
EXPERIMENT_STATE = "experiment_state-*.json"  # one per driver session; Tune restores the newest by name
SEARCHER_STATE = "basic-variant-state-*.json"  # the grid's progress, a pickle despite its name; the newest is read


def unusable_tune_state(experiment: Path) -> str | None:
    """Why Tune could not restore the experiment in `experiment` as it was, or None if it can or there is
    nothing to restore (no `tuner.pkl`: Tune starts a new experiment)."""
    tuner = experiment / TUNER_FILE
    if not tuner.is_file():
        return None
    if not _whole_pickle(tuner.read_bytes()):
        return f"{TUNER_FILE} is cut short"
    states = sorted(experiment.glob(EXPERIMENT_STATE))
    if not states:
        return "Tune had not saved its experiment state yet"
    try:
        json.loads(states[-1].read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{states[-1].name} is cut short"
    searchers = sorted(experiment.glob(SEARCHER_STATE))
    if searchers and not _whole_pickle(searchers[-1].read_bytes()):
        return f"{searchers[-1].name} is cut short"
    return None


def set_aside_unusable_tune_state(experiment: Path) -> str | None:
    """Rename the experiment directory if `unusable_tune_state` finds it unusable; returns a line saying so,
    or None when it was kept."""
    why = unusable_tune_state(experiment)
    if why is None:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = experiment.with_name(f"{experiment.name}.unusable-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = experiment.with_name(f"{experiment.name}.unusable-{stamp}-{n}")
    experiment.rename(aside)
    return (f"the sweep's Tune state is unusable ({why}: a save was cut short, by a stop of its driver or a full "
            f"disk), kept as "
            f"{aside}; Tune starts afresh over the same grid, each trial continuing from its own run's newest "
            f"checkpoint")


def _whole_pickle(data: bytes) -> bool:
    """Whether `data` is a complete pickle, read without running any of it."""
    try:
        for _ in pickletools.genops(data):
            pass
    except ValueError:  # "pickle exhausted before seeing STOP", or an opcode cut in two
        return False
    return True
