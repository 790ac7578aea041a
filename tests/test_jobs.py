"""`ray job submit` against a real Ray head that the test starts: loopback only, free ports, its own temp dir,
token authentication on (the client presents the token). Only the processes the test started are stopped."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, TEST_ONLY_RAY_SETTINGS, free_port, processes_mentioning

from raydiff.runs.checkpoint import checkpoint_step, list_checkpoints

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def head():
    token = secrets.token_hex(32)
    temp_dir = tempfile.mkdtemp(prefix="rdh-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    dashboard, gcs = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in TEST_ONLY_RAY_SETTINGS}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PATH=f"{BIN}{os.pathsep}{env['PATH']}")
    # The session's other test cluster runs on this machine too: Ray processes that look a cluster up without
    # an address (Ray Train's placement-group cleaner) must find this one.
    head_env = {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}
    log = open(Path(temp_dir) / "head.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}",
         "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=head_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.time() + 120
    while True:
        try:
            request = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
            urllib.request.urlopen(request, timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError((Path(temp_dir) / "head.log").read_text()[-3000:]) from None
            time.sleep(0.5)
    try:
        yield {"address": address, "env": env, "token": token, "gcs": f"127.0.0.1:{gcs}", "temp_dir": temp_dir}
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the node it started...
        try:
            proc.wait(timeout=3)  # (one process after another, for longer than a test should wait)
        except subprocess.TimeoutExpired:
            pass  # ...or we do, below: its process group, then whatever else runs out of its temp dir
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its process group still there
        except ProcessLookupError:
            pass
        for pid in processes_mentioning(temp_dir):  # the head's own temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def failed(head, proc: subprocess.CompletedProcess) -> str:
    """What a failed `ray job` call printed, and the head's logs (`ray start --block` names a Ray process that
    died, and then stops the head; the dashboard's own): the test's temp dir is gone after it."""
    temp_dir = Path(head["temp_dir"])
    logs = [temp_dir / "head.log", *sorted(temp_dir.glob("session_latest/logs/dashboard*.*"))]
    return "\n".join([proc.stdout[-3000:] + proc.stderr[-3000:],
                      *(f"--- {log.name}:\n{log.read_text(errors='replace')[-2000:]}" for log in logs)])


def ray_job(head, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), "job", *args], capture_output=True, text=True, timeout=timeout,
                          env=head["env"], cwd=ROOT, stdin=subprocess.DEVNULL)


@pytest.fixture(autouse=True)
def _jobs_end_with_their_test(head):
    """Every job a test submits is stopped when the test ends: a job left running (a test that failed or timed
    out) would hold the head's CPUs, and the next test's job would wait for them."""
    yield
    for job_id in head.setdefault("jobs", []):  # through the REST API: a `ray job stop` per job takes seconds
        with contextlib.suppress(OSError):  # a job that never started is not there to stop
            job_api(head, f"{job_id}/stop", method="POST")
    head["jobs"].clear()


def submit(head, *entrypoint: str, runtime_env: dict | None = None, wait: bool = True, entrypoint_cpus: float = 0,
           timeout: float = 480) -> subprocess.CompletedProcess:
    """`ray job submit`; a job that outlives `timeout` (less than pytest's own, so that this, not pytest, says
    so) fails the test with its log's end."""
    job_id = f"raydiff-test-{secrets.token_hex(4)}"
    head.setdefault("jobs", []).append(job_id)
    extra = ["--runtime-env-json", json.dumps(runtime_env)] if runtime_env else []
    extra += ["--entrypoint-num-cpus", str(entrypoint_cpus)] if entrypoint_cpus else []
    try:
        return ray_job(head, "submit", "--address", head["address"], "--working-dir", str(ROOT), *extra,
                       "--submission-id", job_id, *([] if wait else ["--no-wait"]), "--", *entrypoint,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"job {job_id} still ran after {timeout:.0f} s; its log ends:\n{job_log(head, job_id)[-5000:]}")


def job_api(head, path: str, method: str = "GET") -> dict:
    """The job server's REST API (what `ray job` calls, without a process per call)."""
    request = urllib.request.Request(f"{head['address']}/api/jobs/{path}", method=method,
                                     headers={"Authorization": f"Bearer {head['token']}"})
    return json.loads(urllib.request.urlopen(request, timeout=30).read())


def job_log(head, job_id: str) -> str:
    return job_api(head, f"{job_id}/logs")["logs"]


def test_auth_is_on_a_client_without_the_token_is_refused(head):
    env = {k: v for k, v in head["env"].items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    home = str(Path(tempfile.mkdtemp()))
    command = [str(BIN / "ray"), "job", "list", "--address", head["address"]]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**env, "HOME": home}, cwd=ROOT)
    assert proc.returncode != 0
    # The same command with the token is answered: the refusal was the token's, not a wrong address's.
    with_token = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                env={**head["env"], "HOME": home}, cwd=ROOT)
    assert with_token.returncode == 0, with_token.stderr[-2000:]


def test_a_client_without_the_token_is_told_so_in_one_line_and_nothing_is_written(head, tmp_path):
    env = {k: v for k, v in head["env"].items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    env.update(RAY_ADDRESS=head["gcs"], HOME=str(tmp_path / "home"),  # no ~/.ray/auth_token either
               RAY_gcs_server_port_wait_time_s="2")  # Ray's own retries, before it gives up
    proc = subprocess.run([sys.executable, "-m", "raydiff.train", "--config", "smoke", "--set",
                           f"run.storage={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("raydiff: error: could not join the Ray cluster at ") and "RAY_AUTH_MODE=token" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "smoke").exists()


def test_a_command_joins_the_cluster_that_ray_start_left_its_address_for_and_waits_there_for_room_in_a_line(
        head, tmp_path):
    """After `ray start --head` on a machine, a command with no RAY_ADDRESS and no auth settings joins that head:
    Ray reads its address from RAY_TMPDIR/ray/ray_current_cluster (written by hand here, as `ray start` writes it
    under /tmp) and, for a cluster found that way, the token from ~/.ray/auth_token (an address passed on to
    ray.init would not load it and be refused). While another job holds the head's CPUs, the run's workers find no
    room: Ray Train gives up on them after its start timeout (60 s; 5 s here) and tries again, for as long as it
    takes, and its controller's traceback of each try is one raydiff line instead. Once the CPUs are free, the run
    trains to its end."""
    holder = submit(head, "python", "-c", "import time; time.sleep(600)", entrypoint_cpus=2, wait=False)
    assert holder.returncode == 0, failed(head, holder)
    holder_id = head["jobs"][-1]
    home, ray_tmp = tmp_path / "home", tmp_path / "tmp"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(head["token"])
    (ray_tmp / "ray").mkdir(parents=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(head["gcs"])
    env = {k: v for k, v in head["env"].items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmp), RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="5")
    proc = subprocess.Popen([sys.executable, "-m", "raydiff.train", "--config", "smoke", "--set",
                             f"run.storage={tmp_path / 'runs'}", "--set", "train.sample_every=0",
                             "--set", "scaling.num_workers=1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    too_long = threading.Timer(480, proc.kill)  # the holder sleeps 600 s: a run that never waits fails here
    too_long.start()
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "[raydiff] still waiting for room on the cluster for 1 worker: " in line and holder_id:
                job_api(head, f"{holder_id}/stop", method="POST")  # the CPUs come free
                holder_id = ""
        code = proc.wait()
    finally:
        too_long.cancel()
        proc.kill()
    output = "".join(lines)
    assert code == 0 and not holder_id, output[-3000:]
    port = head["gcs"].rpartition(":")[2]  # Ray names the head by the machine's address, not loopback
    assert re.search(rf"\[raydiff\] joined the Ray cluster at [\d.]+:{port}: ", output), output[-3000:]
    assert "[raydiff] waiting for room on the cluster for 1 worker: none for 5 s (its resources are in use, or " \
           "nodes are still being added); Ray Train tries again until there is" in output
    assert "Traceback" not in output and "Error in control loop iteration" not in output, output[-5000:]
    assert json.loads((tmp_path / "runs" / "smoke" / "summary.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_tune_job_succeeds(head, tmp_path):
    """A sweep of class-conditional runs submitted as a job, ranked by sample quality (--metric fid: the digits'
    Frechet distance at eval.guidance, measured at every validation point of every trial)."""
    proc = submit(head, "python", "-m", "raydiff.tune", "--config", "smoke", "--lr", "1e-4:1e-3", "--batch", "16",
                  "--samples", "2", "--budget-images", "320", "--name", "jobsweep", "--metric", "fid",
                  "--set", "eval.num=100", "--set", "eval.steps=5", "--set", f"run.storage={tmp_path}",
                  "--set", "data.labels=auto", "--set", "model.num_classes=auto",
                  "--set", "scaling.num_workers=1", "--set", "scaling.cpus_per_worker=2")
    assert proc.returncode == 0, failed(head, proc)
    rows = list(csv.DictReader((tmp_path / "jobsweep" / "results.csv").open()))
    assert len(rows) == 2 and all(float(r["digits_fd"]) > 0 for r in rows if r["status"] == "finished")
    summary = json.loads((tmp_path / "jobsweep" / "summary.json").read_text())
    assert summary["metric"] == "digits_fd" and summary["best"]["digits_fd"] > 0
    assert "digits_fd" in (tmp_path / "jobsweep" / "best.yaml").read_text().splitlines()[0]
    trial = tmp_path / "jobsweep" / "runs" / summary["best"]["trial"] / "metrics.jsonl"
    trial_rows = [json.loads(line) for line in trial.read_text().splitlines()]
    assert sum("digits_fd" in r for r in trial_rows) == sum("val_loss" in r for r in trial_rows) >= 8
    assert all(0 <= r["digits_class_match"] <= 1 for r in trial_rows if "digits_fd" in r)


@pytest.mark.slow
def test_job_stop_checkpoints_and_a_resubmitted_job_resumes_to_the_end(head, tmp_path):
    """A train job stopped by `ray job stop` writes a last checkpoint; the same job submitted again continues it
    and succeeds, in the head's cluster, with everything in the run's storage."""
    command = ["python", "-m", "raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}",
               "--set", "train.total_steps=150", "--set", "train.checkpoint_every=100", "--set", "train.log_every=10",
               "--set", "train.sample_every=0", "--set", "scaling.num_workers=1"]
    # Ray gives a stopped job 3 s before SIGKILL by default; raydiff needs a little longer for its last checkpoint.
    stop_env = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}
    started = submit(head, *command, "--set", "debug.step_delay_s=0.1", runtime_env=stop_env, wait=False)
    assert started.returncode == 0, failed(head, started)
    job_id = head["jobs"][-1]
    metrics = tmp_path / "smoke" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and any(json.loads(r)["step"] >= 30 for r in metrics.read_text().splitlines())):
        assert time.time() < deadline, job_log(head, job_id)[-3000:]
        time.sleep(0.5)
    stopped = ray_job(head, "stop", "--address", head["address"], job_id)
    assert stopped.returncode == 0, failed(head, stopped)
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["status"] == "stopped" and 30 <= summary["steps"] < 150
    assert checkpoint_step(list_checkpoints(tmp_path / "smoke")[-1]) == summary["steps"]  # the stop's checkpoint
    events = [json.loads(line) for line in (tmp_path / "smoke" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "stop_checkpoint" for e in events)

    again = submit(head, *command)
    assert again.returncode == 0, failed(head, again)
    assert "succeeded" in (again.stdout + again.stderr).lower()
    assert "[raydiff] joined the Ray cluster at" in again.stdout  # the head's cluster, not a Ray of its own
    resumed = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert resumed["status"] == "finished" and resumed["steps"] == 150
    assert resumed["resumed_from_step"] == summary["steps"]
    assert (tmp_path / "smoke" / "samples" / "step_00000150.png").exists()  # the end's grid, written by the job
