"""The real CLI on a local Ray cluster with 2 workers (smoke preset): outputs, sampling, bad input."""

from __future__ import annotations

import json
import math
import platform
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import yaml
from conftest import run_cli, run_cli_acting, run_cli_interrupted
from PIL import Image

from raydiff import cli, sample, train
from raydiff.runs.checkpoint import checkpoint_step, list_checkpoints, read_state

METRIC_KEYS = {"step", "images_seen", "loss", "grad_norm", "lr", "ema_decay", "images_per_s", "data_wait_frac",
               "world_size", "loss_q1", "loss_q2", "loss_q3", "loss_q4", "ema_drift"}
QUALITY_KEYS = {"digits_fd", "digits_coverage", "digits_confident", "eval_s"}
SUMMARY_KEYS = {"status", "steps", "images_seen", "final_loss", "checkpoint", "world_sizes", "wall_s"}


@pytest.mark.ray
def test_a_successful_run_prints_no_error_lines(smoke_run):
    """A newcomer reads an error-level line as a failure: a run that succeeds prints none (Ray's own included)."""
    _, output = smoke_run
    error_lines = [line for line in output.splitlines()
                   if re.search(r"\[\d{4}-\d\d-\d\d [\d:,.]+ E \d+ \d+\]|\bERROR\b|Traceback", line)]
    assert error_lines == []


@pytest.mark.ray
def test_run_directory_has_every_output(smoke_run):
    run_dir, output = smoke_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["total_steps"] == 20 and config["scaling"]["num_workers"] == 2

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    for row in rows:
        assert METRIC_KEYS <= row.keys()
        assert row["images_seen"] == row["step"] * 16 and row["world_size"] == 2
        assert math.isfinite(row["loss"]) and row["images_per_s"] > 0 and 0 <= row["data_wait_frac"] < 1
    assert rows[-1]["loss"] < rows[0]["loss"]
    # Quality (eval.every=10, at_end) at steps 10 and 20; the loss per timestep quarter and the EMA's drift in every
    # row.
    assert [r["step"] for r in rows if QUALITY_KEYS <= r.keys()] == [10, 20]
    assert all(0 < r["ema_drift"] < 1 for r in rows) and rows[-1]["loss_q1"] > rows[-1]["loss_q4"]
    assert 0 <= rows[-1]["digits_coverage"] <= 1 and rows[-1]["digits_fd"] > 0

    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_00000010.png", "step_00000020.png"]

    # log.profile_steps: rank 0's trace and table of steps 3-7, its figures in events.jsonl, one line.
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["steps_3-7.pt.trace.json.gz", "steps_3-7.txt"]
    assert (run_dir / "profile" / "steps_3-7.txt").read_text().startswith(
        "# raydiff's training loop on rank 0, steps 3-7 on cpu: ")
    profiles = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                if e["event"] == "profile"]
    assert len(profiles) == 1 and profiles[0]["steps"] == [3, 7] and profiles[0]["wall_ms_per_step"] > 0
    assert "[raydiff] profiled steps 3-7: " in output

    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["status"] == "finished" and summary["steps"] == 20 and summary["images_seen"] == 320
    assert summary["world_sizes"] == [2] and summary["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert summary["checkpoint"].endswith("checkpoint_00000020")
    assert summary["quality"] == {k: rows[-1][k] for k in summary["quality"]}
    assert QUALITY_KEYS <= summary["quality"].keys()

    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["checkpoint_00000010", "checkpoint_00000020"]
    state = read_state(checkpoints[-1])
    assert {"model", "ema", "optimizer", "scaler", "step", "images_seen", "config", "counters"} <= state.keys()
    assert state["step"] == 20 and state["images_seen"] == 320

    assert "step 20/20 | loss" in output and "img/s" in output and "ETA" in output
    assert f"results:    {run_dir}" in output

    # TensorBoard (on by default): the same rows as scalars, the grids, the config and the summary.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    assert [e.step for e in board.Scalars("loss")] == [5, 10, 15, 20]
    assert [e.value for e in board.Scalars("digits_fd")] == pytest.approx([r["digits_fd"] for r in rows[1::2]])
    assert [e.step for e in board.Images("samples")] == [10, 20] and board.Images("samples")[0].width >= 512
    assert {"config/text_summary", "summary/text_summary"} <= set(board.Tags()["tensors"])
    assert "quality:    step 20, 200 images (ddim, 10 steps, seed 0): digits_fd " in output


@pytest.mark.ray
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's allocator's")
def test_cpu_workers_start_with_their_freed_host_memory_kept(smoke_run):
    """Ray starts the workers' processes with the allocator settings (`train.keep_host_memory: auto` on CPUs); each
    worker says what its own process got."""
    run_dir, output = smoke_run
    starts = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    speeds = [event["speed"] for event in starts if event["event"] == "start"]
    assert speeds and all("host memory kept" in speed for speed in speeds)
    assert "host memory kept" in output


@pytest.mark.ray
def test_sample_cli_grid_folder_and_determinism(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    common = ["--checkpoint", str(run_dir), "--sampler", "ddim", "--steps", "10", "--num", "16"]
    proc = run_cli("raydiff.sample", *common, "--seed", "0", "--out", str(tmp_path / "a.png"))
    assert proc.returncode == 0, proc.stderr
    # Image i is a pure function of (seed, i): another --batch gives the same images.
    again = run_cli("raydiff.sample", *common, "--seed", "0", "--batch", "5", "--out", str(tmp_path / "b.png"))
    other = run_cli("raydiff.sample", *common, "--seed", "1", "--out", str(tmp_path / "c.png"))
    assert again.returncode == other.returncode == 0
    a, b, c = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in "abc")
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # Same sampler, steps, seed and count as the run's own final grid: the same image.
    assert np.array_equal(a, np.asarray(Image.open(run_dir / "samples" / "step_00000020.png")))

    folder = run_cli("raydiff.sample", "--checkpoint", str(list_checkpoints(run_dir)[0]), "--num", "3",
                     "--sampler", "ddpm", "--steps", "25", "--no-ema", "--out", str(tmp_path / "folder"))
    assert folder.returncode == 0, folder.stderr
    names = sorted(p.name for p in (tmp_path / "folder").iterdir())
    assert names == ["grid.png", "sample_00000.png", "sample_00001.png", "sample_00002.png"]
    assert Image.open(tmp_path / "folder" / "sample_00000.png").size == (8, 8)


def test_a_missing_metrics_package_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """A Ray job whose pip list lacks torch-fidelity used to train to the end and fail at the final evaluation."""
    import sys

    monkeypatch.setitem(sys.modules, "torch_fidelity", None)  # as if not installed
    code = cli.run(train.main, ["--config", "smoke", "--set", "eval.at_end=true", "--set", f"run.storage={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("raydiff: error: eval.every / eval.at_end needs torch-fidelity") and "pip list" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.ray
def test_commands_fall_back_from_a_checkpoint_being_written(smoke_run, tmp_path):
    """sample, export and evaluate on a run whose newest checkpoint is still being written (a partial state.pt)
    use the newest one that reads, and name the other in one line."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run[0], run_dir)
    newest = run_dir / "checkpoint_00000020" / "state.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    commands = {
        "raydiff.sample": ["--num", "2", "--sampler", "ddim", "--steps", "2", "--out", str(tmp_path / "s.png")],
        "raydiff.export": ["--out", str(tmp_path / "exported")],
        "raydiff.evaluate": ["--num", "20", "--steps", "2"],
    }
    for module, args in commands.items():
        proc = run_cli(module, "--checkpoint", str(run_dir), *args)
        assert proc.returncode == 0, (module, proc.stderr[-3000:])
        warnings = [line for line in proc.stderr.splitlines() if "cannot be read" in line]
        assert len(warnings) == 1 and "checkpoint_00000020" in warnings[0], (module, proc.stderr)
        assert "step 10" in proc.stdout + proc.stderr, (module, proc.stdout)


@pytest.mark.ray
def test_ctrl_c_during_training_stops_after_a_final_checkpoint(cluster, tmp_path):
    """Ctrl-C (SIGINT to the command) asks the run for a final checkpoint, as SIGTERM does: Ray Train's own
    handler would abort the run without one and exit 1 with nothing printed."""
    code, output = run_cli_interrupted(
        "raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}", "--set", "train.total_steps=1000",
        "--set", "train.sample_every=0", "--set", "debug.step_delay_s=0.05", "--set", "scaling.num_workers=1",
        at="[raydiff] step 20/")
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert "SIGINT: stopping after a final checkpoint (Ctrl-C again to stop at once)" in output
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["status"] == "stopped" and 20 <= summary["steps"] < 1000, output[-3000:]
    assert checkpoint_step(list_checkpoints(tmp_path / "smoke")[-1]) == summary["steps"]  # the stop's checkpoint
    assert f"stopped at step {summary['steps']} (SIGINT) after a final checkpoint" in output


@pytest.mark.ray
def test_a_second_ctrl_c_stops_at_once_and_frees_the_run_once_its_workers_have_ended(cluster, tmp_path):
    """A second Ctrl-C ends the run without its final checkpoint; the run directory's lease is let go once Ray
    Train's workers have ended (rank 0 may be writing until then), and the same command continues the run."""
    from raydiff.storage.lease import hold
    from raydiff.storage.rundir import RunDir

    def press_twice(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)

    args = ["--config", "smoke", "--set", f"run.storage={tmp_path}", "--set", "train.total_steps=1000",
            "--set", "train.sample_every=0", "--set", "debug.step_delay_s=0.2", "--set", "scaling.num_workers=1"]
    code, output = run_cli_acting("raydiff.train", *args, at="[raydiff] step 10/", act=press_twice)
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert "raydiff: interrupted" in output and "were not seen to end" not in output, output[-3000:]
    assert not (tmp_path / "smoke" / "summary.json").exists()  # stopped at once: no summary
    with hold(RunDir(tmp_path / "smoke"), {"pid": 1}, stale_s=4, what="run directory"):
        pass  # free
    proc = run_cli("raydiff.train", *args[:4], "--set", "train.total_steps=20", "--set", "train.sample_every=0",
                   "--set", "scaling.num_workers=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "smoke" / "summary.json").read_text())["status"] == "finished"


@pytest.mark.ray
def test_a_stop_while_the_workers_wait_for_room_on_the_cluster_is_at_once(cluster, ray_session, tmp_path):
    """Ctrl-C while Ray Train waits for room for the worker group (two workers of 2 CPUs each on this 2-CPU cluster;
    on an autoscaling one, GPU nodes that have not come): no worker would look at the stop flag before there is
    room, which may be never, so nothing is checkpointed and the command stops at once."""
    def press_once_waiting(proc: subprocess.Popen) -> None:
        from ray.util.placement_group import placement_group_table

        deadline = time.monotonic() + 60  # Ray Train's controller asks for the group's placement, which waits
        # (this process a driver of the cluster: `ray_session`)
        while time.monotonic() < deadline and not any(
                group["state"] == "PENDING" for group in placement_group_table().values()):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        kill = threading.Timer(60, proc.kill)  # a stop that waited for room would wait for good
        kill.daemon = True
        kill.start()

    code, output = run_cli_acting(
        "raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}", "--set", "scaling.num_workers=2",
        "--set", "scaling.cpus_per_worker=2", at="training on 2 CPU worker(s)", act=press_once_waiting)
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert ("[raydiff] SIGINT: no worker group runs (Ray Train is waiting for room on the cluster for one): "
            "nothing to checkpoint, stopping at once") in output
    assert "stopping after a final checkpoint" not in output
    assert output.rstrip().splitlines()[-1] == ("raydiff: stopped by SIGINT before training began; nothing was "
                                                "trained (the same command starts again)")
    assert not list_checkpoints(tmp_path / "smoke")


@pytest.mark.parametrize("args, fragment", [
    (["--set", "train.lr=-1"], "train.lr = -1.0: must be > 0"),
    (["--set", "train.bogus=1"], "unknown key 'train.bogus'"),
    (["--set", "train.global_batch=1"], "train.global_batch = 1: must be at least the number of workers (2)"),
    (["--set", "scaling.num_workers=0"], "scaling.num_workers = 0: must be >= 1"),
    (["--config", "cifar10"], "data.source = null: required: a folder or file of images, Parquet or WebDataset "
                              "shards (local, s3://, gs://), a dataset on the Hugging Face Hub "
                              "(hf://datasets/uoft-cs/cifar10), or builtin:digits"),
    (["--set", "data.source=/definitely/missing"], "no such file or folder"),
    (["--config", "nosuch"], "not a file and not a preset"),
])
def test_bad_config_is_one_line_exit_2_nothing_written(tmp_path, args, fragment, capsys):
    storage = tmp_path / "storage"
    assert cli.run(train.main, [*args, "--set", f"run.storage={storage}"]) == 2  # what the command's entry runs
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and fragment in err, err
    assert not storage.exists()


@pytest.mark.parametrize("module, args", [
    ("train", ["--config", "smoke", "--set", "run.storage=FILE/runs"]),
    ("tune", ["--config", "smoke", "--lr", "1e-3:1e-2", "--batch", "8", "--set", "run.storage=FILE/runs"]),
    ("sample", ["--checkpoint", "runs", "--out", "FILE/grid.png"]),
    ("export", ["--checkpoint", "runs", "--out", "FILE/pipeline"]),
    ("prepare", ["builtin:digits", "FILE/prepared", "--resolution", "8"]),
    ("lr_find", ["--out", "FILE/lr_find.png"]),
    ("evaluate", ["--checkpoint", "RUN"]),  # its result goes into the run directory
])
def test_an_output_that_cannot_be_written_is_one_line_exit_2_before_any_work(module, args, tmp_path, capsys,
                                                                             monkeypatch):
    """A path through a file (a folder without write permission or a missing bucket go the same way)."""
    import importlib

    from raydiff.storage.rundir import RunDir

    file = tmp_path / "file"
    file.write_text("not a folder")
    run = tmp_path / "run"
    if module == "evaluate":  # a run folder this user may not write to (as root, every folder is writable)
        (run / "checkpoint_00000010").mkdir(parents=True)
        (run / "checkpoint_00000010" / "state.pt").write_bytes(b"")  # never read: refused before

        def denied(self):
            raise PermissionError(13, "Permission denied", self.path)
        monkeypatch.setattr(RunDir, "check_writable", denied)
    try:
        code = cli.run(importlib.import_module(f"raydiff.{module}").main,
                       [a.replace("FILE", str(file)).replace("RUN", str(run)) for a in args])
    except SystemExit as exit_:  # argparse's usage errors, as the shell sees them
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "cannot write" in err[-1] and "Traceback" not in "\n".join(err), err
    assert (tmp_path / "file").read_text() == "not a folder"


def test_a_bad_config_exits_2_from_the_shell(tmp_path):
    proc = run_cli("raydiff.train", "--set", "train.lr=-1", "--set", f"run.storage={tmp_path / 'storage'}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "raydiff: config error: train.lr = -1.0: must be > 0, or null to scale train.base_lr"
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "storage").exists()


def test_empty_source_fails_before_training(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"data.source={tmp_path / 'empty'}",
                   "--set", f"run.storage={tmp_path / 'storage'}")
    assert proc.returncode == 2 and "no image files found" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "storage").exists()


def test_dry_run_prints_config_and_parameters(tmp_path):
    proc = run_cli("raydiff.train", "--config", "cifar10", "--dry-run", "--set", f"run.storage={tmp_path / 's'}")
    assert proc.returncode == 0, proc.stderr
    assert "# model parameters: 35,746,307" in proc.stdout
    assert yaml.safe_load(proc.stdout)["model"]["channel_mult"] == [1, 2, 2, 2]
    assert not (tmp_path / "s").exists()


def test_a_dry_run_of_a_class_conditional_config_counts_what_each_class_adds(capsys):
    # model.num_classes = auto is resolved when the run reads its data, which a dry run does not (was a traceback).
    assert cli.run(train.main, ["--set", "data.labels=auto", "--set", "model.num_classes=auto", "--dry-run"]) == 0
    assert "# model parameters: 1,112,801, and 128 more per class" in capsys.readouterr().out
    assert cli.run(train.main, ["--set", "data.labels=auto", "--set", "model.num_classes=10", "--dry-run"]) == 0
    assert "# model parameters: 1,114,209\n" in capsys.readouterr().out  # 10 classes and the null class: 11 x 128


@pytest.mark.parametrize("args, fragment", [
    (["--checkpoint", "/no/such/run", "--out", "x.png"], "no such run or checkpoint folder"),
    (["--checkpoint", ".", "--num", "0", "--out", "x.png"], "--num 0: must be >= 1"),
    (["--checkpoint", ".", "--sampler", "ddpm", "--eta", "0.5", "--out", "x.png"], "--eta applies to --sampler ddim"),
])
def test_sample_cli_bad_input(args, fragment, capsys):
    try:
        code = cli.run(sample.main, args)
    except SystemExit as exit_:  # argparse's usage errors, as the shell sees them
        code = exit_.code
    assert code == 2 and fragment in capsys.readouterr().err


@pytest.mark.ray
def test_a_256_preset_trains_with_activation_checkpointing_and_samples_in_chunks(tmp_path):
    """The celebahq256 preset end to end at 256x256 on JPEGs larger than that, with a narrow model to stay fast:
    activation checkpointing on, the sample grid generated two images at a time. Its one worker has the cluster's
    2 CPUs, and computes on the one torch thread that the suite's OMP_NUM_THREADS allows (conftest.py)."""
    from raydiff.data.builtin import write_synthetic

    write_synthetic(tmp_path / "faces", num=8, resolution=300, fmt="jpg", seed=0)
    overrides = [f"data.source={tmp_path / 'faces'}", f"run.storage={tmp_path}", "run.name=hq",
                 "model.base_channels=8", "model.norm_groups=4", "train.global_batch=4", "train.micro_batch=2",
                 "train.activation_checkpointing=true", "train.total_steps=2", "train.warmup_steps=1",
                 "train.checkpoint_every=2", "train.log_every=1", "train.sample_num=3", "train.sample_steps=2",
                 "scaling.num_workers=1"]
    proc = run_cli("raydiff.train", "--config", "celebahq256", *[a for o in overrides for a in ("--set", o)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "8 images" in output and "at 256px" in output
    assert "micro-batches of up to 2" in output and "activation checkpointing on" in output
    assert "device cpu, 1 torch thread;" in output
    events = [json.loads(line) for line in (tmp_path / "hq" / "events.jsonl").read_text().splitlines()]
    assert [e["torch_threads"] for e in events if e["event"] == "start"] == [1]
    rows = [json.loads(line) for line in (tmp_path / "hq" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    grid = Image.open(tmp_path / "hq" / "samples" / "step_00000002.png")
    assert min(grid.size) >= 256  # three 256x256 images, generated in passes of two
    assert json.loads((tmp_path / "hq" / "summary.json").read_text())["status"] == "finished"


@pytest.mark.ray
def test_a_start_over_refused_after_the_data_is_read_leaves_the_old_run_where_it_was(smoke_run, tmp_path):
    """run.resume=false moved the old run aside as the command began: a refusal found once the data was read (here
    fewer classes than the data has) then left the folder empty, and the same command without resume=false trained
    from scratch where the run had been."""
    import shutil

    shutil.copytree(smoke_run[0], tmp_path / "smoke")
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}", "--set",
                   "run.resume=false", "--set", "data.labels=auto", "--set", "model.num_classes=3")
    assert proc.returncode == 2 and "model.num_classes = 3: smaller than the 10 classes" in proc.stderr, (
        proc.stderr[-3000:])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["smoke"]
    assert list_checkpoints(tmp_path / "smoke")  # still there, where the same command continues it


def test_a_finished_run_re_run_after_a_killed_extension_is_finished_at_its_checkpoint_without_the_lost_rows(
        tmp_path, capsys):
    """An extension (train.total_steps raised) killed before its first checkpoint, then the old command again: the
    run is finished at its checkpoint, and the extension's metrics rows and post-hoc EMA snapshots, which no
    checkpoint holds, go as a continuing run's would (they stayed, past the summary's step)."""
    from raydiff.config import load_config
    from raydiff.data.sources import source_of
    from raydiff.runs.ema_snapshots import list_snapshots, snapshot_name
    from raydiff.storage.rundir import RunDir

    args = ["--config", "smoke", "--set", f"run.storage={tmp_path}", "--set", "train.ema=posthoc"]
    cfg = load_config("smoke", [f"run.storage={tmp_path}", "train.ema=posthoc"])
    run = RunDir(tmp_path / cfg.run.name)
    run.write_text("config.yaml", yaml.safe_dump(cfg.to_dict()))
    run.write_text("data.json", json.dumps(source_of(cfg.data).identity()))
    run.write_bytes(f"checkpoint_{cfg.train.total_steps:08d}/state.pt", b"")
    run.write_text("summary.json", json.dumps({"status": "finished", "steps": cfg.train.total_steps}))
    run.write_text("metrics.jsonl", "".join(json.dumps({"step": s, "loss": 0.1}) + "\n"
                                            for s in (10, cfg.train.total_steps, cfg.train.total_steps + 5)))
    for step in (cfg.train.total_steps, cfg.train.total_steps + 5):
        run.write_bytes(snapshot_name(step), b"")

    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert f"is already finished ({cfg.train.total_steps} steps)" in out
    assert f"removed the post-hoc EMA snapshots of step(s) {cfg.train.total_steps + 5}" in out
    assert [json.loads(line)["step"] for line in run.read_text("metrics.jsonl").splitlines()] == [
        10, cfg.train.total_steps]
    assert list_snapshots(run) == [cfg.train.total_steps]
