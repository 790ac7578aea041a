"""Joining Ray: an address where no cluster answers, or one that is not a cluster's, is one line and exit 2 within
seconds (Ray itself retries for minutes, then raises a traceback), before the run directory is touched. The
refusal of a cluster with token authentication is tested against a real one in tests/test_jobs.py."""

from __future__ import annotations

import time

import pytest
from conftest import free_port, run_cli


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:{port}", "raydiff: error: no Ray cluster answers at "),
    ("http://127.0.0.1:{port}", "an http:// address is a dashboard's, for `ray job submit`"),
])
def test_a_ray_address_without_a_cluster_is_one_line_and_nothing_is_written(tmp_path, address, message):
    started = time.monotonic()
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path / 'runs'}",
                   env={"RAY_ADDRESS": address.format(port=free_port())})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr
    assert "RAY_ADDRESS=" in proc.stderr
    assert not (tmp_path / "runs").exists()
    assert time.monotonic() - started < 60  # not Ray's minutes of retries
