"""Ray Tune sweeps through the real CLI: ASHA, outputs, best.yaml, resuming; argument errors."""

from __future__ import annotations

import contextlib
import csv
import json
import re
import signal

import pytest
import yaml
from conftest import (
    ended_jobs_actors,
    kill_named,
    leftover_placement_groups,
    plant_late_group,
    reserving,
    run_cli,
    run_cli_acting,
    run_cli_interrupted,
)
from disks import fill_leaving, kept_full, tmpfs

from raydiff import cli
from raydiff.tune import main as tune_main

# One worker of both CPUs a trial: a trial's share of the cluster whole, as a trial's waiting actor holds no CPU
# (once it held 0.001, and such a sweep waited forever); one worker process fewer per trial than the preset's two.
SWEEP = ["--config", "smoke", "--lr", "1e-6:3e-3", "--batch", "16", "--samples", "2", "--budget-images", "640",
         "--name", "s", "--set", "scaling.num_workers=1", "--set", "scaling.cpus_per_worker=2"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, ray_session):
    """The sweep, on a cluster where an ended job left a placement group holding every CPU: one Ray never removes
    (a dying Train controller's request placed after its job ended), which the sweep's decoding and trials would
    wait on for ever."""
    storage = tmp_path_factory.mktemp("sweeps")
    reserving_before = reserving(ray_session)
    job, dead, _ = ended_jobs_actors(ray_session, "test-tune-ended-job")
    try:
        plant_late_group(ray_session, job=job, creator_actor=dead, cpus=2)
        # As a file:// URI, which the schema admits (refused as remote before); the tests after name the same
        # folder as a path and find the same sweep.
        proc = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage=file://{storage}")
    finally:
        kill_named(ray_session, "test-tune-ended-job")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return storage, proc.stdout + proc.stderr, reserving(ray_session) - reserving_before


@pytest.mark.ray
def test_two_trial_sweep_stops_the_worse_trial_and_writes_its_outputs(sweep):
    storage, output, _ = sweep
    sweep_dir = storage / "s"
    rows = list(csv.DictReader((sweep_dir / "results.csv").open()))
    assert [(r["base_lr"], r["batch"], r["rule"]) for r in rows] == [("0.003", "16", "linear"),
                                                                       ("1e-06", "16", "linear")]
    statuses = {r["base_lr"]: r["status"] for r in rows}
    assert statuses == {"0.003": "finished", "1e-06": "stopped"}  # ASHA compared them at equal images seen
    seen = {r["base_lr"]: int(r["images_seen"]) for r in rows}
    assert seen["0.003"] == 640 and seen["1e-06"] < 640
    assert all(float(r["val_loss"]) > 0 for r in rows)
    assert (sweep_dir / "sweep.png").stat().st_size > 0
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["best"]["trial"] == "linear-b16-lr0.003" and summary["stopped"] == 1
    assert "1 finished, 1 stopped early by ASHA" in output
    assert re.search(r"\[raydiff\] removed \d+ placement group\(s\) that ended jobs had left holding [\d.]+ CPU",
                     output)  # the group above (and any an earlier module's sweeps left)
    # Only raydiff's lines and the trials': not Tune's banner, nor its TensorBoard command for a Ray session folder,
    # nor each trial's placement-group cleaner finding its controller gone.
    assert "Configuration for experiment" not in output and "tensorboard --logdir" not in output
    assert "Detected that the Ray Train controller actor" not in output

    best = yaml.safe_load((sweep_dir / "best.yaml").read_text())
    assert best["train"]["base_lr"] == 0.003 and best["train"]["lr"] is None and best["data"]["val_images"] == 256


@pytest.mark.ray
def test_a_sweep_leaves_no_resources_reserved_for_its_killed_trials(sweep):
    """Tune kills both trials (one early, one at its budget) and their Train controllers with them; left alone,
    Ray would keep their CPUs reserved for 3 minutes, and an elastic run started next would wait on them."""
    _, _, still_reserving = sweep
    assert still_reserving == set()


@pytest.mark.ray
def test_best_yaml_trains_as_is(sweep):
    storage, _, _ = sweep
    proc = run_cli("raydiff.train", "--config", str(storage / "s" / "best.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((storage / "s-best" / "summary.json").read_text())
    assert run["status"] == "finished" and run["images_seen"] == 640 and run["final_val_loss"] > 0
    assert "learning rate 0.003" in proc.stdout + proc.stderr


@pytest.mark.ray
def test_rerunning_a_sweep_continues_it_and_other_arguments_are_refused(sweep):
    storage, _, _ = sweep
    again = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage={storage}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the sweep" in again.stdout + again.stderr
    assert "1 finished, 1 stopped early by ASHA" in again.stdout
    other = run_cli("raydiff.tune", *SWEEP, "--samples", "3", "--set", f"run.storage={storage}")
    assert other.returncode == 2 and "holds a sweep with other arguments" in other.stderr


@pytest.mark.ray
def test_a_sweep_whose_tune_state_was_cut_short_continues_from_its_trials_runs(sweep):
    """A driver killed while Tune saved its experiment state: Tune alone would run one trial with an empty
    config. The re-run sets the state aside and starts Tune afresh; the finished trial reports its result again
    (not trained again) and the stopped one continues from its own checkpoint."""
    storage, _, _ = sweep
    sweep_dir = storage / "s"
    before = {r["base_lr"]: r for r in csv.DictReader((sweep_dir / "results.csv").open())}
    newest_state = sorted((sweep_dir / "tune").glob("experiment_state-*.json"))[-1]
    newest_state.write_text(newest_state.read_text()[:100])

    again = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage={storage}")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"Tune state is unusable ({newest_state.name} is cut short" in again.stdout
    [aside] = sweep_dir.glob("tune.unusable-*")
    assert (aside / newest_state.name).stat().st_size == 100  # kept as it was
    after = {r["base_lr"]: r for r in csv.DictReader((sweep_dir / "results.csv").open())}
    assert after["0.003"] == before["0.003"]  # finished: the same result, from its run
    continued = after["1e-06"]
    assert continued["status"] != "error" and float(continued["val_loss"]) > 0
    assert int(continued["images_seen"]) >= int(before["1e-06"]["images_seen"])


@pytest.mark.ray
def test_a_sweep_without_room_for_its_trials_checkpoints_is_refused_before_anything_is_written(ray_session,
                                                                                                 tmp_path):
    with tmpfs(tmp_path / "disk", "9m") as disk:  # room for two smoke checkpoints (a run's minimum), not three
        proc = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage={disk}")
        assert proc.returncode == 2, proc.stderr[-3000:]
        [line] = [line for line in proc.stderr.splitlines() if line.startswith("raydiff:")]
        assert line.startswith(f"raydiff: config error: run.storage = '{disk}': 9.4 MB free on its file system, and "
                               f"the sweep's 2 trials (")
        assert "need room for 3 more checkpoints of about 3.9 MB (11.6 MB); free space there, set another " \
               "run.storage or sweep fewer trials" in line  # one kept by each trial, and the next of the one running
        assert not any(disk.iterdir())


@pytest.mark.ray
@pytest.mark.slow
def test_trials_that_fail_on_a_disk_filled_meanwhile_say_why_in_a_line_and_the_same_command_runs_them(ray_session,
                                                                                                     tmp_path):
    """The disk fills (another job's files) once the first trial trains, leaving room for Tune's own saves and the
    sweep's outputs but not for a checkpoint: each trial that then fails says why in one line, not Tune's traceback,
    and the sweep writes its outputs and ends in one line, exit 2. With room again, the same command runs the failed
    trials (all at once as Tune resumes them, without their waiting actors starving each other's workers)."""
    with tmpfs(tmp_path / "disk", "20m") as disk:
        # 1 MB left: Tune's saves and the outputs (KBs) fit, a checkpoint (3 MB) never does, even with the room of
        # one cut short as the disk filled.
        code, text = run_cli_acting("raydiff.tune", *SWEEP, "--set", f"run.storage={disk}", at="[raydiff] step ",
                                    act=lambda _: fill_leaving(disk, 2**20))
        assert code == 2, text[-3000:]
        failed = [line for line in text.splitlines() if line.startswith("[raydiff] trial ") and " failed: " in line]
        # The first trial at its next checkpoint, the second before it starts; each once, though Tune retries it.
        assert len(failed) == 2 and all("free space there or set another run.storage" in line for line in failed)
        assert len({line.split(" failed: ")[0] for line in failed}) == 2
        assert "Traceback" not in text and "Trials did not complete" not in text
        assert text.splitlines()[-1] == ("raydiff: error: 2 of 2 trials failed (each said why above); once that is "
                                         "fixed, the same command runs them again"), text[-3000:]
        summary = json.loads((disk / "s" / "summary.json").read_text())  # the lines are kept with the outputs
        assert sorted(summary["failed_trials"].values()) == sorted(line.removeprefix("[raydiff] ") for line in failed)
        (disk / "other-job").unlink()
        again = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage={disk}", timeout=600)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "continuing the sweep" in again.stdout and ", 0 failed" in again.stdout
        assert "Traceback" not in again.stdout + again.stderr


@pytest.mark.ray
def test_a_sweep_on_a_disk_another_job_keeps_full_ends_in_one_line_and_the_same_command_continues_it(ray_session,
                                                                                                   tmp_path):
    """From the first step on, another job takes every byte the moment it is free, so Tune's own saves of the
    sweep's state fail too: the trials say why in a line each, the sweep ends in one line naming its state, and
    nothing prints a traceback (Tune's, Ray Train's controller's, TensorBoard's thread's). With room again, the same
    command continues the sweep."""
    with tmpfs(tmp_path / "disk", "20m") as disk, contextlib.ExitStack() as filling:
        code, text = run_cli_acting("raydiff.tune", *SWEEP, "--set", f"run.storage={disk}", at="[raydiff] step ",
                                    act=lambda _: filling.enter_context(kept_full(disk)))
        filling.close()
        assert code == 2, text[-3000:]
        assert "Traceback" not in text and "Exception in thread" not in text, text[-5000:]
        assert text.splitlines()[-1] == (
            f"raydiff: error: storage {disk / 's'}: saving the sweep's state failed: no space left on device. Nothing "
            f"already saved was lost; free space there or set another run.storage, then run the same command again "
            f"to continue from the newest checkpoint"), text[-3000:]
        again = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage={disk}", timeout=600)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert ", 0 failed" in again.stdout and "Traceback" not in again.stdout + again.stderr


@pytest.mark.ray
def test_ctrl_c_stops_a_sweep_and_the_same_command_continues_it(ray_session, tmp_path):
    """Tune's own Ctrl-C handler saves its state and ends the sweep; the command says so (not Tune's
    `Tuner.restore(...)`, a Python call), writes no results for the part-done sweep and exits 130. Run again, the
    interrupted trial continues from its checkpoint and the sweep ends as an uninterrupted one does."""
    code, output = run_cli_interrupted("raydiff.tune", *SWEEP, "--set", f"run.storage={tmp_path}",
                                       at="[raydiff] step 10/")
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert "[raydiff] sweep s stopped by SIGINT, its state saved in" in output and "the same command continues it" \
        in output
    assert "Tuner.restore" not in output and "Traceback" not in output
    assert not (tmp_path / "s" / "results.csv").exists()
    assert leftover_placement_groups(ray_session) == []  # the killed trials' groups are gone with the sweep

    again = run_cli("raydiff.tune", *SWEEP, "--set", f"run.storage={tmp_path}")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "continuing the sweep" in again.stdout and "continuing at step" in again.stdout + again.stderr
    assert "1 finished, 1 stopped early by ASHA" in again.stdout


@pytest.mark.ray
def test_sigterm_stops_a_sweep_as_ctrl_c_does(ray_session, tmp_path):
    """SIGTERM (`ray job stop`, a scheduler) has no handler in Tune, and Ray's own printed a stack dump and exited
    1: it now ends the sweep as Ctrl-C does."""
    code, output = run_cli_interrupted("raydiff.tune", *SWEEP, "--set", f"run.storage={tmp_path}",
                                       at="[raydiff] step 10/", sig=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "[raydiff] sweep s stopped by SIGTERM, its state saved in" in output
    assert "SIGTERM received at time" not in output and "Traceback" not in output
    assert leftover_placement_groups(ray_session) == []


@pytest.mark.parametrize("args, fragment", [
    (["--lr", "fast", "--batch", "16"], "--lr 'fast': expected LOW:HIGH"),
    (["--lr", "1e-3:1e-5", "--batch", "16"], "0 < LOW <= HIGH"),
    (["--lr", "1e-5:inf", "--batch", "16"], "--lr '1e-5:inf': expected finite learning rates LOW:HIGH"),
    (["--lr", "1e-5:1e400", "--batch", "16"], "--lr '1e-5:1e400': expected finite learning rates LOW:HIGH"),
    (["--lr", "1e-3", "--batch", "16", "--samples", "2"], "needs a range"),
    (["--lr", "1e-5:1e-3", "--batch", "16,0"], "expected distinct positive integers"),
    (["--lr", "1e-5:1e-3", "--batch", "1"], "--batch 1: train.global_batch = 1: must be at least the number of "
                                            "workers (2)"),
    (["--lr", "1e-5:1e-3", "--batch", "16", "--samples", "0"], "--samples 0: must be between 1 and 1000"),
    (["--lr", "1e-5:1e-3", "--batch", "16", "--samples", "1000000000"], "--samples 1000000000: must be between 1 and"),
    (["--lr", "1e-5:1e-3", "--batch", "16,32", "--budget-images", "16"], "must be at least 32"),
    (["--lr", "1e-5:1e-3", "--batch", "16", "--max-concurrent", "0"], "--max-concurrent 0: must be >= 1"),
    # Each trial's own config, checked before Ray starts (was a Tune traceback in the trial, and none of the
    # sweep's outputs): batch 64 trains 5 steps of the budget.
    (["--lr", "1e-5:1e-3", "--batch", "16,64", "--set", "log.profile_steps=[15,18]"],
     "trial linear-b64-lr0.001: log.profile_steps = [15, 18]: "),
    # Its trials would report no Frechet distance (Tune stopped the sweep at their first report, a traceback).
    (["--lr", "1e-5:1e-3", "--batch", "16", "--metric", "fid", "--set", "eval.metrics=[kid]"],
     "--metric fid: eval.metrics = ['kid'] computes no Frechet distance"),
])
def test_bad_sweep_arguments_are_one_line_errors(args, fragment, capsys, tmp_path):
    code = cli.run(tune_main, ["--config", "smoke", "--set", f"run.storage={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


def test_trials_keep_warmup_decay_and_ema_half_life_in_images(tmp_path):
    import math

    from raydiff.config import load_config
    from raydiff.training.sweep_plan import Sweep, trial_config

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16", "train.warmup_steps=20",
                                "train.ema_warmup_steps=8", "train.lr_decay=rsqrt", "train.lr_decay_steps=40"])
    sweep = Sweep(name="s", base_lrs=(1e-3,), batches=(16, 64), rules=("linear",), budget_images=640,
                  interval_images=64, max_concurrent=None)
    same = trial_config(cfg, {"batch": 16, "base_lr": 1e-3, "rule": "linear"}, sweep, str(tmp_path))
    big = trial_config(cfg, {"batch": 64, "base_lr": 1e-3, "rule": "linear"}, sweep, str(tmp_path))
    assert (same.train.warmup_steps, same.train.ema_decay) == (20, 0.99)
    assert big.train.warmup_steps * 64 == 20 * 16 and big.train.ema_warmup_steps * 64 == 8 * 16
    assert same.train.lr_decay_steps == 40 and big.train.lr_decay_steps * 64 == 40 * 16
    half_life_images = [t.global_batch * math.log(0.5) / math.log(t.ema_decay) for t in (same.train, big.train)]
    assert half_life_images[0] == pytest.approx(half_life_images[1])
    assert big.train.total_steps == 10 and big.train.lr == pytest.approx(4e-3)  # linear rule from batch 16


def test_trials_keep_post_hoc_snapshots_and_evaluations_per_image(tmp_path):
    """Both stayed in steps: a trial of 4x the batch took a snapshot, and measured FID, 4x as often per image."""
    from raydiff.config import load_config
    from raydiff.training.sweep_plan import Sweep, trial_config

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16", "train.ema=posthoc",
                                "train.ema_snapshot_every=8", "eval.every=16"])
    sweep = Sweep(name="s", base_lrs=(1e-3,), batches=(16, 64), rules=("linear",), budget_images=640,
                  interval_images=64, max_concurrent=None)
    same, big = (trial_config(cfg, {"batch": b, "base_lr": 1e-3, "rule": "linear"}, sweep, str(tmp_path))
                 for b in (16, 64))
    assert (same.train.ema_snapshot_every, same.eval.every) == (8, 16)
    assert (big.train.ema_snapshot_every * 64, big.eval.every * 64) == (8 * 16, 16 * 16)



@pytest.mark.parametrize("num_workers", ["auto", "[1, 2]"])
def test_best_yaml_keeps_the_base_configs_scaling(tmp_path, num_workers):
    """Trials of an `auto` config run one worker each, side by side; the long run from best.yaml must not."""
    from raydiff.config import load_config
    from raydiff.training.sweep_plan import Sweep
    from raydiff.tune import write_outputs

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16", f"scaling.num_workers={num_workers}"])
    sweep = Sweep(name="s", base_lrs=(1e-3,), batches=(16,), rules=("linear",), budget_images=640,
                  interval_images=64, max_concurrent=None)
    row = {"trial": "linear-b16-lr0.001", "rule": "linear", "batch": 16, "base_lr": 1e-3, "lr": 1e-3,
           "images_seen": 640, "val_loss": 0.1, "status": "finished"}
    write_outputs([row], cfg, sweep, tmp_path)
    best = load_config(str(tmp_path / "best.yaml"))
    assert best.scaling == cfg.scaling and best.train.global_batch == 16


def test_summary_json_keeps_each_failed_trials_line(tmp_path):
    from raydiff.config import load_config
    from raydiff.training.sweep_plan import Sweep
    from raydiff.tune import write_outputs

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16"])
    sweep = Sweep(name="s", base_lrs=(1e-3, 1e-4), batches=(16,), rules=("linear",), budget_images=640,
                  interval_images=64, max_concurrent=None)
    rows = [{"trial": f"linear-b16-lr{lr:.3g}", "rule": "linear", "batch": 16, "base_lr": lr, "lr": lr,
             "images_seen": seen, "val_loss": loss, "status": status}
            for lr, seen, loss, status in ((1e-3, 640, 0.1, "finished"), (1e-4, 0, None, "error"))]
    line = "trial linear-b16-lr0.0001 failed: run.storage = '/mnt/runs': 0.0 MB free on its file system, ..."
    write_outputs(rows, cfg, sweep, tmp_path, {"linear-b16-lr0.0001": line})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["errors"] == 1 and summary["failed_trials"] == {"linear-b16-lr0.0001": line}
    assert summary["best"]["trial"] == "linear-b16-lr0.001"


def test_a_trial_that_tune_s_retry_finished_is_not_counted_failed():
    """A trial that failed once (a disk filled, then freed) and finished on Tune's retry: its row says finished,
    and the command must not end with "1 of 2 trials failed"."""
    from raydiff.training.sweep import still_failed

    told = {"linear-b16-lr0.001": "trial linear-b16-lr0.001 failed: ...",
            "linear-b16-lr0.0001": "trial linear-b16-lr0.0001 failed: ..."}
    rows = [{"trial": "linear-b16-lr0.001", "status": "finished"}, {"trial": "linear-b16-lr0.0001", "status": "error"}]
    assert still_failed(told, rows) == {"linear-b16-lr0.0001": "trial linear-b16-lr0.0001 failed: ..."}


def test_a_sweep_file_cut_short_is_one_line_not_a_traceback_at_every_run(tmp_path, capsys):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text('{"name": "s", "base')  # a kill while it was written in place
    code = cli.run(tune_main, ["--config", "smoke", "--set", f"run.storage={tmp_path}", "--lr", "1e-5:1e-3", "--batch",
                               "16", "--name", "s"])
    assert code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        f"raydiff: config error: {tmp_path / 's' / 'sweep.json'} is not the JSON a sweep writes (cut short, or "
        f"edited): restore it, or use --name NEW for a new sweep")


@pytest.mark.ray
def test_a_trial_that_diverges_is_a_result_of_the_sweep_not_a_failure_to_retry(ray_session, tmp_path):
    """Too high a learning rate is what an LR sweep is there to find: the trial says so in a line and its row says
    diverged; Tune does not retry it, nor does the same command run it again (it raised a RuntimeError: Tune's
    traceback, a retry that diverged again, a row "error", and the trial trained again at every re-run)."""
    args = ["--config", "smoke", "--lr", "1e30", "--batch", "16", "--samples", "1", "--budget-images", "640",
            "--name", "d", "--set", "scaling.num_workers=1", "--set", "scaling.cpus_per_worker=2",
            "--set", "train.warmup_steps=0", "--set", "train.lr_decay=none", "--set", "train.max_bad_steps=3",
            "--set", f"run.storage={tmp_path}"]
    starts = []
    for _ in range(2):
        proc = run_cli("raydiff.tune", *args)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
        assert proc.stderr.splitlines()[-1] == (
            "raydiff: error: no trial of sweep d finished (1 diverged: lower the --lr range; 0 stopped early by "
            "ASHA), so there is no best.yaml"), output[-3000:]
        assert "0 finished, 0 stopped early by ASHA, 1 diverged, 0 failed" in proc.stdout
        rows = list(csv.DictReader((tmp_path / "d" / "results.csv").open()))
        assert [(r["trial"], r["status"]) for r in rows] == [("linear-b16-lr1e30", "diverged")]
        events = (tmp_path / "d" / "runs" / "linear-b16-lr1e30" / "events.jsonl").read_text().splitlines()
        starts.append(sum(json.loads(line)["event"] == "start" for line in events))
    assert starts == [1, 1]  # trained once, by the first command
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert summary["diverged"] == 1 and summary["errors"] == 0 and summary["failed_trials"] == {}


@pytest.mark.ray
def test_trials_that_run_at_once_split_the_stream_buffer(ray_session, tmp_path):
    """Streamed, K concurrent trials on a node each have a node cache: together they hold data.stream_buffer_gb,
    not K times it (their shards are prepared smaller, so the shuffle windows stay what the key says)."""
    from raydiff.config import load_config
    from raydiff.training.sweep import sweep_images

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16", "data.cache=stream",
                                "data.stream_buffer_gb=0.0001", "data.stream_window_shards=2"])
    alone, _ = sweep_images(cfg, tmp_path / "alone", 1)
    shared, cache = sweep_images(cfg, tmp_path / "shared", 2)
    assert shared.buffer_bytes == int(alone.buffer_bytes * 0.5) and shared.window_shards == alone.window_shards == 2
    assert max(shared.counts) < max(alone.counts) and "holds 1/2 of data.stream_buffer_gb" in cache


def test_a_warmup_that_outlasts_asha_s_first_comparison_is_warned_of(tmp_path, capsys):
    """Every trial keeps the config's warmup in images: a budget that ends (or is first compared) inside it ranks
    learning rates that have not been reached yet."""
    from types import SimpleNamespace

    from raydiff.config import load_config
    from raydiff.training.sweep_plan import plan_sweep

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16", "train.ema_decay=0.9",
                                "train.warmup_steps=100"])  # 1,600 images
    args = SimpleNamespace(samples=1, lr="1e-3", batch="16,64", scaling="linear", max_concurrent=None, name=None,
                           metric="val_loss", budget_images=None)
    plan_sweep(SimpleNamespace(**{**vars(args), "budget_images": 64_000}), cfg)
    assert capsys.readouterr().err == ""
    sweep = plan_sweep(SimpleNamespace(**{**vars(args), "budget_images": 4096}), cfg)
    assert capsys.readouterr().err == (
        f"[raydiff] warning: train.warmup_steps = 100 warms the learning rate up over 1,600 images in every trial, "
        f"past ASHA's first comparison at {sweep.grace_images:,}: trials would be ranked while still warming up; "
        f"raise --budget-images or lower train.warmup_steps\n")


def test_an_ema_still_close_to_its_start_at_asha_s_first_comparison_is_warned_of(tmp_path, capsys):
    """The validation loss that ASHA ranks is the EMA's: with the cifar10 preset's decay (0.9999, no EMA warmup)
    38% of the random initial weights were left in it at the first comparison, and trials were cut on that."""
    from types import SimpleNamespace

    from raydiff.config import load_config
    from raydiff.training.sweep_plan import ema_start_share, plan_sweep

    args = SimpleNamespace(samples=1, lr="1e-3", batch="16,64", scaling="linear", max_concurrent=None, name=None,
                           metric="val_loss", budget_images=64_000)
    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16", "train.ema_decay=0.999",
                                "train.ema_warmup_steps=0"])
    sweep = plan_sweep(args, cfg)
    steps = sweep.grace_images // 16
    assert capsys.readouterr().err == (
        f"[raydiff] warning: train.ema_decay = 0.999 (train.ema_warmup_steps = 0) leaves "
        f"{0.999 ** steps:.0%} of the start's weights in every trial's EMA at ASHA's first comparison at "
        f"{sweep.grace_images:,} images, and the validation loss is the EMA's: trials would be ranked on averages "
        f"still close to their start; raise --budget-images, or set train.ema_warmup_steps or a lower "
        f"train.ema_decay\n")
    plan_sweep(args, cfg.replaced("train", ema_decay=0.99))  # 0.99 ** 1000: nothing of the start
    plan_sweep(args, cfg.replaced("train", ema_warmup_steps=steps))  # an average of the steps so far
    assert capsys.readouterr().err == ""
    assert ema_start_share(cfg.replaced("train", ema_decay=0.9999).train, 9760) == pytest.approx(0.377, abs=1e-3)


@pytest.mark.parametrize(("given", "message"), [
    # 0 was taken for "not given": the config's budget, silently.
    ({"budget_images": 0}, "--budget-images 0: must be at least 16 (one step of every batch size)"),
    # '' (an unset shell variable) was taken for the default name: it would continue the default sweep.
    ({"name": ""}, "--name '': use letters, digits, '.', '_' and '-' (it names a folder)"),
    # A base LR finite at the base batch and not at a trial's: the trial trained on an infinite learning rate.
    ({"lr": "1e308", "batch": "64"}, "trial linear-b64-lr1e308: train.lr = inf: train.base_lr = 1e+308 scaled to "
                                     "train.global_batch = 64 is no finite number"),
    # The config's budget too small: it named --budget-images, which was not given.
    ({"batch": "100000"}, "the budget of train.total_steps x train.global_batch = 320 images (--budget-images "
                          "unset): must be at least 100000 (one step of every batch size)"),
])
def test_a_zero_budget_or_an_empty_name_is_refused_not_taken_for_the_default(tmp_path, given, message):
    from types import SimpleNamespace

    from raydiff.config import ConfigError, load_config
    from raydiff.training.sweep_plan import plan_sweep

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16"])
    args = SimpleNamespace(**{"samples": 1, "lr": "1e-3", "batch": "16", "scaling": "linear", "max_concurrent": None,
                              "name": None, "metric": "val_loss", "budget_images": None, **given})
    with pytest.raises(ConfigError) as caught:
        plan_sweep(args, cfg)
    assert str(caught.value) == message


def test_the_rule_verdict_is_withheld_where_a_batch_has_no_finished_trial():
    """ASHA compares the trials of every batch size at equal images; a batch that trails there can lose all its
    trials, and a spread over the other batches alone was printed as the rule's verdict."""
    from raydiff.tune import rule_spread

    def row(batch, lr, loss, status="finished"):
        return {"rule": "linear", "batch": batch, "base_lr": lr, "val_loss": loss, "status": status}

    rows = [row(32, 1e-3, 0.10), row(32, 1e-4, 0.12), row(32, 1e-2, 0.13), row(64, 1e-3, 0.09),
            row(64, 1e-2, 0.11, "stopped"), row(64, 1e-4, 0.10)]
    assert rule_spread(rows) == {"linear": {"best_base_lr_by_batch": {32: 1e-3, 64: 1e-3}, "spread_decades": 0.0,
                                            "batches_without_a_finished_trial": [],
                                            "batches_best_at_the_edge_of_lr": []}}
    rows += [row(128, 1e-3, 0.2, "stopped"), row(128, 1e-4, None, "error")]
    assert rule_spread(rows)["linear"] == {"best_base_lr_by_batch": {32: 1e-3, 64: 1e-3}, "spread_decades": None,
                                           "batches_without_a_finished_trial": [128],
                                           "batches_best_at_the_edge_of_lr": []}


def test_a_best_at_an_end_of_the_lr_range_withholds_the_verdict_and_a_nan_is_never_best(tmp_path, capsys):
    """A loss that falls all the way to the highest base LR tried, at every batch, read as "spread 0: the rule
    holds", though the optimum lay beyond --lr; and a trial that finished with a NaN validation loss (sorted
    first) was the sweep's best, in best.yaml."""
    from types import SimpleNamespace

    from raydiff.config import load_config
    from raydiff.training.sweep_plan import plan_sweep
    from raydiff.tune import rule_spread, write_outputs

    def row(batch, lr, loss, status="finished"):
        return {"trial": f"linear-b{batch}-lr{lr:g}", "rule": "linear", "batch": batch, "base_lr": lr,
                "lr": lr * batch / 16, "images_seen": 640, "val_loss": loss, "status": status}

    rows = [row(b, lr, loss) for b in (16, 32) for lr, loss in ((1e-4, 0.3), (1e-3, 0.2), (1e-2, 0.1))]
    assert rule_spread(rows)["linear"]["spread_decades"] is None
    assert rule_spread(rows)["linear"]["batches_best_at_the_edge_of_lr"] == [16, 32]
    rows = [row(16, 1e-2, float("nan")), row(16, 1e-3, 0.04), row(16, 1e-4, 0.05)]
    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16"])
    args = SimpleNamespace(samples=3, lr="1e-4:1e-2", batch="16", scaling="linear", max_concurrent=None, name="s",
                           metric="val_loss", budget_images=640)
    (tmp_path / "s").mkdir()
    summary = write_outputs(rows, cfg, plan_sweep(args, cfg), tmp_path / "s")
    assert summary["best"]["base_lr"] == 1e-3 and summary["rules"]["linear"]["spread_decades"] is None
    assert "linear-b16-lr0.001, val_loss 0.04" in (tmp_path / "s" / "best.yaml").read_text().splitlines()[0]
    def refused(constant: str) -> None:
        raise AssertionError(f"{constant} in summary.json")
    json.loads((tmp_path / "s" / "summary.json").read_text(), parse_constant=refused)  # strict JSON: no NaN in it


def test_close_learning_rates_name_trials_apart(tmp_path):
    """Two base LRs alike to 3 digits named two trials alike: they shared a run directory, and the second reported
    the first's finished run as its own."""
    from types import SimpleNamespace

    from raydiff.config import ConfigError, load_config
    from raydiff.training.sweep_plan import plan_sweep, trial_config

    cfg = load_config("smoke", [f"run.storage={tmp_path}", "data.val_images=16"])
    args = SimpleNamespace(samples=3, lr="1e-3:1.01e-3", batch="16", scaling="linear", max_concurrent=None,
                           name=None, metric="val_loss", budget_images=None)
    sweep = plan_sweep(args, cfg)
    names = [trial_config(cfg, {"batch": 16, "base_lr": lr, "rule": "linear"}, sweep, str(tmp_path)).run.name
             for lr in sweep.base_lrs]
    assert names == ["linear-b16-lr0.00101", "linear-b16-lr0.001005", "linear-b16-lr0.001"]
    wide = plan_sweep(SimpleNamespace(**{**vars(args), "lr": "1e-5:1e-3"}), cfg)
    assert wide.lr_digits == 3  # names as they always were
    with pytest.raises(ConfigError, match="too narrow a range for --samples 3 different learning rates"):
        plan_sweep(SimpleNamespace(**{**vars(args), "lr": "1e-3:1.0000000000000002e-3"}), cfg)



def test_a_sweep_with_a_trial_that_failed_without_a_line_of_raydiff_s_does_not_exit_0(tmp_path, monkeypatch, capsys):
    """A trial whose run failed otherwise (Tune shows its traceback): the sweep wrote its outputs from the others
    and exited 0, so `ray job submit` reported success."""
    import raydiff.tune

    rows = [{"trial": f"linear-b16-lr{lr:.3g}", "rule": "linear", "batch": 16, "base_lr": lr, "lr": lr,
             "images_seen": seen, "val_loss": loss, "status": status}
            for lr, seen, loss, status in ((1e-3, 640, 0.1, "finished"), (1e-5, 64, None, "error"))]
    monkeypatch.setattr(raydiff.tune, "run_sweep", lambda cfg, sweep: {"rows": rows, "dir": str(tmp_path / "s"),
                                                                         "failed": {}})
    (tmp_path / "s").mkdir()
    code = cli.run(tune_main, ["--config", "smoke", "--set", f"run.storage={tmp_path}", "--lr", "1e-5:1e-3",
                               "--samples", "2", "--batch", "16", "--name", "s"])
    assert code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "raydiff: error: 1 of 2 trials failed (Tune's traceback above says why); the same command runs them again")
    assert (tmp_path / "s" / "best.yaml").is_file()  # the outputs of the trials that did run


@pytest.mark.parametrize(("workers", "cpus", "gpus", "trials"), [
    ("2", 16, 1, 8),  # use_gpu auto: one GPU for two workers trains on CPUs (it counted the GPU: 1 trial)
    ("auto", 4, 8, 4),  # one CPU beside each GPU: 4 CPUs place 4 trials, not 8
    ("auto", 16, 8, 8),
    ("1", 2, 0, 2),
])
def test_the_trials_run_at_once_are_those_the_cluster_places(tmp_path, workers, cpus, gpus, trials):
    from raydiff.config import load_config
    from raydiff.training.sweep_plan import concurrent_trials

    cfg = load_config("smoke", [f"run.storage={tmp_path}", f"scaling.num_workers={workers}"])
    assert concurrent_trials(cfg, cpus, gpus) == trials


def test_asha_ranks_each_trial_among_those_of_its_batch_size_and_rule():
    """At equal images a larger batch has taken fewer steps: in one pool ASHA stopped every trial of batch 64 on
    the losses of batch 16's, and the sweep had no best learning rate for it."""
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import AsyncHyperBandScheduler

    from raydiff.training.sweep_scheduler import GroupedASHA

    def decisions(scheduler_class) -> dict[tuple[int, float], str]:
        scheduler = scheduler_class(time_attr="images_seen", max_t=640, grace_period=160, reduction_factor=2)
        scheduler.set_search_properties("val_loss", "min")
        losses = {}
        for batch, lr, loss in [(16, 1e-3, 0.1), (16, 1e-2, 0.2), (64, 1e-3, 0.5), (64, 1e-2, 0.4), (64, 1e-4, 0.6)]:
            trial = Trial("__fake", config={"batch": batch, "rule": "linear", "base_lr": lr}, stub=True)
            scheduler.on_trial_add(None, trial)
            losses[trial] = loss
        return {(t.config["batch"], t.config["base_lr"]): scheduler.on_trial_result(None, t, {"images_seen": 160,
                                                                                               "val_loss": loss})
                for t, loss in losses.items()}

    assert [key for key, said in decisions(AsyncHyperBandScheduler).items() if said == "CONTINUE"] == [(16, 1e-3)]
    grouped = decisions(GroupedASHA)
    assert grouped[(16, 1e-2)] == grouped[(64, 1e-4)] == "STOP"  # the worse of each batch size
    assert grouped[(16, 1e-3)] == grouped[(64, 1e-2)] == "CONTINUE"
