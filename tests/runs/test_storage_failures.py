"""When storage fails, through the CLI: a full disk stops the run at once in one line and loses nothing (the next
run continues bit-identical once there is room), also where another job takes every byte freed, so that any of the
run's writers (Ray Train's own, TensorBoard's thread) may meet it first; storage without room for two checkpoints,
a read-only folder and a missing bucket are refused before anything is written; a flaky object store (503s and
dropped answers, and a request refused for longer than its retries last) is survived bit-identically."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time

import pytest
import torch
from conftest import run_cli, run_cli_acting
from disks import kept_full, tmpfs
from flaky_s3 import FlakyS3

from raydiff.runs.checkpoint import list_checkpoints, read_state
from raydiff.storage.fs import S3_RETRY_ATTEMPTS

SMOKE_40 = ["--config", "smoke", "--set", "train.total_steps=40", "--set", "train.checkpoint_every=5",
            "--set", "run.keep_checkpoints=100", "--set", "scaling.num_workers=1"]


def _train(storage: str, *extra: str):
    return run_cli("raydiff.train", *SMOKE_40, "--set", f"run.storage={storage}", *extra)


def _final_state(run_dir) -> dict:
    return read_state(list_checkpoints(run_dir)[-1])


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[part][k], b[part][k]) for part in ("model", "ema") for k in a[part])


def _error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("raydiff:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster) -> dict:
    """The final state of the same run, uninterrupted, on a local disk with room."""
    storage = tmp_path_factory.mktemp("reference")
    proc = _train(str(storage))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _final_state(storage / "smoke")


@pytest.mark.ray
@pytest.mark.slow
def test_a_full_disk_stops_the_run_at_once_in_one_line_and_loses_nothing(tmp_path, reference):
    with tmpfs(tmp_path / "disk", "12m") as disk:  # room for the start and about three checkpoints of 3 MB
        proc = _train(str(disk))
        output = proc.stdout + proc.stderr
        assert proc.returncode == 2, output[-3000:]
        [line] = _error_lines(proc)
        assert line.startswith(f"raydiff: error: storage {disk / 'smoke'}: writing the checkpoint of step ")
        assert "failed: no space left on device;" in line and " MB free, " in line
        assert "Nothing already saved was lost; free space there or set another run.storage" in line
        assert "Traceback" not in output and "WARNING" not in output
        run_dir = disk / "smoke"
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events].count("start") == 1  # no worker restart spent on it
        # Nothing half-written in sight: every checkpoint folder reads, and no partial one is left.
        folders = sorted(p.name for p in run_dir.iterdir() if "checkpoint_0" in p.name)
        newest = list_checkpoints(run_dir)
        assert folders == [c.name for c in newest] and len(newest) >= 2
        for checkpoint in newest:
            read_state(checkpoint)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["error"] == line.removeprefix("raydiff: error: ")
        assert line.endswith(f"({newest[-1].name})")

        # With room again, the same command continues from the newest checkpoint, as an uninterrupted run would.
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        again = _train(str(disk))
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"continuing at step {int(newest[-1].name[-8:])}" in again.stdout + again.stderr
        assert "WARNING" not in again.stdout + again.stderr
        assert _same_weights(_final_state(run_dir), reference)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("from_when", ["step 10", "checkpoint 10 whole"])
def test_a_disk_another_job_keeps_full_stops_the_run_in_one_line_without_a_traceback(tmp_path, reference,
                                                                                      from_when):
    """Another job takes every byte the moment it is free: from the tenth step's line (a log row or TensorBoard's
    writer thread meets it first), or from the moment a checkpoint is whole (Ray Train's own checkpoint list, written
    next, meets it). The run ends in one line, not a traceback, and the same command continues it once there is room,
    as an uninterrupted run would."""
    with tmpfs(tmp_path / "disk", "24m") as disk, contextlib.ExitStack() as filling:
        once = disk / "smoke" / "checkpoint_00000010" if from_when.startswith("checkpoint") else None
        code, output = run_cli_acting("raydiff.train", *SMOKE_40, "--set", f"run.storage={disk}",
                                      at="[raydiff] step 10/" if once is None else "[raydiff] starting",
                                      act=lambda _: filling.enter_context(kept_full(disk, once=once)))
        filling.close()
        assert code == 2, output[-3000:]
        [line] = [line for line in output.splitlines() if line.startswith("raydiff:")]
        assert line.startswith(f"raydiff: error: storage {disk / 'smoke'}: ") and "no space left on device" in line
        assert "Traceback" not in output and "Exception in thread" not in output, output[-5000:]

        again = _train(str(disk))
        assert again.returncode == 0, again.stderr[-3000:]
        assert "continuing at step" in again.stdout + again.stderr
        assert _same_weights(_final_state(disk / "smoke"), reference)


def test_storage_without_room_for_two_checkpoints_is_refused_before_anything_is_written(tmp_path):
    with tmpfs(tmp_path / "disk", "4m") as disk:  # a smoke checkpoint takes about 3.9 MB: two do not fit
        proc = _train(str(disk))
        assert proc.returncode == 2
        [line] = _error_lines(proc)
        assert line.startswith(f"raydiff: config error: run.storage = '{disk}': ") and "MB free on its file system, " \
            "and a checkpoint of this model takes about 3.9 MB: a run needs room for at least two (7.8 MB)" in line
        assert not any(disk.iterdir())


def test_storage_that_the_run_would_fill_before_its_end_is_a_warning_that_counts_what_it_adds(tmp_path, monkeypatch):
    """Two checkpoints is the least a run needs (refused below it); what it adds at its fullest (the checkpoints it
    keeps at once and the one being written, fewer where it writes fewer, and the post-hoc EMA's snapshots, which
    are never pruned) is said as a warning where it exceeds what is free: the disk may be freed meanwhile."""
    from raydiff.config import ConfigError, load_config
    from raydiff.runs.checkpoint import checkpoint_bytes
    from raydiff.training import driver

    def warning(free_mb: float, *overrides: str) -> str | None:
        cfg = load_config("smoke", [f"run.storage={tmp_path}", *overrides], check_source=False)
        monkeypatch.setattr(driver, "free_bytes", lambda path: int(free_mb * 1e6))
        return driver.check_room(cfg, driver.run_dir_of(cfg))

    each = checkpoint_bytes(load_config("smoke", check_source=False)) / 1e6  # about 3.9 MB
    with pytest.raises(ConfigError, match="a run needs room for at least two"):
        warning(1.9 * each)
    # smoke: 20 steps, a checkpoint every 10 (run.keep_checkpoints 3): two in all.
    assert warning(2.1 * each) is None
    forty = ("train.total_steps=40", "train.checkpoint_every=5")  # eight in all: three kept and the one written
    assert f"and the run adds up to {4 * each:.1f} MB (4 checkpoint(s) of about {each:.1f} MB): it may fill " in (
        warning(2.1 * each, *forty))
    assert warning(4.1 * each, *forty) is None
    posthoc = warning(4.1 * each, *forty, "train.ema=posthoc")  # a snapshot of two widths every 5 steps, 8 in all
    assert posthoc is not None and "and 8 post-hoc EMA snapshot(s) of " in posthoc
    # A class-conditional run's classes are not known before its data is read (was: a ValueError's traceback).
    assert "post-hoc EMA snapshot(s)" in warning(4.1 * each, *forty, "train.ema=posthoc", "data.labels=auto",
                                                 "model.num_classes=auto")
    # A run continued at step 35 of 40 writes one more (at 40), beside the three it keeps.
    for step in (25, 30, 35):
        (tmp_path / "smoke" / f"checkpoint_{step:08d}").mkdir(parents=True)
        (tmp_path / "smoke" / f"checkpoint_{step:08d}" / "state.pt").write_bytes(b"x")
    cfg = load_config("smoke", [f"run.storage={tmp_path}", *forty], check_source=False)
    assert driver.room_at_fullest(cfg, driver.run_dir_of(cfg), 1000) == (1000, "1 checkpoint(s) of about 0.0 MB")


def test_a_read_only_folder_is_refused_before_anything_is_written(tmp_path):
    with tmpfs(tmp_path / "read-only", "4m", read_only=True) as folder:
        proc = _train(str(folder))
        assert proc.returncode == 2
        [line] = _error_lines(proc)
        assert line == (f"raydiff: config error: run.storage = '{folder}': cannot write the run directory "
                        f"{folder / 'smoke'} (Read-only file system: {folder})")


def test_a_missing_bucket_is_refused_before_anything_is_written(s3_server):
    endpoint, client = s3_server
    proc = _train("s3://no-such-bucket/runs", "--set", f"run.endpoint={endpoint}")
    assert proc.returncode == 2
    [line] = _error_lines(proc)
    assert line == ("raydiff: config error: run.storage = 's3://no-such-bucket/runs': cannot write the run directory "
                    "s3://no-such-bucket/runs/smoke (the bucket does not exist: create the bucket or correct "
                    "run.storage)")
    assert "no-such-bucket" not in [b["Name"] for b in client.list_buckets()["Buckets"]]


@pytest.mark.ray
@pytest.mark.slow
def test_a_flaky_object_store_is_survived_bit_identically(s3_server, reference):
    """10% of requests answered with 503 SlowDown, or applied with the answer dropped (a retry goes through); and
    once, the step-15 checkpoint's first request refused beyond the retries: a worker fails, said in one line, and
    Ray Train restarts the workers from the newest checkpoint."""
    endpoint, client = s3_server
    client.create_bucket(Bucket="flaky")
    with FlakyS3(endpoint, rate=0.1, seed=0) as proxy:
        proxy.fail_next("", S3_RETRY_ATTEMPTS + 1, path_part="checkpoint_00000015")
        proc = _train("s3://flaky/runs", "--set", f"run.endpoint={proxy.endpoint}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proxy.counts["slow_down"] >= 5 + S3_RETRY_ATTEMPTS and proxy.counts["dropped"] >= 5, proxy.counts
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-5000:]
    [said] = [line.split("[raydiff] ", 1)[1] for line in output.splitlines() if "[raydiff] worker " in line]
    assert re.fullmatch(r"worker 0's storage kept failing beyond its retries \(OSError: .*checkpoint_00000015.*HTTP "
                        r"status 503.*\): restarting the workers from the newest checkpoint \(failure 1 of at most "
                        r"\d+, run.max_failures\)", said), said
    from raydiff.storage.rundir import RunDir

    assert _same_weights(_final_state(RunDir("s3://flaky/runs/smoke", endpoint=endpoint)), reference)


@pytest.mark.ray
def test_a_run_whose_lease_another_run_took_over_stops_without_writing_more(cluster, s3_server):
    """Another driver took the run's lease over (this one's renewals did not get through in time): at its next
    10-step check the run stops in one line, exit 2, with no final checkpoint, metrics rows or summary of its own
    written into the run directory the other driver now holds."""
    from raydiff.storage.lease import lease_of
    from raydiff.storage.rundir import RunDir

    endpoint, client = s3_server
    client.create_bucket(Bucket="taken")
    run_dir = RunDir("s3://taken/runs/smoke", endpoint=endpoint)
    key = lease_of(run_dir).uri.removeprefix("s3://taken/")

    def take_over(proc) -> None:
        client.put_object(Bucket="taken", Key=key, Body=json.dumps({"holder": {"host": "elsewhere", "pid": 1},
                                                                     "lease": "another run's"}))

    code, output = run_cli_acting(
        "raydiff.train", "--config", "smoke", "--set", "train.total_steps=100000", "--set",
        "train.checkpoint_every=100000", "--set", "scaling.num_workers=1", "--set", "run.storage=s3://taken/runs",
        "--set", f"run.endpoint={endpoint}", "--set", "run.lease_stale_s=4", at="[raydiff] starting:", act=take_over)
    assert code == 2, output[-3000:]
    [line] = [line for line in output.splitlines() if line.startswith("raydiff:")]
    assert re.fullmatch(r"raydiff: error: another raydiff run took over the run directory s3://taken/runs/smoke "
                        r"\(this one's lease was not renewed within run.lease_stale_s\): stopped at step \d+ without "
                        r"writing more; the other run continues it", line), line
    written = {entry["Key"] for entry in client.list_objects_v2(Bucket="taken").get("Contents", [])}
    assert not any("checkpoint_" in k or k.endswith(("summary.json", "metrics.jsonl")) for k in written), written
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.ray
def test_a_run_whose_lease_is_taken_over_while_it_waits_for_room_stops_at_once(cluster, s3_server):
    """Taken over while Ray Train waits for room for the workers (two of 2 CPUs each on this 2-CPU cluster; on an
    autoscaling one, GPU nodes that have not come): no worker would look at the stop flag before there is room,
    which may be never, so the driver stops at once, in one line, exit 2, writing nothing into the run."""
    from raydiff.storage.lease import lease_of
    from raydiff.storage.rundir import RunDir

    endpoint, client = s3_server
    client.create_bucket(Bucket="waiting")
    key = lease_of(RunDir("s3://waiting/runs/smoke", endpoint=endpoint)).uri.removeprefix("s3://waiting/")

    def take_over(proc) -> None:
        time.sleep(10)  # Ray Train's controller is scheduling the group by now
        client.put_object(Bucket="waiting", Key=key, Body=json.dumps({"holder": {"host": "elsewhere", "pid": 1},
                                                                       "lease": "another run's"}))
        kill = threading.Timer(90, proc.kill)  # a run that waited for room would wait for good
        kill.daemon = True
        kill.start()

    code, output = run_cli_acting(
        "raydiff.train", "--config", "smoke", "--set", "scaling.num_workers=2", "--set", "scaling.cpus_per_worker=2",
        # 8 s: a busy machine's moto answered renewals late enough for a 4 s lease to be given up (2 s unconfirmed)
        # before the takeover, the other way a lease ends
        "--set", "run.storage=s3://waiting/runs", "--set", f"run.endpoint={endpoint}", "--set", "run.lease_stale_s=8",
        at="training on 2 CPU worker(s)", act=take_over)
    assert code == 2, output[-3000:]
    assert ("[raydiff] the run's lease was taken over: no worker group runs (Ray Train is waiting for room on the "
            "cluster for one): stopping at once") in output
    [line] = [line for line in output.splitlines() if line.startswith("raydiff:")]
    assert line == ("raydiff: error: another raydiff run took over the run directory s3://waiting/runs/smoke (this "
                    "one's lease was not renewed within run.lease_stale_s) while no worker group of this one ran: "
                    "stopped without writing more; the other run continues it")
    written = {entry["Key"] for entry in client.list_objects_v2(Bucket="waiting").get("Contents", [])}
    # The other run's lease and Ray Train's storage check alone: no records, checkpoint, metrics or summary.
    assert {k for k in written if not k.endswith("/")} == {key, "runs/smoke/.validate_storage_marker"}, written
    assert "Traceback" not in output, output[-3000:]
