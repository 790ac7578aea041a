"""The training loop: accumulation arithmetic in Ray Train's local mode and under DDP."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import ray.train
import torch
from ray.train.torch import TorchTrainer

from raydiff.config import load_config
from raydiff.data.image_store import ImageStore
from raydiff.model.weight_averages import ema_decay_at
from raydiff.storage.rundir import RunDir
from raydiff.training.loop import train_worker
from raydiff.training.worker_io import WorkerArgs

pytestmark = pytest.mark.ray


def fit_local(ray_session, storage, name, *overrides) -> ray.train.Result:
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    store = ImageStore(chunks=(ray_session.put(images),), counts=(20,), shape=(1, 8, 8), source="test")
    cfg = load_config("smoke", [f"run.storage={storage}", f"run.name={name}", "train.total_steps=4",
                                "train.global_batch=8", "scaling.num_workers=1", "train.sample_every=0",
                                "train.log_every=1", *overrides])
    return TorchTrainer(
        train_worker,
        train_loop_config={"args": WorkerArgs(config=cfg, images=store, run_dir=RunDir(storage / name),
                                              cpus_per_worker=1, invocation="test")},
        scaling_config=ray.train.ScalingConfig(num_workers=0),
        run_config=ray.train.RunConfig(name=name, storage_path=str(storage)),
    ).fit()


def run_local(ray_session, storage, name, *overrides):
    result = fit_local(ray_session, storage, name, *overrides)
    rows = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    return result.return_value.to_dict(), rows


def test_accumulation_computes_the_same_steps(ray_session, tmp_path):
    schedule = ("train.warmup_steps=1", "train.lr_decay=cosine")
    plain, plain_rows = run_local(ray_session, tmp_path, "plain", *schedule)
    accumulated, acc_rows = run_local(ray_session, tmp_path, "accumulated", *schedule, "train.micro_batch=2")
    assert plain["steps"] == accumulated["steps"] == 4 and plain["images_seen"] == 32
    assert [r["loss"] for r in acc_rows] == pytest.approx([r["loss"] for r in plain_rows], rel=1e-5)
    assert [r["grad_norm"] for r in acc_rows] == pytest.approx([r["grad_norm"] for r in plain_rows], rel=1e-5)
    # smoke: base_lr 1e-3 at batch 16, scaled linearly to the global batch of 8; one warmup step, then down a
    # half cosine over the 3 steps left.
    assert [r["lr"] for r in plain_rows] == pytest.approx([5e-4, 5e-4, 0.75 * 5e-4, 0.25 * 5e-4])
    # The EMA's first update copies the weights (a window of one step), then its window grows.
    assert [r["ema_decay"] for r in plain_rows] == [ema_decay_at(s, 0.99, 5) for s in range(4)]
    assert plain_rows[0]["ema_decay"] == 0.0


def test_a_profiled_run_trains_bit_for_bit_as_without_and_writes_its_profile(ray_session, tmp_path):
    from raydiff.runs.checkpoint import list_checkpoints, read_state

    plain, plain_rows = run_local(ray_session, tmp_path, "plain")
    profiled, profiled_rows = run_local(ray_session, tmp_path, "profiled", "log.profile_steps=[2,3]")
    assert profiled["steps"] == plain["steps"] == 4
    assert [r["loss"] for r in profiled_rows] == [r["loss"] for r in plain_rows]
    weights = [read_state(list_checkpoints(tmp_path / name)[-1])["model"] for name in ("plain", "profiled")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert sorted(p.name for p in (tmp_path / "profiled" / "profile").iterdir()) == [
        "steps_2-3.pt.trace.json.gz", "steps_2-3.txt"]
    assert not (tmp_path / "plain" / "profile").exists()


def test_a_profile_that_fails_leaves_the_run_training(ray_session, tmp_path, monkeypatch, caplog):
    from raydiff.training.profiling import StepProfile

    def no_room(self, step):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StepProfile, "end", no_room)  # Ray Train's local mode trains in this process
    result, rows = run_local(ray_session, tmp_path, "profiled", "log.profile_steps=[2,3]")
    assert result["steps"] == 4 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not (tmp_path / "profiled" / "profile").exists()
    assert "the profile of steps 2-3 failed (OSError: [Errno 28] No space left on device); training goes on" in (
        caplog.text)


def test_the_host_waits_for_the_device_only_at_steps_whose_pause_does_work(ray_session, tmp_path, monkeypatch):
    """A wait for the device at every step's pause would leave a GPU nothing queued; only the pauses that write a
    grid, check, checkpoint or validate (and so wait for the device anyway) start with one."""
    from raydiff.training import cadence

    steps, synced = [], []
    end_of_step = cadence.Cadence.end_of_step

    def counted_end_of_step(self, progress, *args, **kwargs):
        steps.append(progress.step)
        return end_of_step(self, progress, *args, **kwargs)
    monkeypatch.setattr(cadence.Cadence, "end_of_step", counted_end_of_step)
    monkeypatch.setattr(cadence, "synchronize", lambda device: synced.append(steps[-1]))
    result, rows = run_local(ray_session, tmp_path, "waits", "train.total_steps=12", "train.log_every=12",
                             "train.sample_every=5", "train.checkpoint_every=12")
    assert result["steps"] == 12 and [r["step"] for r in rows] == [12]
    # Grids at 5 and 10, a check at 10 (one pause: one wait), the end's grid and checkpoint at 12.
    assert synced == [5, 10, 12]


def _cli_run(storage, name, *overrides):
    from conftest import run_cli

    from raydiff.runs.checkpoint import list_checkpoints, read_state

    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={storage}", "--set", f"run.name={name}",
                   "--set", "train.total_steps=10", "--set", "train.sample_every=0", "--set", "train.log_every=2",
                   *[arg for o in overrides for arg in ("--set", o)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout + proc.stderr, rows, read_state(list_checkpoints(storage / name)[-1])


@pytest.mark.slow
def test_ddp_accumulation_and_uneven_shares_match_one_worker(tmp_path):
    """Under real DDP: 3 workers with uneven shares of the 16-image batch (6, 5, 5), each accumulating 2
    micro-batches (no_sync on the first) and checkpointing their activations, train the same steps as one worker."""
    # scaling.num_workers=auto: one worker per GPU, on a cluster without GPUs one worker with every CPU.
    one_log, one_rows, one = _cli_run(tmp_path, "one", "scaling.num_workers=auto")
    assert "on 1 (scaling.num_workers=auto) CPU worker(s)" in one_log
    # The three workers also recompute their activations in the backward pass: the same steps again.
    three_log, three_rows, three = _cli_run(tmp_path, "three", "scaling.num_workers=3", "train.micro_batch=4",
                                            "train.activation_checkpointing=true")
    assert "3 worker(s), global batch 16 = 6 on worker 0 in micro-batches of up to 4" in three_log
    assert "activation checkpointing on" in three_log
    assert [r["loss"] for r in three_rows] == pytest.approx([r["loss"] for r in one_rows], rel=1e-4)
    assert [r["grad_norm"] for r in three_rows] == pytest.approx([r["grad_norm"] for r in one_rows], rel=1e-3)
    for part in ("model", "ema"):
        for key, value in one[part].items():
            assert torch.allclose(three[part][key], value, rtol=1e-4, atol=1e-5), f"{part}.{key}"


def test_the_progress_line_s_eta_counts_from_a_rollback_not_over_the_rolled_back_steps(ray_session, tmp_path,
                                                                                       monkeypatch):
    """Started at step 5, then rolled back to a checkpoint of its own: the rows after the rollback count their rate
    from that checkpoint's step and the rollback's time (the ETA counted the rolled-back steps' time, and read many
    times too long)."""
    from raydiff.training import chief_records

    run_local(ray_session, tmp_path, "eta", "train.total_steps=5", "train.checkpoint_every=5")
    lines: list[tuple[int, int]] = []  # (the row's step, the step its ETA counts from), in order
    line = chief_records.progress_line
    monkeypatch.setattr(chief_records, "progress_line", lambda row, total, start_step, elapsed_s: (
        lines.append((row["step"], start_step)), line(row, total, start_step, elapsed_s))[1])
    result, _ = run_local(ray_session, tmp_path, "eta", "train.total_steps=16", "train.checkpoint_every=5",
                          "debug.nan_at_steps=[11,12,13]", "train.max_bad_steps=3")
    assert result["rollbacks"] == 1 and result["steps"] == 16
    events = [json.loads(line) for line in (tmp_path / "eta" / "events.jsonl").read_text().splitlines()]
    rollback = next(e for e in events if e["event"] == "rollback")
    assert rollback["to_step"] > 5  # a checkpoint of this start's
    # The rows up to the checkpoint rolled back to count from the start; the steps trained again, from it.
    assert lines == [(step, 5 if step <= rollback["to_step"] else rollback["to_step"]) for step, _ in lines], lines
    assert lines[-1][0] == 16 > rollback["to_step"]


def test_a_rollback_to_the_checkpoint_a_start_began_from_records_its_first_step_once(ray_session, tmp_path):
    """The first step of a start is recorded once (its seconds are the compilation's figure): a rollback to the
    start's own checkpoint recorded it again, its seconds counting the failed steps and the restore."""
    run_local(ray_session, tmp_path, "rolled", "train.total_steps=5", "train.checkpoint_every=5")
    result, _ = run_local(ray_session, tmp_path, "rolled", "train.total_steps=12", "train.checkpoint_every=5",
                          "debug.nan_at_steps=[6,7,8,9,10]", "train.max_bad_steps=3")
    events = [json.loads(line) for line in (tmp_path / "rolled" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("step", e.get("from_step"))) for e in events
            if e["event"] in ("first_step", "rollback")] == [("first_step", 1), ("first_step", 6), ("rollback", 10)]
    assert result["steps"] == 12 and result["rollbacks"] == 1


def test_a_run_that_diverges_reports_the_checkpoint_it_was_writing_and_the_streak_it_saw(ray_session, tmp_path):
    """The second divergence ended the run without settling the checkpoint being written: on storage, but never
    reported to Ray (the summary named an older one, and Ray's pruning never saw it). Its line gave the streak
    still running at the check (0 here: it ended two steps before), not the one found."""
    result = fit_local(ray_session, tmp_path, "diverging", "train.total_steps=40", "train.checkpoint_every=7",
                       "train.max_bad_steps=5", "debug.nan_at_steps=[15,16,17,18,19,20,22,23,24,25,26,27,28]")
    outcome = result.return_value.to_dict()
    assert outcome["status"] == "diverged"
    assert outcome["diagnostic"].startswith("training diverged: 7 non-finite steps in a row at step 30 ")
    on_storage = sorted(p.name for p in (tmp_path / "diverging").glob("checkpoint_*"))
    assert on_storage[-1] == "checkpoint_00000028"
    assert result.checkpoint is not None and result.checkpoint.path.endswith(on_storage[-1])


def test_a_run_whose_lease_was_lost_at_a_check_that_would_roll_back_writes_nothing_more(ray_session, tmp_path,
                                                                                         monkeypatch):
    """Another driver holds the run when a check finds the non-finite streak: the rollback, which cuts
    metrics.jsonl and writes its event, came before the workers agreed on the lost lease."""
    from raydiff.training import cadence
    from raydiff.training.distributed import INTERRUPTS

    run_local(ray_session, tmp_path, "taken", "train.total_steps=5", "train.checkpoint_every=5")
    rows_before = (tmp_path / "taken" / "metrics.jsonl").read_text()
    monkeypatch.setattr(cadence, "interrupt_asked",  # rank 0 (local mode: the only worker) learns it at step 10
                        lambda flag, is_chief, notice: INTERRUPTS.index("lease_lost"))
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    store = ImageStore(chunks=(ray_session.put(images),), counts=(20,), shape=(1, 8, 8), source="test")
    cfg = load_config("smoke", [f"run.storage={tmp_path}", "run.name=taken", "train.total_steps=12",
                                "train.global_batch=8", "scaling.num_workers=1", "train.sample_every=0",
                                "train.log_every=100", "train.checkpoint_every=5", "debug.nan_at_steps=[6,7,8,9,10]",
                                "train.max_bad_steps=3"])
    result = TorchTrainer(
        train_worker,
        train_loop_config={"args": WorkerArgs(config=cfg, images=store, run_dir=RunDir(tmp_path / "taken"),
                                              cpus_per_worker=1, invocation="test")},
        scaling_config=ray.train.ScalingConfig(num_workers=0),
        run_config=ray.train.RunConfig(name="taken", storage_path=str(tmp_path)),
    ).fit().return_value.to_dict()
    assert result["status"] == "lease_lost" and result["steps"] == 10 and result["rollbacks"] == 0
    events = [json.loads(line) for line in (tmp_path / "taken" / "events.jsonl").read_text().splitlines()]
    assert "rollback" not in {e["event"] for e in events}
    assert (tmp_path / "taken" / "metrics.jsonl").read_text() == rows_before


def test_a_rollback_refused_its_checkpoint_for_good_ends_the_run_in_one_line(ray_session, tmp_path, monkeypatch):
    """Permission to read the run's checkpoints lost mid-run: the rollback's read raised, Ray Train restarted the
    workers, and only the restarted set-up's restore said it in one line (after a restart of `run.max_failures`)."""
    from raydiff.runs import state as state_module

    run_local(ray_session, tmp_path, "refused", "train.total_steps=5", "train.checkpoint_every=5")
    real, reads = state_module.read_state, []

    def read_once(path):  # the start's restore reads; the rollback's is refused
        reads.append(path)
        if len(reads) > 1:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(state_module, "read_state", read_once)  # Ray Train's local mode trains in this process
    result, _ = run_local(ray_session, tmp_path, "refused", "train.total_steps=20", "train.checkpoint_every=100",
                          "debug.nan_at_steps=[6,7,8,9,10]", "train.max_bad_steps=3")
    assert len(reads) == 2
    assert (result["status"], result["steps"], result["rollbacks"]) == ("storage_failed", 10, 0)
    assert result["diagnostic"].startswith(f"storage {tmp_path / 'refused'}: reading the newest checkpoint failed: "
                                           f"permission denied"), result["diagnostic"]


def test_the_time_a_metrics_row_takes_to_write_is_not_the_next_rows_training_time(ray_session, tmp_path,
                                                                                   monkeypatch):
    """A row's dashboards (TensorBoard, MLflow or W&B over the network) and its EMA drift were timed in the next
    row's window, which read low: here a second to write each row, against steps of milliseconds."""
    from raydiff.training import cadence

    real = cadence.log_row

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)
    monkeypatch.setattr(cadence, "log_row", slow)  # Ray Train's local mode trains in this process
    _, rows = run_local(ray_session, tmp_path, "slow-rows")
    assert len(rows) == 4 and all(r["images_per_s"] > 8 / 0.5 for r in rows[1:]), [r["images_per_s"] for r in rows]


def test_a_preemption_notice_at_a_check_that_rolls_back_still_gets_its_checkpoint(ray_session, tmp_path):
    """The rollback branch agreed on the interrupts to see a lost lease, and so marked the preemption notice
    handled: the checkpoint it calls for was never written."""
    run_local(ray_session, tmp_path, "noticed", "train.total_steps=5", "train.checkpoint_every=5")
    result, _ = run_local(ray_session, tmp_path, "noticed", "train.total_steps=20", "train.checkpoint_every=100",
                          "debug.nan_at_steps=[6,7,8,9,10]", "train.max_bad_steps=3", "debug.preemption_from_step=10")
    events = [json.loads(line) for line in (tmp_path / "noticed" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("step", e.get("from_step"))) for e in events
            if e["event"] in ("rollback", "preemption_checkpoint")] == [("rollback", 10), ("preemption_checkpoint", 10)]
    assert result["steps"] == 20 and result["rollbacks"] == 1


def test_the_workers_of_a_paused_driver_stop_once_another_driver_holds_the_run(ray_session, s3_server, tmp_path):
    """A driver paused (Ctrl-Z) or cut off renews nothing and tells its workers nothing; on an object store its
    lease is taken over at the stale time while the workers train on. Rank 0 reads the lease itself: once another
    driver's invocation holds it, the workers stop at their next check, writing nothing more."""
    import threading

    from raydiff.training.stop import StopFlag

    endpoint, client = s3_server
    client.create_bucket(Bucket="raydiff-paused")
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    store = ImageStore(chunks=(ray_session.put(images),), counts=(20,), shape=(1, 8, 8), source="test")
    cfg = load_config("smoke", ["run.storage=s3://raydiff-paused/runs", f"run.endpoint={endpoint}",
                                "run.name=paused", "run.lease_stale_s=4", "train.total_steps=2000",
                                "train.global_batch=8", "scaling.num_workers=1", "train.sample_every=0",
                                "train.log_every=1000", "train.checkpoint_every=1000", "debug.step_delay_s=0.01"])
    flag = StopFlag.remote()  # type: ignore[attr-defined]  # the paused driver's: nothing asks it to stop
    ended = threading.Event()

    def take_over_once_training() -> None:  # once rank 0 has written its start event, and a second more
        while not ended.is_set() and "Contents" not in client.list_objects_v2(
                Bucket="raydiff-paused", Prefix="runs/paused/events.jsonl"):
            time.sleep(0.1)
        time.sleep(1.0)
        client.put_object(Bucket="raydiff-paused", Key="runs/.raydiff-leases/paused",
                          Body=json.dumps({"holder": {"host": "elsewhere", "pid": 7, "invocation": "another-driver"}}))

    takeover = threading.Thread(target=take_over_once_training, daemon=True)
    takeover.start()
    try:
        result = TorchTrainer(
            train_worker,
            train_loop_config={"args": WorkerArgs(config=cfg, images=store, cpus_per_worker=1, invocation="paused",
                                                  run_dir=RunDir("s3://raydiff-paused/runs/paused", endpoint=endpoint),
                                                  stop_flag=flag)},
            scaling_config=ray.train.ScalingConfig(num_workers=0),
            run_config=ray.train.RunConfig(name="paused", storage_path=str(tmp_path)),
        ).fit().return_value.to_dict()
    finally:
        ended.set()
    assert result["status"] == "lease_lost" and 0 < result["steps"] < 2000, result
    listed = client.list_objects_v2(Bucket="raydiff-paused", Prefix="runs/paused/").get("Contents", [])
    assert not any("checkpoint_" in entry["Key"] for entry in listed)  # nothing written after the takeover
    assert not any("/tensorboard/" in entry["Key"] for entry in listed)  # not even the dashboards' files
