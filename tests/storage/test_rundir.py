"""Run directories on a local disk and on S3 (a real S3-compatible server on loopback), and the shared-storage
check for multi-node clusters."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, reserving, run_cli
from PIL import Image

from raydiff import cli, sample
from raydiff.runs.checkpoint import list_checkpoints, read_state
from raydiff.runs.runlog import JsonlLog
from raydiff.storage.rundir import RunDir


def _roundtrip(run: RunDir):
    assert run.is_empty() and not run.exists("a.txt")
    run.write_text("a.txt", "hello")
    run.write_bytes("samples/x.png", b"\x89PNG")
    assert run.read_text("a.txt") == "hello" and run.is_file("samples/x.png") and not run.is_empty()
    run.append_text("log.jsonl", "1\n")
    run.append_text("log.jsonl", "2\n")
    assert run.read_text("log.jsonl") == "1\n2\n"
    (run / "checkpoint_00000010").write_text("state.pt", "x")
    (run / "checkpoint_00000005").write_text("state.pt", "x")
    (run / "checkpoint_00000005").remove_all()
    assert [d.name for d in run.subdirs("checkpoint_")] == ["checkpoint_00000010"]
    log = JsonlLog(run, "metrics.jsonl")
    for step in (10, 20, 30):
        log.append({"step": step, "loss": float("nan") if step == 20 else 0.5})
    log.flush()
    log.truncate_after(20)
    log.flush()
    assert [r["step"] for r in JsonlLog(run, "metrics.jsonl").rows()] == [10, 20]
    assert JsonlLog(run, "metrics.jsonl").rows()[1]["loss"] is None  # NaN is written as null
    moved = run.parent / f"{run.name}.old"
    run.move_to(moved)
    assert run.is_empty() and moved.read_text("a.txt") == "hello"


def test_local_run_directory(tmp_path):
    _roundtrip(RunDir(tmp_path / "run"))
    assert RunDir(f"file://{tmp_path}/run").local == tmp_path / "run"


def test_s3_run_directory(s3_server):
    endpoint, client = s3_server
    client.create_bucket(Bucket="rundir-unit")
    run = RunDir("s3://rundir-unit/runs/one", endpoint=endpoint)
    assert run.remote and run.local is None
    _roundtrip(run)
    import pickle

    assert pickle.loads(pickle.dumps(run)).read_text.__self__.uri == run.uri


def test_check_writable_says_why_and_leaves_nothing(tmp_path, s3_server):
    RunDir(tmp_path / "new" / "run").check_writable()  # missing folders are fine: they would be created
    RunDir(tmp_path).check_writable()
    assert not list(tmp_path.iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="file is a file"):
        RunDir(tmp_path / "file" / "run").check_writable()

    endpoint, client = s3_server
    client.create_bucket(Bucket="rundir-writable")
    run = RunDir("s3://rundir-writable/runs/one", endpoint=endpoint)
    run.check_writable()
    objects = [o["Key"] for o in client.list_objects_v2(Bucket="rundir-writable").get("Contents", [])]
    assert run.is_empty() and all(key.endswith("/") for key in objects), objects  # the probe is gone (pyarrow
    # may leave an empty folder marker, which is no file)
    with pytest.raises(OSError, match="NoSuchBucket|not found|does not exist"):
        RunDir("s3://rundir-missing/runs/one", endpoint=endpoint).check_writable()


STEPS = ["--config", "smoke", "--set", "scaling.num_workers=1", "--set", "train.total_steps=40",
         "--set", "train.checkpoint_every=10", "--set", "train.sample_every=20", "--set", "train.log_every=10",
         "--set", "run.keep_checkpoints=10",
         # Streamed: the digits are prepared once into the run storage (S3 here), in 9 shards, and read from there.
         "--set", "data.cache=stream", "--set", "data.stream_buffer_gb=0.0001", "--set", "data.stream_window_shards=2"]


@pytest.mark.ray
@pytest.mark.slow
def test_s3_storage_train_kill_resume_is_identical(s3_server, ray_session, tmp_path):
    endpoint, client = s3_server
    client.create_bucket(Bucket="raydiff-runs")
    storage = ["--set", "run.storage=s3://raydiff-runs/runs", "--set", f"run.endpoint={endpoint}",
               "--set", "run.lease_stale_s=6"]
    from conftest import _cluster_address

    proc = subprocess.Popen([sys.executable, "-m", "raydiff.train", *STEPS, *storage], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env={**__import__("os").environ, "RAY_ADDRESS": _cluster_address})
    run = RunDir("s3://raydiff-runs/runs/smoke", endpoint=endpoint)
    deadline = time.time() + 300
    while not run.is_file("checkpoint_00000020/state.pt"):
        assert time.time() < deadline and proc.poll() is None, "no checkpoint in S3"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not run.is_file("summary.json")
    killed = json.loads(run.read_text("driver.json"))
    assert killed["pid"] == proc.pid and killed["requester"] in reserving(ray_session)  # left for 3 minutes

    rerun = run_cli("raydiff.train", *STEPS, *storage)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # The killed driver's lease stops being renewed: the re-run watches it, then takes it over.
    assert f"has the lease of a raydiff run (pid {proc.pid} on " in rerun.stdout
    assert "took over the lease" in rerun.stdout + rerun.stderr
    assert killed["requester"] not in reserving(ray_session)  # released by the re-run, long before Ray would
    summary = json.loads(run.read_text("summary.json"))
    assert "streamed from s3://raydiff-runs/runs/.raydiff-stream/" in rerun.stdout
    assert summary["status"] == "finished" and summary["steps"] == 40 and summary["resumed_from_step"] >= 20
    assert summary["checkpoint"] == "s3://raydiff-runs/runs/smoke/checkpoint_00000040"
    assert run.is_file("samples/step_00000040.png") and run.is_file("config.yaml")
    assert [r["step"] for r in JsonlLog(run, "metrics.jsonl").rows()] == [10, 20, 30, 40]

    reference = run_cli("raydiff.train", *STEPS, "--set", f"run.storage={tmp_path}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    a, b = read_state(list_checkpoints(run)[-1]), read_state(list_checkpoints(tmp_path / "smoke")[-1])
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert [r["loss"] for r in JsonlLog(run, "metrics.jsonl").rows()] == \
        [r["loss"] for r in JsonlLog(RunDir(tmp_path / "smoke"), "metrics.jsonl").rows()]

    # Sampled in this process (the command's own main): the same images from the bucket as from the local run.
    common = ["--num", "4", "--sampler", "ddim", "--steps", "5", "--device", "cpu"]
    assert cli.run(sample.main, ["--checkpoint", "s3://raydiff-runs/runs/smoke", "--endpoint", endpoint, *common,
                                 "--out", str(tmp_path / "s3.png")]) == 0
    assert cli.run(sample.main, ["--checkpoint", str(tmp_path / "smoke"), *common,
                                 "--out", str(tmp_path / "local.png")]) == 0
    assert np.array_equal(np.asarray(Image.open(tmp_path / "s3.png")), np.asarray(Image.open(tmp_path / "local.png")))


def test_checkpoints_on_gcs_are_listed_though_no_object_marks_their_folders(gcs_server, monkeypatch, tmp_path):
    """An upload leaves no folder marker on GCS, and pyarrow lists a GCS folder only where one marks it: a run's
    checkpoints there were written and never listed (no fallback to an older one; a changed config not refused;
    sample, evaluate and export found none)."""
    from raydiff.runs.checkpoint import CheckpointWriter, list_checkpoints, read_state
    from raydiff.storage import fs as storage_fs
    from raydiff.storage import rundir
    from raydiff.storage.rundir import RunDir

    endpoint, fs = gcs_server
    monkeypatch.setattr(rundir, "filesystem_for",  # the emulator takes no credentials
                        lambda uri, endpoint=None: storage_fs.filesystem_for(uri, endpoint=endpoint, anonymous=True))
    run = RunDir("gs://raydiff-gcs/runs/listed", endpoint=endpoint)
    writer = CheckpointWriter(run)
    for step in (10, 20):
        writer.start(f"checkpoint_{step:08d}", {"step": torch.tensor(step)})
        assert writer.outcome(wait=True) == (f"checkpoint_{step:08d}", None)
    writer.close()
    run.write_text("metrics.jsonl", "{}\n")
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_00000010", "checkpoint_00000020"]
    assert int(read_state(list_checkpoints(run)[-1])["step"]) == 20
    assert run.files() == ["metrics.jsonl"]
    list_checkpoints(run)[0].remove_all()  # as a start removes one Ray never kept
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_00000020"]


def test_a_run_folder_just_below_the_root_has_the_root_as_its_parent():
    """`/runs` had the current folder as its parent: its lease lived there, and two drivers started from two
    folders both held one."""
    from raydiff.storage.rundir import RunDir

    assert RunDir("/runs").parent == RunDir("/") and RunDir("/srv/runs/a").parent == RunDir("/srv/runs")
