"""Joining Ray: an address where no cluster answers, or one that is not a cluster's, is one line and exit 2 within
seconds (Ray itself retries for minutes, then raises a traceback), before the run directory is touched. The
refusal of a cluster with token authentication, and the join of one found through `ray start`'s address file, are
tested against a real one in tests/test_jobs.py. A local Ray instance that a command starts is its processes'
own, whatever else runs on the machine, and outside the command's process group: a signal to the group (`timeout`)
stops the command after its final checkpoint, and the instance with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port, processes_mentioning, run_cli, run_cli_acting, wait_for

from raydiff import cli
from raydiff.cluster.errors import RayUnreachable
from raydiff.cluster.start import check_ray_address, init_ray


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


@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1:notaport", "port 'notaport' is not a number from 1 to 65535"),  # was: int()'s ValueError, traceback
    (":{port}", "no host before ':{port}'"),  # was: Ray's logged traceback before the line
    ("http://127.0.0.1", "a URL, not host:port"),  # was: int()'s ValueError on '//127.0.0.1'
])
def test_a_malformed_ray_address_is_one_line_naming_it_before_ray_reads_it(tmp_path, address, problem):
    port = free_port()
    address, problem = address.format(port=port), problem.format(port=port)
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path / 'runs'}",
                   env={"RAY_ADDRESS": address})
    assert proc.returncode == 2, proc.stderr[-3000:]
    hint = "; an http:// address is a dashboard's, for `ray job submit`" if address.startswith("http") else ""
    assert proc.stderr.splitlines() == [f"raydiff: error: RAY_ADDRESS={address}: {problem}; expected the cluster's "
                                        f"host:port, auto or local{hint}"], proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


def test_a_malformed_address_left_by_ray_start_is_one_line_naming_its_file(tmp_path, monkeypatch):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:notaport")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    with pytest.raises(RayUnreachable) as refused:
        check_ray_address()
    assert str(refused.value) == (f"left by `ray start` in {tmp_path / 'ray' / 'ray_current_cluster'}: port "
                                  f"'notaport' is not a number from 1 to 65535; expected the cluster's host:port, "
                                  f"auto or local")


def test_ray_address_auto_without_a_cluster_on_this_machine_is_one_line(monkeypatch):
    """Ray's lookup raises ConnectionError there (an OSError that no disk check claims): a traceback. Ray's
    lookup is made to find nothing, as a machine without a Ray instance does (this one runs the tests')."""
    import raydiff.cluster.start

    def nothing_running(address):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(raydiff.cluster.start, "canonicalize_bootstrap_address", nothing_running)
    with pytest.raises(RayUnreachable) as refused:
        check_ray_address()
    assert str(refused.value) == ("RAY_ADDRESS=auto: no running Ray cluster found on this machine; start one "
                                  "(`ray start --head`), or unset RAY_ADDRESS to start a local Ray instance")


def test_an_address_that_a_stopped_ray_start_left_behind_is_one_line_naming_its_file(tmp_path):
    """Without RAY_ADDRESS a command joins the cluster whose address the last `ray start` wrote (RAY_TMPDIR/ray/
    ray_current_cluster); a head stopped other than by `ray stop` leaves the file behind. The error names the file
    and how to forget it, not RAY_ADDRESS, which the user never set."""
    address_file = tmp_path / "ray" / "ray_current_cluster"
    address_file.parent.mkdir()
    port = free_port()
    address_file.write_text(f"127.0.0.1:{port}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "raydiff.train", "--config", "smoke", "--set",
                           f"run.storage={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**env, "RAY_TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert proc.stderr.startswith("raydiff: error: no Ray cluster answers at ") and f":{port} (" in proc.stderr
    assert f"left by `ray start` in {address_file}" in proc.stderr and f"remove {address_file} (`ray stop` does)" \
        in proc.stderr and "RAY_ADDRESS" not in proc.stderr
    assert not (tmp_path / "runs").exists()


# A command ends the Ray connection it made as its last step (Ray's exit hook would first wait half a second),
# and never one its caller made.
ENDS_ITS_OWN = """
import ray
from raydiff import cli
from raydiff.cluster.start import init_ray
assert cli.run(lambda argv: init_ray() or 0, []) == 0
print("still connected:", ray.is_initialized())
"""


@pytest.mark.ray
def test_a_command_leaves_the_ray_connection_it_made(cluster):
    proc = subprocess.run([sys.executable, "-c", ENDS_ITS_OWN], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, RAY_ADDRESS=cluster.address), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "joined the Ray cluster at" in proc.stdout and "still connected: False" in proc.stdout


@pytest.mark.ray
def test_a_command_leaves_its_caller_s_ray_connection_open(ray_session):
    assert cli.run(lambda argv: init_ray() or 0, []) == 0
    assert ray_session.is_initialized()


@pytest.mark.ray
def test_a_local_run_beside_another_ray_instance_trains_and_a_signal_to_its_process_group_stops_it_cleanly(
        cluster, tmp_path, short_path):
    """A command with RAY_ADDRESS=local starts a Ray instance of its own while another runs on this machine (the
    test group's cluster). Ray Train's placement-group cleaner (which looks every second) looks its cluster up
    without an address: it must still find its own, not fail on finding two, nor take the run's controller for
    dead and remove the workers (docs/training.md#which-ray).

    `timeout`, `kill -TERM -PGID` and schedulers signal a command's whole process group. The local Ray instance
    that the command started is not in it: the command gets the signal, writes its final checkpoint, and stops the
    instance itself. (In the group, the instance stopped at once; the command waited a minute for it and failed.)"""
    instance: list[int] = []

    def signal_the_group(proc: subprocess.Popen) -> None:
        instance.extend(processes_mentioning(str(short_path)))  # the local instance's (its temp dir is theirs)
        os.killpg(proc.pid, signal.SIGTERM)

    code, output = run_cli_acting(
        "raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}", "--set", "scaling.num_workers=1",
        "--set", "train.sample_every=0", "--set", "train.total_steps=2000", at="[raydiff] step 10/",
        act=signal_the_group, own_process_group=True, env={"RAY_ADDRESS": "local", "RAY_TMPDIR": str(short_path)})
    assert code == 128 + signal.SIGTERM, output[-3000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["restarts"] == 0, output[-3000:]
    assert "started a local Ray instance" in output
    assert "Token authentication is enabled" not in output  # Ray's notice, which says how to turn it off
    assert "Found multiple active Ray instances" not in output and "placement group was removed" not in output
    assert summary["checkpoint"].endswith(f"checkpoint_{summary['steps']:08d}")
    assert f"[raydiff] stopped at step {summary['steps']} (SIGTERM) after a final checkpoint" in output
    assert "Traceback" not in output and "Failed to connect to GCS" not in output, output[-3000:]
    assert len(instance) >= 3
    # The instance's processes end with the command (its agents just after).
    wait_for(lambda: processes_mentioning(str(short_path)) == [], timeout=10, what="the local instance to end")
