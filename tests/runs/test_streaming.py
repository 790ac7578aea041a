"""Streamed data through the real CLI. A dataset five times bigger than the object store (a Ray cluster of its
own, 80 MB of store, no dashboard): auto picks stream mode, trains in the shard-aware order and spills nothing; memory
mode there is warned about; the missing dashboard is one warning for a run, and a sweep's one-line refusal. On the
digits: a run over many shuffle windows and an epoch boundary, resumed bit for bit in the layout it began with, and
a stream preparation that stops cleanly, holds its key alone, and cleans up after a kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, own_head, run_cli, wait_for
from test_fault_tolerance import assert_same_weights, final_state, losses, summary

from raydiff.data.order import SampleOrder
from raydiff.data.shard_format import write_prepared
from raydiff.data.sources import open_source
from raydiff.data.stream import MEMORY_SHARE

pytestmark = pytest.mark.ray

OBJECT_STORE = 80 * 2 ** 20
SHAPE = (1, 8, 8)  # the smoke preset's digits size: 64 bytes per image
NUM = 5 * OBJECT_STORE // 64  # 6.5M images, 400 MB decoded
ROWS_PER_SHARD = 64 * 1024  # 4 MB shards: 100 of them
TOTAL = 40
FAST = ["--config", "smoke", "--set", "train.checkpoint_every=10", "--set", "train.log_every=10",
        "--set", "train.sample_every=0", "--set", "run.keep_checkpoints=10", "--set", "log.tensorboard=false",
        "--set", f"train.total_steps={TOTAL}", "--set", "scaling.num_workers=1"]


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=own_head(num_cpus=2, object_store_memory=OBJECT_STORE,
                                                              include_dashboard=False))
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def big_data(tmp_path_factory) -> str:
    """400 MB of prepared 8x8 grayscale images (random pixels: the test is about bytes, not looks)."""
    from raydiff.data.builtin import write_synthetic

    folder = tmp_path_factory.mktemp("big")
    write_synthetic(folder / "raw", num=1, resolution=8)  # the prepared data's nominal source
    rng = np.random.default_rng(0)
    batches = ((rng.integers(0, 256, (min(ROWS_PER_SHARD, NUM - i), *SHAPE), dtype=np.uint8), [])
               for i in range(0, NUM, ROWS_PER_SHARD))
    write_prepared(batches, open_source(str(folder / "raw")), str(folder / "prepared"), shape=SHAPE,
                   rows_per_shard=ROWS_PER_SHARD)
    return str(folder / "prepared")


def _train(cluster, storage: Path, name: str, data: str, *extra: str, wait: bool = True):
    args = [sys.executable, "-m", "raydiff.train", *FAST, "--set", f"data.source={data}",
            "--set", f"run.storage={storage}", "--set", f"run.name={name}", *extra]
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    if wait:
        return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
                              stdin=subprocess.DEVNULL)
    log = open(storage / f"{name}.log", "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)


def _positions(run_dir: Path) -> dict[int, int]:
    """The order audit (debug.record_order): stream position -> sample index, over every worker and restart."""
    positions: dict[int, int] = {}
    for path in (run_dir / "order").iterdir():
        for record in map(json.loads, path.read_text().splitlines()):
            start, end = record["positions"]
            for position, index in zip(range(start, end), record["indices"], strict=True):
                assert positions.setdefault(position, index) == index  # a replayed position trains the same sample
    return positions


def test_auto_streams_a_dataset_bigger_than_the_object_store(small_cluster, big_data, tmp_path):
    reference = _train(small_cluster, tmp_path, "ref", big_data, "--set", "debug.record_order=true")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "data.cache auto: stream, from the decoded dataset (400 MB)" in reference.stdout, reference.stdout
    assert "object store (80 MB)" in reference.stdout
    # This cluster runs no dashboard: said once, where Ray Train's placement-group cleaner said it every second.
    assert reference.stdout.count("warning: this Ray cluster runs no dashboard") == 1, reference.stdout
    assert "State API may be temporarily unavailable" not in reference.stdout + reference.stderr

    # The order audit: every step trained on its stream positions of the shard-aware permutation.
    manifest = json.loads((Path(big_data) / "manifest.json").read_text())
    order = SampleOrder(manifest["count"], seed=0, shard_starts=np.cumsum([0, *manifest["shard_counts"]]),
                        window_shards=int(reference.stdout.split("shuffled in windows of ")[1].split(",")[0]))
    positions = _positions(tmp_path / "ref")
    assert sorted(positions) == list(range(TOTAL * 16))
    assert [positions[p] for p in range(TOTAL * 16)] == order.take(0, TOTAL * 16)[0].tolist()

    # Images kept on the device need them in memory: asked for where `auto` streams, one line before training.
    refused = _train(small_cluster, tmp_path, "on-device", big_data, "--set", "data.on_device=true")
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("raydiff:")]
    assert errors == ["raydiff: error: data.on_device = true: needs the images in memory, and this run streams them "
                      "(data.cache auto: stream): use data.on_device=auto or data.cache=memory"], refused.stderr[-3000:]
    assert "Traceback" not in refused.stdout + refused.stderr and "[raydiff] starting" not in refused.stdout

    # Nothing spilled to disk, allocated outside the object store, or left in it.
    stats = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "memory", "--stats-only", "--address",
                            small_cluster.address], capture_output=True, text=True, timeout=120)
    assert stats.returncode == 0, stats.stderr
    assert "Plasma memory usage 0 MiB" in stats.stdout, stats.stdout
    assert "Spilled" not in stats.stdout and "filesystem mmap" not in stats.stdout, stats.stdout


def test_a_sweep_on_a_cluster_without_the_dashboard_is_refused_in_one_line(small_cluster, tmp_path):
    """ASHA's stopped trials free their resources through the state API, which the dashboard serves: without it the
    next trial would wait for ever."""
    sweep = run_cli("raydiff.tune", "--config", "smoke", "--lr", "1e-4:1e-3", "--batch", "16", "--samples", "2",
                    "--budget-images", "320", "--name", "s", "--set", f"run.storage={tmp_path}",
                    "--set", "train.warmup_steps=1",  # a warmup and an EMA within ASHA's comparisons: no warning
                    "--set", "train.ema_decay=0.5", "--set", "train.ema_warmup_steps=0",  # line
                    env={"RAY_ADDRESS": small_cluster.address}, timeout=300)
    assert sweep.returncode == 2, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert sweep.stderr.strip().splitlines() == [
        "raydiff: config error: this Ray cluster has no state API (started without the dashboard): sweeps need it to "
        "free the resources of stopped trials; start Ray with the dashboard (the default of `ray start --head`, or "
        "pip install 'ray[default]')"], sweep.stderr[-3000:]
    assert "Traceback" not in sweep.stdout and "warning" not in sweep.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_memory_mode_that_does_not_fit_is_warned_about(small_cluster, big_data, tmp_path):
    proc = _train(small_cluster, tmp_path, "memory", big_data, "--set", "data.cache=memory", wait=False)
    try:
        log = tmp_path / "memory.log"
        line = wait_for(lambda: next((x for x in log.read_text().splitlines() if "warning: data.cache" in x), None),
                        timeout=120, what="the warning")
    finally:
        proc.kill()
        proc.wait()
    assert "400 MB" in line and "80 MB" in line and "set data.cache=stream" in line
    assert MEMORY_SHARE * OBJECT_STORE < 400 * 2 ** 20


DIGITS = ["--config", "smoke", "--set", "train.checkpoint_every=10", "--set", "train.log_every=10",
          "--set", "train.sample_every=0", "--set", "log.tensorboard=false", "--set", "debug.record_order=true"]
STREAMED = ["--set", "data.cache=stream", "--set", "data.stream_buffer_gb=0.0001",
            "--set", "data.stream_window_shards=2"]
EPOCH_AND_MORE = 130  # steps: 2,080 images, past the digits' first epoch (1,797), in windows of 2 small shards


def _digits(cluster, storage: Path, name: str, *extra: str, wait: bool = True):
    args = [sys.executable, "-m", "raydiff.train", *DIGITS, "--set", f"run.storage={storage}",
            "--set", f"run.name={name}", *extra]
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    if wait:
        return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL,
                              env=env)
    return subprocess.Popen(args, stdout=open(storage / f"{name}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            stdin=subprocess.DEVNULL, env=env)


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _quiet_files(folder: Path, quiet_s: float = 3.0) -> dict[Path, bytes]:
    """`_files` once nothing has changed for `quiet_s`: Ray ends a killed driver's workers asynchronously."""
    files, since = _files(folder), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.5)
        now = _files(folder)
        if now != files:
            files, since = now, time.monotonic()
    return files


@pytest.mark.slow
def test_a_streamed_run_crosses_windows_and_epochs_and_resumes_in_its_own_layout(cluster, tmp_path):
    """Streamed digits over many shuffle windows and an epoch boundary, in the shard-aware order; a driver killed
    mid-epoch is continued with data.cache=auto (memory for 0.1 MB, were it a new run) and another buffer: the
    run keeps the layout data.json recorded, and ends with the reference's weights and losses. A setting that
    contradicts the layout is refused in one line, changing nothing."""
    total = ["--set", f"train.total_steps={EPOCH_AND_MORE}"]
    reference = _digits(cluster, tmp_path, "ref", *STREAMED, *total)
    assert reference.returncode == 0, reference.stderr[-3000:]
    layout = json.loads((tmp_path / "ref" / "data.json").read_text())["layout"]
    assert layout["cache"] == "stream" and layout["window_shards"] == 2 and layout["shards"] >= 8
    manifest = json.loads(next((tmp_path / ".raydiff-stream").glob("*/manifest.json")).read_text())
    order = SampleOrder(1797, seed=0, shard_starts=np.cumsum([0, *manifest["shard_counts"]]), window_shards=2)
    images = EPOCH_AND_MORE * 16
    assert [_positions(tmp_path / "ref")[p] for p in range(images)] == order.take(0, images)[0].tolist()
    windows, position = 0, 0
    while position < images:
        position, windows = order.next_window(order.window_shards_at(position)[0]), windows + 1
    assert windows >= 6 and images > 1797  # several windows, and into the second epoch

    killed = _digits(cluster, tmp_path, "killed", *STREAMED, *total, wait=False)
    wait_for(lambda: (tmp_path / "killed" / "checkpoint_00000060" / "state.pt").exists(), what="a checkpoint")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    before = _quiet_files(tmp_path / "killed")  # once the killed driver's workers have stopped writing
    for change, named in ((["--set", "data.cache=memory"], "data.cache = 'stream', now 'memory'"),
                          (["--set", "data.stream_window_shards=1"], "shuffle windows of 2 shards, now")):
        refused = _digits(cluster, tmp_path, "killed", *change, *total)
        assert refused.returncode == 2 and named in refused.stderr and "Traceback" not in refused.stderr, \
            refused.stderr[-2000:]
    assert _files(tmp_path / "killed") == before

    rerun = _digits(cluster, tmp_path, "killed", "--set", "data.stream_buffer_gb=0.001", *total)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "data.cache auto: stream, as this run began (data.json)" in rerun.stdout
    assert json.loads((tmp_path / "killed" / "data.json").read_text())["layout"] == layout
    assert len(list((tmp_path / ".raydiff-stream").glob("*/manifest.json"))) == 1  # the same shards, not new ones
    run = summary(tmp_path / "killed")
    assert run["status"] == "finished" and run["resumed_from_step"] >= 60
    assert_same_weights(final_state(tmp_path / "killed"), final_state(tmp_path / "ref"))
    assert losses(tmp_path / "killed") == losses(tmp_path / "ref")


@pytest.mark.slow
def test_preparation_is_stoppable_exclusive_and_cleans_up_after_a_kill(cluster, tmp_path):
    """A raw source prepared for streaming: SIGTERM during the preparation stops the run at once and leaves no
    partial copy; a SIGKILL's partial copy is removed by the next preparation of the same key; and a run that
    finds another holding the key's lease waits for it, then prepares (or uses its copy)."""
    from raydiff.data.builtin import write_synthetic
    from raydiff.storage.lease import hold, this_process
    from raydiff.storage.rundir import RunDir

    write_synthetic(tmp_path / "raw", num=8000, resolution=16, fmt="png", seed=0)
    args = [sys.executable, "-m", "raydiff.train", *DIGITS, "--set", f"data.source={tmp_path / 'raw'}",
            "--set", "data.resolution=8", "--set", "data.cache=stream", "--set", "data.stream_buffer_gb=0.0001",
            "--set", "data.stream_window_shards=2", "--set", "train.total_steps=10", "--set", f"run.storage={tmp_path}",
            "--set", "scaling.num_workers=1"]
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    stream = tmp_path / ".raydiff-stream"

    def partial_copies() -> list[Path]:
        return [p for p in stream.glob(".*-*") if p.is_dir() and p.name != ".raydiff-leases"] if stream.exists() else []

    def start(log: str) -> subprocess.Popen:
        return subprocess.Popen(args, stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = start(f"{sig.name}.log")
        wait_for(lambda: any(p.glob("part-*.parquet") for p in partial_copies()), timeout=300,
                 what="a shard of the preparation")
        proc.send_signal(sig)
        proc.wait(timeout=120)
        log = (tmp_path / f"{sig.name}.log").read_text()
        assert not list(stream.glob("*/manifest.json")), log[-2000:]  # never a copy that looks complete
        if sig == signal.SIGTERM:
            assert proc.returncode == 143, log[-3000:]
            assert "raydiff: stopped by SIGTERM before training began" in log and "Traceback" not in log
            assert partial_copies() == []  # cleaned up on the way out
        else:
            assert len(partial_copies()) == 1  # a killed process cleans nothing

    # Another run holds the key's lease (it is preparing): this one waits, then prepares, cleaning the partial copy.
    key = next((stream / ".raydiff-leases").iterdir()).name
    with hold(RunDir(stream / key), this_process(), stale_s=60, what="the stream preparation"):
        proc = start("waits.log")
        wait_for(lambda: "waiting for another raydiff run" in (tmp_path / "waits.log").read_text(), timeout=120,
                 what="the wait")
        assert proc.poll() is None
    assert proc.wait(timeout=600) == 0, (tmp_path / "waits.log").read_text()[-3000:]
    assert partial_copies() == [] and len(list(stream.glob("*/manifest.json"))) == 1
