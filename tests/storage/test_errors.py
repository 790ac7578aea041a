"""Storage errors no retry can fix (a full disk, a read-only file system, a missing bucket, refused credentials),
told apart from those a retry can (a 503, a timeout, a dropped connection), and the one line a full disk gives,
naming the folder that is full."""

from __future__ import annotations

import pickle

import pytest

from raydiff.storage.atomic import new_file
from raydiff.storage.errors import StorageFailure, elsewhere, output_errors, permanent_reason, storage_failure


@pytest.mark.parametrize("error,reason", [
    (OSError(28, "No space left on device"), "no space left on device"),
    (OSError(30, "Read-only file system"), "read-only file system"),
    (OSError(13, "Permission denied"), "permission denied"),
    (OSError("When uploading part for key 'r/x' in bucket 'b': AWS Error NO_SUCH_BUCKET during "
             "CreateMultipartUpload operation: The specified bucket does not exist"), "the bucket does not exist"),
    (OSError("When reading information for key 'r' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject "
             "operation: No response body."), "access denied"),
    (OSError("AWS Error INVALID_ACCESS_KEY_ID during PutObject operation"), "the credentials were refused"),
    # Temporary credentials that ran out: every restart met them again, up to run.max_failures.
    (OSError("AWS Error UNKNOWN (HTTP status 400) during PutObject operation: ExpiredToken: The provided token has "
             "expired."), "the credentials were refused"),
    (OSError("AWS Error UNKNOWN during GetObject operation: AllAccessDisabled: All access to this object has been "
             "disabled"), "access denied"),
    (RuntimeError("Training failed ... OSError: [Errno 28] No space left on device"), "no space left on device"),
])
def test_storage_errors_no_retry_can_fix(error, reason):
    assert permanent_reason(error) == reason


@pytest.mark.parametrize("error", [
    OSError("When uploading part for key 'r/x' in bucket 'b': AWS Error SLOW_DOWN during UploadPart operation: "
            "Please reduce your request rate."),
    OSError("AWS Error NETWORK_CONNECTION during UploadPart operation: curlCode: 28, Timeout was reached"),
    OSError(104, "Connection reset by peer"),
    OSError(5, "Input/output error"),
])
def test_storage_errors_a_retry_may_fix(error):
    assert permanent_reason(error) is None


def test_a_full_disk_says_how_much_is_free_and_what_the_write_needed(tmp_path):
    failure = storage_failure(OSError(28, "No space left on device"), str(tmp_path), "writing checkpoint_00000020",
                              needed_bytes=3_000_000)
    assert str(failure).startswith(f"storage {tmp_path}: writing checkpoint_00000020 failed: no space left on device; ")
    assert " MB free, 3.0 MB needed. Nothing already saved was lost" in str(failure)
    unsized = storage_failure(OSError(28, "No space left on device"), str(tmp_path), "writing metrics.jsonl")
    assert " MB free. Nothing already saved was lost" in str(unsized)  # a write of no known size: the room left
    assert storage_failure(OSError(104, "Connection reset by peer"), str(tmp_path), "writing x") is None


def test_a_quota_says_what_the_write_needed_not_the_disks_free_space(tmp_path):
    # The file system's free space (tens of GB) read as if there were room: a quota is the user's own.
    failure = str(storage_failure(OSError(122, "Disk quota exceeded"), str(tmp_path), "writing checkpoint_00000020",
                                  needed_bytes=858_000_000))
    assert failure.startswith(f"storage {tmp_path}: writing checkpoint_00000020 failed: disk quota exceeded; 858.0 MB "
                              f"needed. Nothing already saved was lost; raise the quota"), failure
    assert " MB free" not in failure


def test_a_full_folder_other_than_the_storage_is_named_with_what_chose_it(tmp_path):
    """A checkpoint staged in the temporary folder on its way to a mount or bucket: that folder is full, not the
    run's storage. The error keeps its kind across a process (Ray sends a worker's error to the controller)."""
    full = elsewhere(OSError(28, "No space left on device"), str(tmp_path), f"temporary folder {tmp_path}", "TMPDIR")
    assert isinstance(full, OSError) and full.errno == 28
    for error in (full, pickle.loads(pickle.dumps(full))):
        line = str(storage_failure(error, "s3://bucket/runs/a", "writing the checkpoint of step 20"))
        assert line.startswith(f"temporary folder {tmp_path}: writing the checkpoint of step 20 failed: no space "
                               f"left on device; ")
        assert " MB free. Nothing already saved was lost; free space there or set another TMPDIR, then " in line
    passing = elsewhere(OSError(104, "Connection reset by peer"), str(tmp_path), "temporary folder", "TMPDIR")
    assert storage_failure(passing, "s3://bucket/runs/a", "writing x") is None


def test_a_folder_where_a_commands_output_file_goes_is_one_line_and_nothing_is_left(tmp_path):
    """A safety net under the commands' own checks: the rename onto the folder was a traceback."""
    out = tmp_path / "grid.png"
    out.mkdir()
    with pytest.raises(StorageFailure) as caught, output_errors("--out", out), new_file(out) as tmp:
        tmp.write_bytes(b"image")
    assert str(caught.value) == (f"--out {out}: writing it failed: is a directory: {out}; nothing half-written was "
                                 f"left there; choose another --out")
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"] and list(out.iterdir()) == []
    (tmp_path / "file").write_text("mine")
    with pytest.raises(StorageFailure) as caught, output_errors("--out", tmp_path / "file" / "x.png"):
        with new_file(tmp_path / "file" / "x.png") as tmp:
            tmp.write_bytes(b"image")
    assert str(caught.value) == (f"--out {tmp_path / 'file' / 'x.png'}: writing it failed: file exists: "
                                 f"{tmp_path / 'file'}; nothing half-written was left there; choose another --out")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_folder_met_outside_a_commands_output_is_not_blamed_on_it(tmp_path):
    (tmp_path / "source").mkdir()
    with pytest.raises(IsADirectoryError), output_errors("OUT", tmp_path / "prepared"):
        (tmp_path / "source").read_bytes()  # reading its input beside OUT, not writing OUT
    (tmp_path / "source" / "x.png").mkdir()
    with pytest.raises(IsADirectoryError), output_errors("OUT", tmp_path / "prepared"):
        (tmp_path / "source" / "x.png").read_bytes()


def test_an_output_named_from_home_is_judged_where_it_is_written(tmp_path, monkeypatch):
    # `--out=~/grid.png` reaches the command unexpanded; it writes to the expanded path.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "grid.png").mkdir()
    with pytest.raises(StorageFailure, match="^--out ~/grid.png: writing it failed: is a directory"), \
            output_errors("--out", "~/grid.png"), new_file(tmp_path / "grid.png") as tmp:
        tmp.write_bytes(b"image")
