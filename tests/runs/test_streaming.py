"""A dataset five times bigger than the object store: auto picks stream mode, which trains, keeps the order,
resumes bit for bit after a driver kill, and leaves nothing spilled behind. Memory mode there is warned about.

Runs the real CLI against a Ray cluster of its own whose object store (80 MB) holds a fifth of the data.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from test_fault_tolerance import assert_same_weights, final_state, losses, summary, wait_for

from raydiff.data.order import SampleOrder
from raydiff.data.sources import open_source
from raydiff.data.stream import MEMORY_SHARE
from raydiff.prepare import write_prepared

pytestmark = pytest.mark.ray

OBJECT_STORE = 80 * 2 ** 20
SHAPE = (1, 8, 8)  # the smoke preset's digits size: 64 bytes per image
NUM = 5 * OBJECT_STORE // 64  # 6.5M images, 400 MB decoded
ROWS_PER_SHARD = 64 * 1024  # 4 MB shards: 100 of them
TOTAL = 40
FAST = ["--config", "smoke", "--set", "train.checkpoint_every=10", "--set", "train.log_every=10",
        "--set", "train.sample_every=0", "--set", "run.keep_checkpoints=10", "--set", "log.tensorboard=false",
        "--set", f"train.total_steps={TOTAL}"]


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": OBJECT_STORE,
                                                      "include_dashboard": False})
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def big_data(tmp_path_factory) -> str:
    """400 MB of prepared 8x8 grayscale images (random pixels: the test is about bytes, not looks)."""
    from raydiff.data.datasets import write_synthetic

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


def test_auto_streams_in_order_and_resumes_bit_identically(small_cluster, big_data, tmp_path):
    reference = _train(small_cluster, tmp_path, "ref", big_data, "--set", "debug.record_order=true")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "data.cache auto: stream, from the decoded dataset (400 MB)" in reference.stdout, reference.stdout
    assert "object store (80 MB)" in reference.stdout

    # The order audit: every step trained on its stream positions of the shard-aware permutation.
    manifest = json.loads((Path(big_data) / "manifest.json").read_text())
    order = SampleOrder(manifest["count"], seed=0, shard_starts=np.cumsum([0, *manifest["shard_counts"]]),
                        window_shards=int(reference.stdout.split("shuffled in windows of ")[1].split(",")[0]))
    positions: dict[int, int] = {}
    for path in (tmp_path / "ref" / "order").iterdir():
        for record in map(json.loads, path.read_text().splitlines()):
            start, end = record["positions"]
            for position, index in zip(range(start, end), record["indices"]):
                assert positions.setdefault(position, index) == index
    assert sorted(positions) == list(range(TOTAL * 16))
    assert [positions[p] for p in range(TOTAL * 16)] == order.take(0, TOTAL * 16)[0].tolist()

    # A driver killed after a checkpoint; the re-run ends with the same weights and losses. Checkpoints every 15
    # steps, metrics rows every 10: it resumes inside a logging window, whose sums must count once.
    proc = _train(small_cluster, tmp_path, "killed", big_data, "--set", "train.checkpoint_every=15", wait=False)
    wait_for(lambda: (tmp_path / "killed" / "checkpoint_00000015" / "state.pt").exists(), what="a checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    rerun = _train(small_cluster, tmp_path, "killed", big_data, "--set", "train.checkpoint_every=15")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    run = summary(tmp_path / "killed")
    assert run["status"] == "finished" and run["resumed_from_step"] in (15, 30)
    assert_same_weights(final_state(tmp_path / "killed"), final_state(tmp_path / "ref"))
    assert losses(tmp_path / "killed") == losses(tmp_path / "ref")

    # Nothing spilled to disk, allocated outside the object store, or left in it.
    stats = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "memory", "--stats-only", "--address",
                            small_cluster.address], capture_output=True, text=True, timeout=120)
    assert stats.returncode == 0, stats.stderr
    assert "Plasma memory usage 0 MiB" in stats.stdout, stats.stdout
    assert "Spilled" not in stats.stdout and "filesystem mmap" not in stats.stdout, stats.stdout


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


def _digits(cluster, storage: Path, *extra: str):
    return _train_with(cluster, storage, [*DIGITS, *extra])


def _train_with(cluster, storage: Path, args: list[str]):
    return subprocess.run([sys.executable, "-m", "raydiff.train", *args, "--set", f"run.storage={storage}"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, RAY_ADDRESS=cluster.address))


def test_a_continuing_run_keeps_the_layout_it_began_with(cluster, tmp_path):
    """data.json records the resolved mode, shards and windows; `auto` then keeps them (here it would choose
    memory for the digits), and a setting that contradicts them is refused in one line, changing nothing."""
    stream = ["--set", "data.stream_buffer_gb=0.0001", "--set", "data.stream_window_shards=2"]
    first = _digits(cluster, tmp_path, "--set", "data.cache=stream", *stream, "--set", "train.total_steps=20")
    assert first.returncode == 0, first.stderr[-3000:]
    layout = json.loads((tmp_path / "smoke" / "data.json").read_text())["layout"]
    assert layout["cache"] == "stream" and layout["window_shards"] == 2 and layout["shards"] > 4

    before = {p: p.read_bytes() for p in (tmp_path / "smoke").rglob("*") if p.is_file()}
    for change, named in ((["--set", "data.cache=memory"], "data.cache = 'stream', now 'memory'"),
                          (["--set", "data.stream_window_shards=1"], "shuffle windows of 2 shards, now")):
        refused = _digits(cluster, tmp_path, *change, "--set", "data.stream_buffer_gb=0.0001",
                          "--set", "train.total_steps=40")
        assert refused.returncode == 2 and named in refused.stderr and "Traceback" not in refused.stderr, \
            refused.stderr[-2000:]
    assert {p: p.read_bytes() for p in (tmp_path / "smoke").rglob("*") if p.is_file()} == before

    # Continued with data.cache=auto (memory for 0.1 MB of digits, were it a new run) and another buffer.
    more = _digits(cluster, tmp_path, "--set", "data.stream_buffer_gb=0.001", "--set", "train.total_steps=40")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "data.cache auto: stream, as this run began (data.json)" in more.stdout
    assert json.loads((tmp_path / "smoke" / "data.json").read_text())["layout"] == layout
    assert len(list((tmp_path / ".raydiff-stream").glob("*/manifest.json"))) == 1  # the same shards, not new ones
    order = SampleOrder(1797, seed=0, shard_starts=np.cumsum([0, *json.loads(next(
        (tmp_path / ".raydiff-stream").glob("*/manifest.json")).read_text())["shard_counts"]]), window_shards=2)
    positions = {}
    for path in (tmp_path / "smoke" / "order").iterdir():
        for record in map(json.loads, path.read_text().splitlines()):
            start, end = record["positions"]
            positions.update(zip(range(start, end), record["indices"]))
    assert [positions[p] for p in range(40 * 16)] == order.take(0, 40 * 16)[0].tolist()


def test_preparation_is_stoppable_exclusive_and_cleans_up_after_a_kill(cluster, tmp_path):
    """A raw source prepared for streaming: SIGTERM during the preparation stops the run at once and leaves no
    partial copy; a SIGKILL's partial copy is removed by the next preparation of the same key; and a run that
    finds another holding the key's lease waits for it, then prepares (or uses its copy)."""
    from raydiff.data.datasets import write_synthetic
    from raydiff.runs.lease import hold, this_process
    from raydiff.runs.rundir import RunDir

    write_synthetic(tmp_path / "raw", num=8000, resolution=16, fmt="png", seed=0)
    args = [sys.executable, "-m", "raydiff.train", *DIGITS, "--set", f"data.source={tmp_path / 'raw'}",
            "--set", "data.resolution=8", "--set", "data.cache=stream", "--set", "data.stream_buffer_gb=0.0001",
            "--set", "data.stream_window_shards=2", "--set", "train.total_steps=10", "--set", f"run.storage={tmp_path}"]
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
