"""One live driver per run directory on a cluster: a second driver of a run is refused before it writes anything,
and a killed driver's claim goes with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli

from raydiff.runs.rundir import RunDir, RunInUse
from raydiff.training.claim import claim_run_dir, this_driver

pytestmark = pytest.mark.ray

HOLDER = """
import sys, time, ray
from raydiff.runs.rundir import RunDir
from raydiff.training.claim import claim_run_dir, this_driver
ray.init(address=sys.argv[1], logging_level="ERROR")
with claim_run_dir(RunDir(sys.argv[2]), this_driver("another driver")):
    print("claimed", flush=True)
    time.sleep(600)
"""


def test_a_second_driver_is_refused_until_the_first_is_gone(cluster, ray_session, tmp_path):
    run_dir = RunDir(tmp_path / "smoke")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, cluster.address, str(tmp_path / "smoke")],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        second = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}")
        assert second.returncode == 2, second.stderr[-3000:]
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith(f"raydiff: error: run directory {run_dir} is in use by another raydiff run on this "
                                f"Ray cluster (pid {holder.pid} on "), error
        assert "set run.name to start another run" in error and "Traceback" not in second.stderr
        assert not run_dir.exists()  # nothing written
    finally:
        holder.kill()  # as SIGKILL or an out-of-memory kill would: its claim must go with it
        holder.wait()
    with claim_run_dir(run_dir, this_driver("this test")):  # within the grace a dead driver's claim gets
        pass
    with (claim_run_dir(run_dir, this_driver("first")), pytest.raises(RunInUse, match=f"pid {os.getpid()} on "),
          claim_run_dir(run_dir, this_driver("second"), grace_s=0)):
        pass
