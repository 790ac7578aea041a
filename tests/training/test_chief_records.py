"""What rank 0 records besides checkpoints: here the layout of the fixed-seed sample grid, and nothing recorded
for a run another driver took over (the records written through a run are checked by the CLI tests:
tests/test_train.py, tests/runs/test_fault_tolerance.py)."""

from __future__ import annotations

from types import SimpleNamespace

from raydiff.storage.rundir import RunDir
from raydiff.training import chief_records
from raydiff.training.chief_records import GRID_CLASSES, grid_labels, record_start
from raydiff.training.stop import LEASE_LOST


def test_an_unconditional_grid_has_no_labels_and_a_square_layout():
    assert grid_labels(0, 16) == (None, None)


def test_a_class_conditional_grid_has_one_row_per_class_in_class_order():
    labels, per_row = grid_labels(10, 64)
    assert per_row == 6  # 64 // 10: as many per row as sample_num allows
    assert labels == [c for c in range(10) for _ in range(6)]


def test_a_grid_of_many_classes_shows_the_first_ones_with_at_least_one_image_each():
    labels, per_row = grid_labels(1000, 8)
    assert per_row == 1
    assert labels == list(range(GRID_CLASSES))


def test_a_group_that_starts_after_the_run_was_taken_over_records_nothing(tmp_path, monkeypatch):
    """Ray Train may place a group just after another driver took the run over: its start would have written this
    driver's records over the other's, cut its metrics rows and removed its post-hoc EMA snapshots past the
    checkpoint restored. It writes nothing; the workers stop at their first check."""
    monkeypatch.setattr(chief_records, "stop_reason", lambda flag: LEASE_LOST)
    w = SimpleNamespace(run_dir=RunDir(str(tmp_path)), metrics_log=None, posthoc=None)
    record_start(w, SimpleNamespace(stop_flag=object(), records={"config.yaml": "mine"}), progress=None)
    assert list(tmp_path.iterdir()) == []
