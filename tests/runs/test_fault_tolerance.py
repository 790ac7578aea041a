"""A crash changes nothing: worker kills, corrupt checkpoints, NaNs, and elastic resizes (driver kills: the S3
and streaming tests).

Each test runs the real CLI against a multi-node Ray cluster built inside this machine with
`ray.cluster_utils.Cluster` (all nodes share the disk, so a local run.storage works) and compares the result
with an uninterrupted reference run, bit for bit where the issue demands it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, own_head, own_node, run_cli, wait_for
from sklearn.datasets import load_digits

from raydiff.config.schema import TrainSection
from raydiff.data.noise import dropped_labels
from raydiff.data.order import SampleOrder
from raydiff.runs.checkpoint import RAY_CHECKPOINT_LIST, checkpoint_order, list_checkpoints, read_state
from raydiff.runs.ema_snapshots import list_snapshots, snapshot_name
from raydiff.storage.rundir import RunDir

pytestmark = pytest.mark.ray

# Class-conditional (the digits' labels, the default label dropout): labels keep every guarantee the images have.
# Post-hoc EMA, with snapshots between checkpoints: a resumed run writes again the snapshots after its checkpoint.
# A cosine learning-rate decay: the rate is a function of the step, whatever restarts.
FAST = ["--config", "smoke", "--set", "train.checkpoint_every=10", "--set", "train.log_every=10",
        "--set", "train.sample_every=0", "--set", "run.keep_checkpoints=20", "--set", "data.labels=auto",
        "--set", "model.num_classes=auto", "--set", "train.ema=posthoc", "--set", "train.ema_snapshot_every=15",
        "--set", "train.lr_decay=cosine"]
TOTAL = 120


def train(cluster, storage: Path, name: str, *extra: str, total: int = TOTAL):
    return run_cli("raydiff.train", *FAST, "--set", f"run.storage={storage}", "--set", f"run.name={name}",
                   "--set", f"train.total_steps={total}", *extra, env={"RAY_ADDRESS": cluster.address})


def start_train(cluster, storage: Path, name: str, *extra: str, total: int = TOTAL) -> subprocess.Popen:
    log = open(storage / f"{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "raydiff.train", *FAST, "--set", f"run.storage={storage}", "--set", f"run.name={name}",
         "--set", f"train.total_steps={total}", *extra],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        env=dict(os.environ, RAY_ADDRESS=cluster.address))


def final_state(run_dir: Path) -> dict:
    return read_state(list_checkpoints(run_dir)[-1])


def assert_same_weights(a: dict, b: dict):
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), f"{part}.{key} differs"
    assert ("posthoc_ema" in a) == ("posthoc_ema" in b)
    averages = zip(a.get("posthoc_ema", {}).get("profiles", []), b.get("posthoc_ema", {}).get("profiles", []),
                   strict=True)
    for i, (average, other) in enumerate(averages):
        for key in average:
            assert torch.equal(average[key], other[key]), f"post-hoc average {i}: {key} differs"


def assert_same_snapshots(run_dir: Path, reference: Path):
    names = sorted(p.name for p in (reference / "ema_snapshots").iterdir())
    assert names == [f"step_{step:08d}.pt" for step in (*range(15, TOTAL + 1, 15),)]
    assert sorted(p.name for p in (run_dir / "ema_snapshots").iterdir()) == names
    for name in names:
        a, b = (torch.load(run / "ema_snapshots" / name, weights_only=True) for run in (run_dir, reference))
        assert a["step"] == b["step"] and a["sigma_rels"] == b["sigma_rels"] == [0.05, 0.1]
        for average, other in zip(a["profiles"], b["profiles"], strict=True):
            assert all(torch.equal(average[k], other[k]) for k in average), f"{name} differs"


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    storage = tmp_path_factory.mktemp("reference")
    proc = train(cluster, storage, "ref")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return storage / "ref"


def reference_until(reference: Path, step: int, run_dir: Path) -> Path:
    """The reference run as it stood at `step`: its later rows and checkpoints and Ray's bookkeeping left out."""
    run_dir.mkdir()
    for name in ("config.yaml", "data.json"):
        shutil.copy(reference / name, run_dir / name)
    for name in ("metrics.jsonl", "events.jsonl"):
        rows = [line for line in (reference / name).read_text().splitlines() if json.loads(line)["step"] <= step]
        (run_dir / name).write_text("".join(f"{row}\n" for row in rows))
    for checkpoint in list_checkpoints(reference):
        if checkpoint_order(checkpoint)[0] <= step:
            shutil.copytree(checkpoint.local, run_dir / checkpoint.name)
    return run_dir


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])  # the fields after the command name: state, ppid, ...


def _train_worker_pids(cluster) -> list[int]:
    """The Ray Train worker processes of `cluster`: descendants of its raylet. Another cluster's on this machine
    (the other test group's) are not this test's to kill."""
    raylet = cluster.head_node.all_processes["raylet"][0].process.pid
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ray::RayTrainWorker" not in (entry / "cmdline").read_bytes():
                    continue
                pid = int(entry.name)
                while pid > 1 and pid != raylet:
                    pid = _parent(pid)
                if pid == raylet:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_a_killed_a_stopped_and_a_hung_worker_restart_from_checkpoint_each_said_in_a_line_and_the_run_ends_identical(
        cluster, reference, tmp_path):
    # Worker 1's training thread hangs at step 100 (its process answers Ray); the steps are slowed down (numbers
    # unchanged) so that the faults land in that order.
    proc = start_train(cluster, tmp_path, "worker", "--set", "scaling.hang_timeout_s=10",
                       "--set", "debug.step_delay_s=0.05", "--set", "debug.hang_at_step=100")
    wait_for(lambda: (tmp_path / "worker" / "checkpoint_00000040" / "state.pt").exists(), what="a checkpoint")
    pids = wait_for(lambda: _train_worker_pids(cluster), what="worker processes")
    os.kill(pids[-1], signal.SIGKILL)
    # The restarted group's checkpoint, then one of its workers stops (a frozen process: alive, silent).
    wait_for(lambda: (tmp_path / "worker" / "checkpoint_00000080" / "state.pt").exists(), what="a later checkpoint")
    stopped = wait_for(lambda: [p for p in _train_worker_pids(cluster) if p not in pids], what="the new workers")[-1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
    run = summary(tmp_path / "worker")
    assert run["status"] == "finished" and run["steps"] == TOTAL and run["images_seen"] == TOTAL * 16
    assert run["restarts"] == 3
    assert_same_weights(final_state(tmp_path / "worker"), final_state(reference))
    assert losses(tmp_path / "worker") == losses(reference)
    assert_same_snapshots(tmp_path / "worker", reference)
    # What the terminal showed: a line for each loss, not the tracebacks it set off.
    log = (tmp_path / "worker.log").read_text()
    said = [line.split("[raydiff] ", 1)[1] for line in log.splitlines() if "[raydiff] worker " in line]
    assert len(said) == 3, log[-3000:]
    assert re.match(r"worker \d's process ended \(killed, out of memory, or its node was lost\)", said[0])
    assert re.match(r"worker \d (stopped answering for 10 s|waited 10 s) \(scaling.hang_timeout_s\)", said[1]), said
    assert said[2].startswith("worker 0 waited 10 s (scaling.hang_timeout_s) for a worker that never joined its "
                              "collective (a hung worker)"), said
    for failure, line in enumerate(said, 1):
        assert line.endswith(f"restarting the workers from the newest checkpoint (failure {failure} of at most 3, "
                             f"run.max_failures)"), said
    assert "Traceback" not in log, log[-3000:]


def test_a_worker_lost_with_no_restarts_left_ends_the_run_in_lines_that_name_it(cluster, tmp_path):
    proc = start_train(cluster, tmp_path, "gives_up", "--set", "run.max_failures=0", "--set", "debug.step_delay_s=0.1")
    wait_for(lambda: (tmp_path / "gives_up" / "checkpoint_00000010" / "state.pt").exists(), what="a checkpoint")
    os.kill(wait_for(lambda: _train_worker_pids(cluster), what="worker processes")[-1], signal.SIGKILL)
    assert proc.wait(timeout=300) == 1
    log = (tmp_path / "gives_up.log").read_text()
    lost = re.search(r"\[raydiff\] (worker \d's process ended \(killed, out of memory, or its node was lost\)): no "
                     r"restarts left \(run.max_failures = 0\): the run ends", log)
    assert lost, log[-3000:]
    run = summary(tmp_path / "gives_up")
    assert run["status"] == "failed" and run["error"] == lost.group(1)
    assert f"[raydiff] run failed at step {run['steps']}: {lost.group(1)}\n" in log
    assert "Traceback" not in log, log[-3000:]


def test_a_corrupt_newest_checkpoint_and_a_cut_ray_checkpoint_list_fall_back(cluster, reference, tmp_path):
    """What a driver killed mid-write leaves: a truncated checkpoint, and Ray Train's checkpoint list emptied (Ray
    rewrites it in place; it would refuse to start the run over it)."""
    run_dir = reference_until(reference, 100, tmp_path / "corrupt")
    newest = run_dir / "checkpoint_00000100" / "state.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    (run_dir / RAY_CHECKPOINT_LIST).write_text("")

    extended = train(cluster, tmp_path, "corrupt")  # continue to TOTAL steps
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert "checkpoint_00000100 is unreadable" in extended.stdout + extended.stderr
    assert f"removed Ray Train's checkpoint list {RAY_CHECKPOINT_LIST} (empty" in extended.stdout
    assert json.loads((run_dir / RAY_CHECKPOINT_LIST).read_text())["checkpoint_results"]  # Ray's new list
    starts = [json.loads(line) for line in (tmp_path / "corrupt" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["total_steps"]) for e in starts if e["event"] == "start"] == [(0, TOTAL), (90, TOTAL)]
    assert_same_weights(final_state(tmp_path / "corrupt"), final_state(reference))
    assert losses(tmp_path / "corrupt") == losses(reference)


def test_a_continued_run_removes_the_snapshots_of_work_it_does_not_keep_and_the_checkpoints_ray_never_kept(
        cluster, reference, tmp_path):
    """A run killed at step 95 whose newest checkpoint was lost, continued from step 60's with a smaller
    train.total_steps: the post-hoc snapshots of steps 75 and 90 are of work that no longer exists, which a
    rebuild (`raydiff.ema`, the newest snapshot by default) would mix with the run's own. They go, in a note.
    Ray Train's list names only the checkpoints of steps 50 and 60 (those of 10 to 40 were never reported to it),
    and the run keeps 3: those past the newest 3 go too, as Ray's pruning would have removed them."""
    run_dir = reference_until(reference, 60, tmp_path / "shorter")
    listed = json.loads((reference / RAY_CHECKPOINT_LIST).read_text())  # the reference's, cut to steps 50 and 60
    kept = [(r, i) for r, i in zip(listed["checkpoint_results"], listed["checkpoint_report_indices"], strict=True)
            if r["checkpoint_dir_name"] in ("checkpoint_00000050", "checkpoint_00000060")]
    listed.update(checkpoint_results=[r for r, _ in kept], checkpoint_report_indices=[i for _, i in kept],
                  latest_checkpoint_result=kept[-1][0], current_report_index=kept[-1][1] + 1)
    (run_dir / RAY_CHECKPOINT_LIST).write_text(json.dumps(listed))
    (run_dir / "ema_snapshots").mkdir()
    for step in (15, 30, 45, 60, 75, 90):
        shutil.copy(reference / snapshot_name(step), run_dir / snapshot_name(step))

    shorter = train(cluster, tmp_path, "shorter", "--set", "run.keep_checkpoints=3", total=70)
    assert shorter.returncode == 0, shorter.stderr[-3000:]
    assert ("[raydiff] note: removed the post-hoc EMA snapshots of step(s) 75, 90: of work after step 60, where "
            "the run continues (it writes its own as it goes)") in shorter.stdout + shorter.stderr
    assert list_snapshots(RunDir(str(run_dir))) == [15, 30, 45, 60, 70]
    assert ("[raydiff] removed checkpoint_00000010, checkpoint_00000020, checkpoint_00000030: never reported to "
            "Ray Train") in shorter.stdout
    assert [c.name for c in list_checkpoints(run_dir)] == ["checkpoint_00000040", "checkpoint_00000050",
                                                           "checkpoint_00000060", "checkpoint_00000070"]
    for step in (15, 30, 45, 60):  # the run's own, kept as they were
        assert (run_dir / snapshot_name(step)).read_bytes() == (reference / snapshot_name(step)).read_bytes()


@pytest.fixture(scope="module")
def nan_and_preemption(cluster, tmp_path_factory):
    """One run with two independent faults, each test reading its own: non-finite losses at steps 3, 4 and 12,
    and a preemption notice that arrives at step 20 and stays (periodic checkpoints off: the notice's and the
    end's are the only ones); a validation every 5 steps, between the 10-step checks. Returns (run directory, the
    CLI's output)."""
    storage = tmp_path_factory.mktemp("faults")
    proc = train(cluster, storage, "faults", "--set", "debug.nan_at_steps=[3,4,12]",
                 "--set", "debug.preemption_from_step=20", "--set", "train.checkpoint_every=100",
                 "--set", "data.val_images=16", "--set", "train.val_every=5", total=40)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return storage / "faults", proc.stdout + proc.stderr


def test_nan_steps_are_skipped_counted_and_never_checkpointed(nan_and_preemption):
    run_dir, output = nan_and_preemption
    run = summary(run_dir)
    assert run["status"] == "finished" and run["skipped_steps"] == 3 and run["rollbacks"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # A row between the 10-step checks (a validation's, every 5 steps) counts as of its own step.
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(5, 2), (10, 2), (15, 3), (20, 3), (25, 3), (30, 3),
                                                              (35, 3), (40, 3)]
    for checkpoint in list_checkpoints(run_dir):
        state = read_state(checkpoint)
        assert all(torch.isfinite(v).all() for part in ("model", "ema") for v in state[part].values())
    assert "skipped 3" in output


def test_one_checkpoint_per_preemption_notice(nan_and_preemption):
    # One checkpoint at once, not one at every check after it (steps 30 and 40).
    run_dir, _ = nan_and_preemption
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "preemption_checkpoint"] == [20]
    assert [c.name for c in list_checkpoints(run_dir)] == ["checkpoint_00000020", "checkpoint_00000040"]


def poisoned_samples(steps: list[int], global_batch: int = 16) -> list[int]:
    """One dataset index trained at each of these steps (epoch 0 of the smoke run's stream)."""
    order = SampleOrder(1797, seed=0)
    return [int(order.take((step - 1) * global_batch + 3, 1)[0][0]) for step in steps]


def test_a_persistent_fault_is_rolled_back_past(cluster, tmp_path):
    # Samples that make the loss non-finite whenever they are trained: replaying the same steps from the last
    # checkpoint would fail again; the rollback moves on past their stream positions and the run recovers.
    poisoned = ",".join(map(str, poisoned_samples([12, 13, 14])))
    proc = train(cluster, tmp_path, "poisoned", "--set", f"debug.nan_at_samples=[{poisoned}]",
                 "--set", "train.max_bad_steps=3", "--set", "debug.record_order=true", total=40)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = summary(tmp_path / "poisoned")
    assert run["status"] == "finished" and run["steps"] == 40 and run["rollbacks"] == 1 and run["skipped_steps"] == 3
    events = [json.loads(line) for line in (tmp_path / "poisoned" / "events.jsonl").read_text().splitlines()]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    # Streaks are read at the 10-step checks: at step 20 the run goes back to step 10's checkpoint and skips the
    # stream positions of steps 11-20.
    assert [(e["from_step"], e["to_step"], e["skipped_positions"]) for e in rollbacks] == [(20, 10, [160, 320])]
    # After the rollback, step 11 trains on the positions of step 21: the failed positions are never trained again.
    trained = [json.loads(line) for path in (tmp_path / "poisoned" / "order").iterdir()
               for line in path.read_text().splitlines()]
    assert {tuple(r["positions"]) for r in trained if r["step"] == 11} >= {(320, 328), (328, 336)}
    assert max(r["positions"][1] for r in trained) == (40 + 10) * 16
    for checkpoint in list_checkpoints(tmp_path / "poisoned"):
        state = read_state(checkpoint)
        assert all(torch.isfinite(v).all() for part in ("model", "ema") for v in state[part].values())


def test_divergence_stops_with_a_diagnostic(cluster, tmp_path):
    proc = train(cluster, tmp_path, "diverge", "--set", "train.lr=1e30", "--set", "train.warmup_steps=0",
                 "--set", "train.lr_decay=none", "--set", "train.max_bad_steps=3", total=40)
    assert proc.returncode == 1
    run = summary(tmp_path / "diverge")
    assert run["status"] == "diverged" and run["steps"] < 40
    assert "training diverged" in run["error"] and "loss by timestep" in run["error"] and "lr 1e+30" in run["error"]
    assert "training diverged" in proc.stderr


@pytest.mark.slow
def test_elastic_resize_of_streamed_data_keeps_global_batch_and_epoch_order(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    # After a node is lost, Ray Train may first try the old size until its resource view catches up; let that
    # attempt time out in 10 s instead of 60 (the cluster's processes inherit this environment).
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    c = Cluster(initialize_head=True, head_node_args=own_head(num_cpus=0, include_dashboard=False))
    try:
        c.add_node(**own_node(c, num_cpus=1))
        c.wait_for_nodes()
        # Ray notices a new node within one tick of its autoscaling coordinator (20 s): slow the tiny model down
        # so the run outlives a grow and a shrink.
        total = 800
        proc = subprocess.Popen(
            [sys.executable, "-m", "raydiff.train", *FAST, "--set", f"run.storage={tmp_path}",
             "--set", f"train.total_steps={total}", "--set", "scaling.num_workers=[1,2]",
             "--set", "scaling.cpus_per_worker=1", "--set", "scaling.resize_check_s=1",
             "--set", "debug.record_order=true", "--set", "debug.step_delay_s=0.04", "--set", "run.max_failures=5",
             # Streamed, in 9 small shards shuffled two at a time: each node's cache actor comes and goes with it.
             "--set", "data.cache=stream", "--set", "data.stream_buffer_gb=0.0001",
             "--set", "data.stream_window_shards=2"],
            stdout=open(tmp_path / "elastic.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=ROOT, env=dict(os.environ, RAY_ADDRESS=c.address))
        metrics = tmp_path / "smoke" / "metrics.jsonl"

        def rows():
            return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

        wait_for(lambda: any(r["step"] >= 20 for r in rows()), what="training on one worker")
        extra = c.add_node(**own_node(c, num_cpus=1))
        wait_for(lambda: any(r["world_size"] == 2 for r in rows()), what="the resize to two workers")
        c.remove_node(extra)
        assert proc.wait(timeout=600) == 0, (tmp_path / "elastic.log").read_text()[-3000:]
    finally:
        c.shutdown()

    run_dir = tmp_path / "smoke"
    run = summary(run_dir)
    assert run["status"] == "finished" and run["steps"] == total and run["images_seen"] == total * 16
    starts = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    sizes = [e["world_size"] for e in starts if e["event"] == "start"]
    assert sizes[0] == 1 and 2 in sizes and sizes[-1] == 1 and run["world_sizes"] == [1, 2]
    assert all(r["images_seen"] == r["step"] * 16 for r in rows())

    # Every step trained on exactly its 16 stream positions, whatever the world size, and the stream is
    # the (seed, epoch) shard-aware permutation: no image twice and none skipped within an epoch.
    positions: dict[int, int] = {}
    labels: dict[int, int] = {}  # the class each position trained with: 10 (the null class) where dropped
    for path in (run_dir / "order").iterdir():
        for record in map(json.loads, path.read_text().splitlines()):
            start, end = record["positions"]
            for position, index, label in zip(range(start, end), record["indices"], record["labels"], strict=True):
                assert positions.setdefault(position, index) == index  # replays after a restart agree
                assert labels.setdefault(position, label) == label
    assert sorted(positions) == list(range(total * 16))
    manifest = json.loads(next((tmp_path / ".raydiff-stream").glob("*/manifest.json")).read_text())
    assert len(manifest["shards"]) > 4  # several windows per epoch
    expected, _ = SampleOrder(1797, seed=0, shard_starts=np.cumsum([0, *manifest["shard_counts"]]),
                              window_shards=2).take(0, total * 16)
    assert [positions[p] for p in range(total * 16)] == expected.tolist()
    for epoch in range(total * 16 // 1797):
        assert sorted(positions[p] for p in range(epoch * 1797, (epoch + 1) * 1797)) == list(range(1797))
    digit_of = load_digits().target
    dropped = dropped_labels(0, 0, total * 16, TrainSection().label_dropout).tolist()
    assert [labels[p] for p in range(total * 16)] == [
        10 if drop else int(digit_of[positions[p]]) for p, drop in enumerate(dropped)]
    assert math.isfinite(run["final_loss"])


@pytest.mark.slow
def test_precision_and_weight_decay_may_change_between_runs(cluster, reference, tmp_path):
    # fp32 (the reference run at step 10) -> fp16 (no loss scale in the checkpoint: it starts afresh) -> bf16 (the
    # fp16 loss scale is dropped), each run continuing the last. The bf16 run also all-reduces its gradients in
    # bf16 (train.grad_compression), which a run may switch on and off: it is not part of the training state.
    # The new weight decay is the one the optimizer holds when the run ends (its first step after a resume: the
    # restore test of tests/runs/test_state.py).
    first = final_state(reference_until(reference, 10, tmp_path / "precision"))
    assert first["step"] == 10 and not first["scaler"]
    assert {g["weight_decay"] for g in first["optimizer"]["param_groups"]} == {0.0}
    chain = [("fp16", 0.05, 20), ("bf16", 0.0, 30)]
    for precision, weight_decay, total in chain:
        compression = "bf16" if precision == "bf16" else "none"
        proc = train(cluster, tmp_path, "precision", "--set", f"train.precision={precision}",
                     "--set", f"train.weight_decay={weight_decay}", "--set", f"train.grad_compression={compression}",
                     total=total)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"gradient compression {compression}" in proc.stdout + proc.stderr  # DDP's comm hook registered
        run = summary(tmp_path / "precision")
        assert run["status"] == "finished" and run["steps"] == total
        assert run["resumed_from_step"] == total - 10
        state = final_state(tmp_path / "precision")
        assert state["step"] == total
        assert {g["weight_decay"] for g in state["optimizer"]["param_groups"]} == {weight_decay}
        assert bool(state["scaler"]) == (precision == "fp16")  # a loss scale only while training in fp16
        if precision == "fp16":
            assert "loss scale starts afresh" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "precision" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30] and all(math.isfinite(r["loss"]) for r in rows)


def test_the_flat_all_reduce_and_images_gathered_on_the_device_continue_a_ddp_run_bit_identically(cluster, reference,
                                                                                                   tmp_path):
    """Two other ways through a DDP step, taken together in one run (each changes nothing the other touches):
    `train.allreduce: flat` (the all-reduce that lets CUDA graphs replay several workers' steps) averages as DDP
    does, and `data.on_device: true` (on a CPU: the images in one tensor of the worker's, gathered by the training
    thread, no loader thread) trains as the loader thread does, class ids and label dropout included. The
    reference run's last 20 steps, continued so, end bit-identical to the reference's."""
    run_dir = reference_until(reference, 100, tmp_path / "other-step")
    proc = train(cluster, tmp_path, "other-step", "--set", "train.allreduce=flat", "--set", "data.on_device=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all-reduce flat" in proc.stdout + proc.stderr
    assert re.search(r"; data on the cpu \([0-9.]+ MB\); compile off", proc.stdout + proc.stderr)
    assert summary(run_dir)["resumed_from_step"] == 100
    assert_same_weights(final_state(run_dir), final_state(reference))
    assert losses(run_dir) == losses(reference)


@pytest.mark.slow
def test_no_restorable_checkpoint_is_refused_and_nothing_is_lost(cluster, reference, tmp_path):
    run_dir = reference_until(reference, 20, tmp_path / "broken")
    (run_dir / ".validate_storage_marker").touch()  # what Ray Train writes at a run's first start
    for checkpoint in list_checkpoints(run_dir):
        state_file = checkpoint.local / "state.pt"
        state_file.write_bytes(state_file.read_bytes()[:1000])
    # Nothing at all changes, not even the records of a start (config.yaml, data.json, driver.json): the workers
    # decide before anything is written.
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    proc = train(cluster, tmp_path, "broken", total=30)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("raydiff: error:")]
    assert len(error_lines) == 1 and "Traceback" not in proc.stderr
    assert "checkpoint_00000020 (" in error_lines[0] and "checkpoint_00000010 (" in error_lines[0]
    assert "will not start over" in error_lines[0]
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before  # records, metrics, events, summary and checkpoints untouched; no new checkpoint
