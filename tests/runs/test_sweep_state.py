"""A sweep's Tune state: what Tune could not restore as it was is set aside whole; a usable state is kept."""

from __future__ import annotations

import json
import pickle

import pytest

from raydiff.runs.sweep_state import set_aside_unusable_tune_state, unusable_tune_state

TUNER = pickle.dumps({"param_space": {"base_lr": [1e-4, 1e-3]}})
STATE = json.dumps({"trial_data": [], "runner_data": {}})


def experiment(tmp_path, tuner=TUNER, states=(("2026-11-26_10-00-00", STATE),)):
    directory = tmp_path / "tune"
    directory.mkdir()
    if tuner is not None:
        (directory / "tuner.pkl").write_bytes(tuner)
    for stamp, text in states:
        (directory / f"experiment_state-{stamp}.json").write_text(text)
    return directory


def test_a_complete_state_and_a_new_sweep_are_kept(tmp_path):
    kept = experiment(tmp_path)
    assert unusable_tune_state(kept) is None and set_aside_unusable_tune_state(kept) is None and kept.is_dir()
    assert unusable_tune_state(tmp_path / "missing") is None  # nothing to restore: Tune starts a new experiment


@pytest.mark.parametrize("tuner, states, why", [
    (TUNER[:len(TUNER) // 2], (("2026-11-26_10-00-00", STATE),), "tuner.pkl is cut short"),
    (b"", (("2026-11-26_10-00-00", STATE),), "tuner.pkl is cut short"),
    (TUNER, (), "Tune had not saved its experiment state yet"),
    (TUNER, (("2026-11-26_10-00-00", STATE[:20]),), "experiment_state-2026-11-26_10-00-00.json is cut short"),
    (TUNER, (("2026-11-26_10-00-00", STATE), ("2026-11-26_11-00-00", "")),  # Tune reads the newest only
     "experiment_state-2026-11-26_11-00-00.json is cut short"),
])
def test_a_state_tune_could_not_restore_is_set_aside_whole(tmp_path, tuner, states, why):
    broken = experiment(tmp_path, tuner, states)
    files = {p.name: p.read_bytes() for p in broken.iterdir()}
    assert unusable_tune_state(broken) == why
    note = set_aside_unusable_tune_state(broken)
    [aside] = tmp_path.glob("tune.unusable-*")
    assert f"({why}: a save was cut short" in note and str(aside) in note and not broken.exists()
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == files


def test_a_grid_state_cut_by_a_full_disk_is_set_aside(tmp_path):
    """Tune's grid state (a pickle named .json) cut at a page, as a full disk leaves it; Tune would restore a trial
    with an empty config from it."""
    broken = experiment(tmp_path)
    grid = pickle.dumps({"iterators": list(range(2000))})
    (broken / "basic-variant-state-2026-11-26_09-00-00.json").write_bytes(grid)
    assert unusable_tune_state(broken) is None
    (broken / "basic-variant-state-2026-11-26_10-00-00.json").write_bytes(grid[:4096])
    assert unusable_tune_state(broken) == "basic-variant-state-2026-11-26_10-00-00.json is cut short"


def test_setting_aside_twice_keeps_both(tmp_path):
    for _ in range(2):
        set_aside_unusable_tune_state(experiment(tmp_path, tuner=b""))
    assert len(list(tmp_path.glob("tune.unusable-*"))) == 2
