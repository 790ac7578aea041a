"""Checkpoint files: written so that none is visible before it is complete, nor left empty by a power loss; read
back from any storage; a damaged one passed over in one line; a full temporary folder told apart from full
storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from importlib.metadata import version

import numpy as np
import pytest
import torch
from disks import syncs_and_renames
from PIL import Image

from raydiff.config import load_config
from raydiff.model.unet import build_model
from raydiff.runs.checkpoint import (
    RAY_CHECKPOINT_LIST,
    checkpoint_name,
    drop_unusable_ray_checkpoint_list,
    input_errors,
    list_checkpoints,
    read_state,
    remove_checkpoints_ray_never_kept,
    write_state,
)
from raydiff.runs.images import save_samples
from raydiff.runs.state import read_newest
from raydiff.storage.errors import StorageFailure
from raydiff.storage.rundir import RunDir


def test_grid_and_folder(tmp_path):
    images = torch.linspace(-1, 1, 5 * 3 * 16 * 16).reshape(5, 3, 16, 16)
    grid = save_samples(images, tmp_path / "grid.png")
    # 3 columns of 16 px enlarged 11x (nearest neighbour) to pass 512 px, 2 px padding
    assert Image.open(grid).size == (3 * (176 + 2) + 2, 2 * (176 + 2) + 2)
    tile = np.asarray(Image.open(grid))[2:2 + 176, 2:2 + 176]
    assert (tile[::11, ::11].repeat(11, 0).repeat(11, 1) == tile).all()  # blocks of 11x11 equal pixels
    digits = save_samples(torch.zeros(64, 1, 16, 16), tmp_path / "digits.png")
    assert Image.open(digits).size[0] == 8 * (64 + 2) + 2  # the default run's grid: 530 px wide
    folder = save_samples(images, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["grid.png"] + [f"sample_{i:05d}.png" for i in range(5)]
    assert Image.open(folder / "sample_00004.png").size == (16, 16)


def _state(step: int) -> dict:
    """What the commands read from a checkpoint (`read_newest` checks that the weights fit the config's model): a
    smoke run's config, its model's weights as the EMA, the step."""
    cfg = load_config("smoke", check_source=False)
    return {"step": step, "ema": build_model(cfg).state_dict(), "config": cfg.to_dict()}


def test_state_round_trip_and_lookup(tmp_path):
    for step in (10, 20):
        directory = tmp_path / checkpoint_name(step)
        directory.mkdir()
        write_state(directory, _state(step))
    (tmp_path / "checkpoint_00000030").mkdir()  # incomplete: no state file
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_00000010", "checkpoint_00000020"]
    latest, state = read_newest(tmp_path)
    assert state["step"] == 20 and latest.name == "checkpoint_00000020"
    assert read_newest(latest)[0] == latest
    with pytest.raises(FileNotFoundError):
        read_newest(tmp_path / "nope")


def test_a_refused_read_of_what_a_command_reads_is_one_line_and_training_s_keeps_its_traceback(tmp_path,
                                                                                                 monkeypatch):
    """A command's input that this user may not read (a checkpoint folder of mode 000: pyarrow's PermissionError
    at its state.pt) is one line naming it; training's own reads (no `where`) and errors a retry may fix (or a
    missing file) pass as they are."""
    denied = PermissionError(13, "Failed stat()ing path. Detail: [errno 13] Permission denied")
    with pytest.raises(StorageFailure) as refused, input_errors("--checkpoint run", tmp_path / "x"):
        raise denied
    assert str(refused.value) == f"--checkpoint run: cannot read {tmp_path / 'x'} (permission denied)"
    with pytest.raises(StorageFailure, match=r"^--checkpoint run: cannot read it \(permission denied\)$"), \
            input_errors("--checkpoint run"):
        raise denied
    for passing in (denied, FileNotFoundError(2, "No such file"), OSError("HTTP status 503 after 3 retries")):
        with pytest.raises(type(passing)), input_errors(None if passing is denied else "--checkpoint run"):
            raise passing

    for step in (10, 20):
        (tmp_path / checkpoint_name(step)).mkdir()
        write_state(tmp_path / checkpoint_name(step), _state(step))

    def is_file(self, name):
        if self.name == "checkpoint_00000020":
            raise denied
        return original(self, name)
    original = RunDir.is_file
    monkeypatch.setattr(RunDir, "is_file", is_file)
    with pytest.raises(PermissionError):  # training (checkpoint_candidates): as it is
        list_checkpoints(tmp_path)
    with pytest.raises(StorageFailure) as refused:  # no older checkpoint in its place, as for a state.pt
        read_newest(tmp_path, where="--checkpoint run")
    assert str(refused.value) == (f"--checkpoint run: cannot read {tmp_path.resolve() / 'checkpoint_00000020'} "
                                  f"(permission denied)")


def test_the_newest_checkpoint_that_reads_is_used(tmp_path, capsys):
    """A checkpoint still being written (Ray uploads it file by file) is named in one line and skipped."""
    for step in (10, 20):
        directory = tmp_path / checkpoint_name(step)
        directory.mkdir()
        write_state(directory, _state(step))
    newest = tmp_path / "checkpoint_00000020" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    checkpoint, state = read_newest(tmp_path)
    assert state["step"] == 10 and checkpoint.name == "checkpoint_00000010"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "checkpoint_00000020 cannot be read" in warning[0]
    assert warning[0].endswith("using checkpoint_00000010")
    (tmp_path / "checkpoint_00000010" / "state.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no checkpoint can be read: checkpoint_00000020 .*; checkpoint_0000"):
        read_newest(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint can be read"):
        read_newest(tmp_path / "checkpoint_00000020")  # one checkpoint named: no fallback


def test_a_small_checkpoint_cut_short_is_named_in_words_and_not_read_again(tmp_path, monkeypatch, capsys):
    """torch seeks before the start of a small state file cut short (OSError EINVAL): the file's fault, not the
    storage's, so it is neither retried nor named in torch's words."""
    import raydiff.runs.state as state_module

    for step, state in ((10, _state(10)), (20, {"step": 20, "w": torch.arange(1000.0), "config": {}, "ema": {}})):
        directory = tmp_path / checkpoint_name(step)
        directory.mkdir()
        write_state(directory, state)
    newest = tmp_path / "checkpoint_00000020" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:-1])
    with pytest.raises(OSError):  # what torch says
        torch.load(newest, weights_only=True)
    reads = []
    monkeypatch.setattr(state_module, "read_state", lambda path: reads.append(path.name) or read_state(path))
    monkeypatch.setattr(state_module, "READ_RETRY_S", 0.0)
    checkpoint, state = read_newest(tmp_path)
    assert state["step"] == 10 and reads == ["checkpoint_00000020", "checkpoint_00000010"]
    assert capsys.readouterr().err.strip().endswith(
        "checkpoint_00000020 cannot be read (not a readable checkpoint (truncated, empty, or not a torch file)); "
        "using checkpoint_00000010")


class Evil:
    pass


def test_checkpoints_refuse_pickled_code(tmp_path):
    torch.save({"x": Evil()}, tmp_path / "state.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        read_state(tmp_path)
    refused = r"\(it holds a Python object \(.*Evil\), which raydiff does not load: only tensors and plain data\)$"
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint can be read: {tmp_path.name} {refused}"):
        read_newest(tmp_path)


_FULL_TEMPORARY_FOLDER = """
import os, resource, signal, sys, tempfile, torch
os.environ["TMPDIR"] = sys.argv[1]
from raydiff.runs.checkpoint import CheckpointWriter
from raydiff.storage.errors import storage_failure
from raydiff.storage.rundir import RunDir
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
for in_place in (True, False):
    writer = CheckpointWriter(RunDir(sys.argv[2]))
    writer._in_place = in_place
    writer.start("checkpoint_00000001", {"weights": torch.zeros(2_000_000), "step": 1})
    name, error = writer.outcome(wait=True)
    print(type(error).__name__, storage_failure(error, sys.argv[2], "writing the checkpoint of step 1",
                                                needed_bytes=8_000_000))
    writer.close()
"""


def test_a_checkpoint_that_does_not_fit_says_which_folder_is_full(tmp_path):
    """torch's zip writer raises a RuntimeError of its own ("unexpected pos") over the OSError of a write that
    failed: a checkpoint staged in a full temporary folder was told as run.storage's fault (its free space shown,
    and "set another run.storage"), and one written in place raised out of `start`. A real write past a file size
    limit, in a process of its own."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir()
    proc = subprocess.run([sys.executable, "-c", _FULL_TEMPORARY_FOLDER, str(tmp_path / "tmp"), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    in_place, staged = proc.stdout.splitlines()
    assert in_place.startswith("OSError ") and "file too large" in in_place and "run.storage" in in_place, in_place
    assert staged.startswith(("OSError ", "ElsewhereError ")) and f"temporary folder {tmp_path / 'tmp'}" in staged \
        and "TMPDIR" in staged and "set another run.storage" not in staged, staged
    assert list_checkpoints(tmp_path / "run") == [] and list((tmp_path / "tmp").iterdir()) == []


def test_a_checkpoint_write_is_never_visible_before_it_is_complete(tmp_path, monkeypatch):
    """Locally the state is written under a hidden name and renamed into place: a write that fails (here the disk
    fills half way) leaves nothing a reader lists, and nothing behind; the error arrives with the outcome."""
    from raydiff.runs import checkpoint as module
    from raydiff.runs.checkpoint import CheckpointWriter
    from raydiff.storage.rundir import RunDir

    writer = CheckpointWriter(RunDir(tmp_path))
    writer.start("checkpoint_00000010", {"step": 10, "weights": torch.ones(4)})
    assert writer.outcome(wait=True) == ("checkpoint_00000010", None)
    assert writer.outcome(wait=False) is None  # collected once

    def full_disk(state, f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.torch, "save", full_disk)
    writer.start("checkpoint_00000020", {"step": 20})
    name, error = writer.outcome(wait=True)
    assert name == "checkpoint_00000020" and isinstance(error, OSError) and error.errno == 28
    assert [c.name for c in list_checkpoints(tmp_path)] == ["checkpoint_00000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000010"]
    writer.close()


def test_a_checkpoint_on_a_mounted_file_system_is_moved_into_place_in_the_background(tmp_path):
    """Storage on another file system than the temporary folder's (NFS, a disk of its own): staged locally, then
    copied under the hidden name and renamed on the writer's thread; a copy that fails leaves nothing behind."""
    from raydiff.runs.checkpoint import CheckpointWriter
    from raydiff.storage.rundir import RunDir

    writer = CheckpointWriter(RunDir(tmp_path))
    writer._in_place = False  # what a mount on another device gets
    writer.start("checkpoint_00000010", {"step": 10, "weights": torch.ones(3)})
    assert writer.outcome(wait=True) == ("checkpoint_00000010", None)
    assert torch.equal(read_state(tmp_path / "checkpoint_00000010")["weights"], torch.ones(3))
    (tmp_path / "checkpoint_00000020").write_text("in the way")  # the rename into place cannot happen
    writer.start("checkpoint_00000020", {"step": 20})
    name, error = writer.outcome(wait=True)
    assert name == "checkpoint_00000020" and isinstance(error, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000010", "checkpoint_00000020"]
    writer.close()


def test_a_checkpoint_on_an_object_store_is_uploaded_in_the_background(s3_server):
    from raydiff.runs.checkpoint import CheckpointWriter
    from raydiff.storage.rundir import RunDir

    endpoint, client = s3_server
    client.create_bucket(Bucket="ckpt-writer")
    run_dir = RunDir("s3://ckpt-writer/run", endpoint=endpoint)
    writer = CheckpointWriter(run_dir)
    writer.start("checkpoint_00000010", {"step": 10, "weights": torch.arange(6.0)})
    assert writer.outcome(wait=True) == ("checkpoint_00000010", None)
    [checkpoint] = list_checkpoints(run_dir)
    assert checkpoint.name == "checkpoint_00000010"
    assert torch.equal(read_state(checkpoint)["weights"], torch.arange(6.0))
    writer.close()


def test_an_upload_that_fails_part_way_leaves_no_checkpoint_on_the_object_store(s3_server, monkeypatch):
    """A read of the staged state that fails after some chunks went up (EIO): pyarrow completes the upload as the
    stream closes, and a checkpoint cut short was listed as the newest. It is removed; the error is the write's."""
    from raydiff.runs import checkpoint as checkpoint_module
    from raydiff.runs.checkpoint import CheckpointWriter
    from raydiff.storage.rundir import RunDir

    endpoint, client = s3_server
    client.create_bucket(Bucket="ckpt-cut")
    copy = checkpoint_module.shutil.copyfileobj

    def failing(source, sink, length):
        sink.write(source.read(100))
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(checkpoint_module.shutil, "copyfileobj", failing)
    run_dir = RunDir("s3://ckpt-cut/run", endpoint=endpoint)
    writer = CheckpointWriter(run_dir)
    writer.start("checkpoint_00000010", {"step": 10, "weights": torch.arange(6.0)})
    name, error = writer.outcome(wait=True)
    assert name == "checkpoint_00000010" and isinstance(error, OSError) and error.errno == 5
    keys = [entry["Key"] for entry in client.list_objects_v2(Bucket="ckpt-cut").get("Contents", [])]
    assert not [key for key in keys if key.endswith("state.pt")] and list_checkpoints(run_dir) == [], keys
    monkeypatch.setattr(checkpoint_module.shutil, "copyfileobj", copy)
    writer.close()


def test_what_an_interrupted_write_left_is_removed(tmp_path):
    """A half-written checkpoint, and the hidden file of a post-hoc EMA snapshot or grid whose process was killed
    outright; a user's own hidden files, and the finished ones, stay."""
    from raydiff.runs.checkpoint import remove_partial_writes

    (tmp_path / ".checkpoint_00000030.partial-1a2b3c4d").mkdir()
    (tmp_path / ".checkpoint_00000030.partial-1a2b3c4d" / ".state.pt.tmp").write_bytes(b"half")
    (tmp_path / "checkpoint_00000020").mkdir()
    (tmp_path / "ema_snapshots").mkdir()
    (tmp_path / "ema_snapshots" / ".step_00000030.pt.0a1b2c3d.tmp").write_bytes(b"half")
    (tmp_path / "ema_snapshots" / "step_00000020.pt").write_bytes(b"whole")
    (tmp_path / ".summary.json.99aa00ff.tmp").write_bytes(b"half")
    (tmp_path / ".notes.tmp").write_bytes(b"the user's")
    assert remove_partial_writes(tmp_path) == [".checkpoint_00000030.partial-1a2b3c4d", ".summary.json.99aa00ff.tmp",
                                               "ema_snapshots/.step_00000030.pt.0a1b2c3d.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp", "checkpoint_00000020", "ema_snapshots"]
    assert [p.name for p in (tmp_path / "ema_snapshots").iterdir()] == ["step_00000020.pt"]


@pytest.mark.parametrize("written, why", [
    ("", "empty: its write was interrupted"),
    ('{"ray_version":"VERSION","checkpoint_results":[{"version":0,"checkpoint_dir_name":"checkpo',
     "cut short by an interrupted write (SIZE bytes)"),
    ('{"ray_version":"2.9.0","checkpoint_results":[]}', "written by Ray 2.9.0, this is Ray VERSION"),
    ('{"ray_version":"VERSION","checkpoint_results":[{"checkpoint_dir_name":"checkpoint_00000030"}]}',
     "it lists checkpoint_00000030, which is gone"),
])
def test_a_ray_checkpoint_list_that_ray_would_refuse_is_removed_and_the_checkpoints_kept(tmp_path, written, why):
    """Ray Train rewrites its list in place (a kill can cut it short) and refuses a list it cannot use."""
    (tmp_path / "checkpoint_00000020").mkdir()
    written = written.replace("VERSION", version("ray"))
    (tmp_path / RAY_CHECKPOINT_LIST).write_text(written)
    why = why.replace("VERSION", version("ray")).replace("SIZE", str(len(written)))
    assert drop_unusable_ray_checkpoint_list(tmp_path) == (
        f"removed Ray Train's checkpoint list {RAY_CHECKPOINT_LIST} ({why}); "
        f"the run continues from the newest checkpoint on storage")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000020"]


def test_a_ray_checkpoint_list_that_ray_can_use_is_kept(tmp_path):
    (tmp_path / "checkpoint_00000020").mkdir()
    usable = json.dumps({"ray_version": version("ray"), "checkpoint_results": [
        {"checkpoint_dir_name": "checkpoint_00000020"}]})
    (tmp_path / RAY_CHECKPOINT_LIST).write_text(usable)
    assert drop_unusable_ray_checkpoint_list(tmp_path) is None
    assert drop_unusable_ray_checkpoint_list(tmp_path / "no-run-yet") is None
    assert (tmp_path / RAY_CHECKPOINT_LIST).read_text() == usable


def _write_ray_list(run_dir, *steps: int) -> None:
    (run_dir / RAY_CHECKPOINT_LIST).write_text(json.dumps({"ray_version": version("ray"), "checkpoint_results": [
        {"checkpoint_dir_name": checkpoint_name(step)} for step in steps]}))


def _write_checkpoints(run_dir, *steps: int) -> None:
    """Checkpoint folders as list_checkpoints finds them (a state file each; what is in it does not matter here)."""
    for step in steps:
        (run_dir / checkpoint_name(step)).mkdir()
        (run_dir / checkpoint_name(step) / "state.pt").write_bytes(b"")


def _folders(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.is_dir())


def test_checkpoints_ray_never_kept_go_once_it_keeps_newer_ones_and_keep_checkpoints_as_many(tmp_path):
    """Written but never reported (the workers lost between the write and the report): Ray's pruning never sees
    them. Those older than every checkpoint Ray keeps, past the newest run.keep_checkpoints, go; the rest stay."""
    assert remove_checkpoints_ray_never_kept(tmp_path, keep=3) == []  # no list yet: nothing to go by
    _write_checkpoints(tmp_path, 10, 20, 30, 35, 40, 50)
    (tmp_path / "checkpoint_00000005").mkdir()  # no state file: not a checkpoint raydiff wrote
    assert remove_checkpoints_ray_never_kept(tmp_path, keep=3) == []
    _write_ray_list(tmp_path, 10)  # naming only what has no state: nothing to go by
    assert remove_checkpoints_ray_never_kept(tmp_path, keep=3) == []
    _write_ray_list(tmp_path, 30, 40)
    assert remove_checkpoints_ray_never_kept(tmp_path, keep=5) == ["checkpoint_00000010"]
    assert remove_checkpoints_ray_never_kept(tmp_path, keep=3) == ["checkpoint_00000020"]
    # 35: newer than a checkpoint Ray keeps (it goes once Ray has let 30 go); 50: the one a start restores.
    assert _folders(tmp_path) == ["checkpoint_00000005", "checkpoint_00000030", "checkpoint_00000035",
                                  "checkpoint_00000040", "checkpoint_00000050"]


def test_the_checkpoints_of_a_dropped_ray_list_count_towards_keep_checkpoints(tmp_path):
    """A list Ray would refuse is dropped, and Ray's next one names only the checkpoints written since: the older
    ones go as Ray would have let them go, the newest run.keep_checkpoints of all of them staying."""
    _write_checkpoints(tmp_path, 80, 90, 100, 110)
    _write_ray_list(tmp_path, 110)
    assert remove_checkpoints_ray_never_kept(tmp_path, keep=3) == ["checkpoint_00000080"]
    assert _folders(tmp_path) == ["checkpoint_00000090", "checkpoint_00000100", "checkpoint_00000110"]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "mounted"])
def test_a_checkpoint_is_on_disk_before_it_takes_its_name_and_its_name_after(tmp_path, monkeypatch, in_place):
    """A sweep keeps one checkpoint: a power loss after the older one was pruned must not leave an empty state.pt
    (ext4's delayed allocation, XFS). Only what is renamed into place is synced, not the staged copy."""
    from raydiff.runs.checkpoint import CheckpointWriter
    from raydiff.storage.rundir import RunDir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    writer = CheckpointWriter(RunDir(tmp_path / "run"))
    writer._in_place = in_place
    (tmp_path / "run").mkdir()
    events = syncs_and_renames(monkeypatch)
    from raydiff.runs import checkpoint as module

    synced_on: list[str] = []
    sync_tree = module.sync_tree
    monkeypatch.setattr(module, "sync_tree", lambda folder: synced_on.append(threading.current_thread().name)
                        or sync_tree(folder))
    writer.start("checkpoint_00000010", {"step": 10, "weights": torch.ones(3)})
    assert writer.outcome(wait=True) == ("checkpoint_00000010", None)
    writer.close()
    assert [name.startswith("raydiff-checkpoint") for name in synced_on] == [True]  # not the training thread
    final = os.path.realpath(tmp_path / "run" / "checkpoint_00000010")
    renamed = events.index(("rename", final))
    synced = [path for kind, path in events[:renamed] if kind == "fsync"]
    assert synced, "nothing was fsynced before the rename"
    partial = os.path.dirname(synced[0])
    assert os.path.basename(partial).startswith(".checkpoint_00000010.partial-")
    assert synced == [f"{partial}/state.pt", partial]
    assert events[renamed + 1:] == [("fsync", os.path.realpath(tmp_path / "run"))]
    assert torch.equal(read_state(tmp_path / "run" / "checkpoint_00000010")["weights"], torch.ones(3))


@pytest.mark.parametrize("preset, overrides", [
    ("smoke", []), ("smoke", ["train.ema=posthoc"]),
    ("smoke", ["train.ema=posthoc", "train.ema_sigma_rels=[0.05,0.1,0.2]"]),
    ("default", []), ("default", ["train.ema=posthoc"]),
], ids=["smoke", "smoke posthoc", "smoke posthoc 3 widths", "default", "default posthoc"])
def test_a_checkpoint_takes_no_more_than_its_estimate(preset, overrides, tmp_path):
    """The estimate is what the driver checks the storage's room against, and what a full disk's message says one
    needs: it left out the post-hoc averages, one fp32 copy of the model per width, which a checkpoint holds too."""
    import errno
    import io
    from types import SimpleNamespace

    from raydiff.model.weight_averages import PowerEma, make_ema
    from raydiff.runs.checkpoint import checkpoint_bytes
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state
    from raydiff.storage.errors import megabytes
    from raydiff.training.chief_writes import ChiefWrites
    from raydiff.training.step import make_optimizer

    cfg = load_config(preset, overrides, check_source=False)
    model = build_model(cfg)
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # AdamW's moments exist from its first step
    posthoc = PowerEma(model, cfg.train.ema_sigma_rels) if cfg.train.ema == "posthoc" else None
    objects = TrainingState(model, make_ema(model), optimizer, torch.amp.GradScaler("cpu", enabled=False), posthoc)
    saved = io.BytesIO()
    torch.save(checkpoint_state(objects, Progress(step=10), cfg.train.global_batch, cfg.to_dict()), saved)
    assert checkpoint_bytes(cfg) >= len(saved.getvalue())
    # A full disk's message (rank 0's guard of its writes) says the same figure as the driver's check.
    chief = ChiefWrites(SimpleNamespace(cfg=cfg, is_chief=True, run_dir=RunDir(tmp_path)))

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    chief.write("writing the checkpoint of step 10", full_disk, checkpoint=True)
    chief.close()
    assert chief.failure is not None and f"{megabytes(checkpoint_bytes(cfg))} needed" in str(chief.failure)


def test_a_full_temporary_folder_is_named_as_such_not_as_the_run_storage(tmp_path, monkeypatch):
    """A run folder on another file system or a bucket stages the state in the temporary folder first: a full one
    there names that folder, its free space and TMPDIR, and leaves nothing there."""
    from raydiff.runs import checkpoint as module
    from raydiff.runs.checkpoint import CheckpointWriter
    from raydiff.storage.errors import storage_failure
    from raydiff.storage.rundir import RunDir

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    writer = CheckpointWriter(RunDir(tmp_path / "run"))
    writer._in_place = False  # what a mount on another device or a bucket gets

    def full_disk(state, f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.torch, "save", full_disk)
    writer.start("checkpoint_00000020", {"step": 20})  # the error arrives with the outcome, as a move's would
    name, error = writer.outcome(wait=True)
    writer.close()
    assert name == "checkpoint_00000020" and isinstance(error, OSError)
    # What rank 0's cadence makes of it (raydiff.training.cadence: `_settle`).
    line = str(storage_failure(error, str(tmp_path / "run"), "writing the checkpoint of step 20",
                               needed_bytes=3_000_000))
    assert line.startswith(f"temporary folder {temp} (where checkpoints are staged on their way to run.storage): "
                           f"writing the checkpoint of step 20 failed: no space left on device; "), line
    assert " MB free, 3.0 MB needed. " in line and "free space there or set another TMPDIR, then " in line
    assert f"storage {tmp_path / 'run'}" not in line and "set another run.storage" not in line
    assert list(temp.iterdir()) == []
