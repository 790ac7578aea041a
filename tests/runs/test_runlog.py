"""metrics.jsonl and events.jsonl: rows appended at once locally, cut back to a checkpoint after lost work, and
the progress line."""

from __future__ import annotations

import json
import math

import pytest

from raydiff.runs.runlog import JsonlLog, progress_line
from raydiff.storage.rundir import RunDir


def test_rows_are_appended_at_once_and_cut_back_to_a_step(tmp_path):
    log = JsonlLog(RunDir(tmp_path), "metrics.jsonl")
    for step in (10, 20, 30):
        log.append({"step": step, "loss": 1.0 / step})
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == step // 10  # tail -f works
    log.truncate_after(20)  # the work after checkpoint 20 was lost
    assert [r["step"] for r in log.rows()] == [10, 20]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [10, 20]


def test_a_non_finite_number_is_written_as_null_so_every_row_is_valid_json(tmp_path):
    log = JsonlLog(RunDir(tmp_path), "metrics.jsonl")
    log.append({"step": 1, "loss": math.nan, "grad_norm": math.inf})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": None, "grad_norm": None}


def test_the_run_s_summary_is_valid_json_with_non_finite_measurements_as_null(tmp_path):
    """A diverged validation (inf) and a quality measurement of NaN images were written as Infinity and NaN, which
    strict JSON readers refuse (metrics.jsonl's rows had them as null already; nested ones now too)."""
    import time

    from raydiff.config import load_config
    from raydiff.training.driver import _write_summary
    from raydiff.training.worker_io import WorkerResult, WorkerStatus

    result = WorkerResult(WorkerStatus.FINISHED, steps=20, images_seen=320, final_loss=0.1, val_loss=math.inf,
                          quality={"digits_fd": math.nan, "digits_coverage": 1.0})
    cfg = load_config("smoke", [f"run.storage={tmp_path}"])
    _write_summary(cfg, RunDir(tmp_path), "test", 0, result, None, None, time.perf_counter(), {})
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert summary["final_val_loss"] is None and summary["quality"] == {"digits_fd": None, "digits_coverage": 1.0}
    log = JsonlLog(RunDir(tmp_path), "metrics.jsonl")
    log.append({"step": 1, "quality": {"fid": math.nan}})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "quality": {"fid": None}}


def test_a_summary_of_workers_that_failed_to_set_up_keeps_the_run_s_counts(tmp_path):
    """Their result (0 steps: the restore failed) overwrote the summary with steps, images_seen and skipped_steps
    of 0 beside resumed_from_step 40; a run that failed without a result counted no rollback though its events
    record one."""
    import time

    from raydiff.config import load_config
    from raydiff.training.driver import _write_summary
    from raydiff.training.worker_io import WorkerResult, WorkerStatus

    cfg = load_config("smoke", [f"run.storage={tmp_path}"])
    run_dir = RunDir(tmp_path)
    JsonlLog(run_dir, "metrics.jsonl").append({"step": 40, "images_seen": 640, "loss": 0.2, "skipped_steps": 3})
    JsonlLog(run_dir, "events.jsonl").append({"event": "rollback", "from_step": 30, "to_step": 20})
    unread = WorkerResult(WorkerStatus.STORAGE_FAILED, steps=0, diagnostic="state.pt: permission denied")
    summary = _write_summary(cfg, run_dir, "test", 40, unread, None, None, time.perf_counter(), {})
    assert (summary["status"], summary["steps"], summary["images_seen"], summary["skipped_steps"]) == \
        ("storage_failed", 40, 640, 3)
    assert summary["rollbacks"] == 1 and summary["error"] == "state.pt: permission denied"
    assert _write_summary(cfg, run_dir, "test", 40, None, None, "lost", time.perf_counter(), {})["rollbacks"] == 1


def test_the_progress_line_counts_the_eta_from_this_start():
    row = {"step": 300, "loss": 0.04123, "images_per_s": 236.4, "data_wait_frac": 0.001}
    line = progress_line(row, total_steps=1000, start_step=200, elapsed_s=30.0)
    assert line == "[raydiff] step 300/1000 | loss 0.0412 | 236 img/s | data wait 0.1% | ETA 3m30s"
    assert progress_line({**row, "skipped_steps": 2}, 1000, 300, 0.0).endswith("| skipped 2 | ETA ?")
