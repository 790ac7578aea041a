"""The benchmark commands print one JSON line with their numbers and the baseline's."""

from __future__ import annotations

import json

from conftest import run_cli


def test_checkpoint_bench_reports_size_time_and_baseline():
    proc = run_cli("raydiff.bench", "checkpoint", "--config", "smoke", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bench"] == "checkpoint" and result["parameters"] > 0
    # Full state = weights + EMA + two Adam moments (+ small extras): about 4x the bare weights.
    assert 3.9 < result["size_ratio"] < 4.5 and result["write_s"] > 0 and result["read_s"] > 0


def test_bench_rejects_bad_arguments():
    proc = run_cli("raydiff.bench", "checkpoint", "--repeat", "0")
    assert proc.returncode == 2 and "--repeat 0: must be >= 1" in proc.stderr
