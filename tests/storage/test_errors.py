"""Storage errors no retry can fix (a full disk, a read-only file system, a missing bucket, refused credentials),
told apart from those a retry can (a 503, a timeout, a dropped connection), and the one line a full disk gives,
naming the folder that is full."""

from __future__ import annotations

import pickle

import pytest

from raydiff.storage.errors import elsewhere, permanent_reason, storage_failure


@pytest.mark.parametrize("error,reason", [
    (OSError(28, "No space left on device"), "no space left on device"),
    (OSError(30, "Read-only file system"), "read-only file system"),
    (OSError(13, "Permission denied"), "permission denied"),
    (OSError("When uploading part for key 'r/x' in bucket 'b': AWS Error NO_SUCH_BUCKET during "
             "CreateMultipartUpload operation: The specified bucket does not exist"), "the bucket does not exist"),
    (OSError("When reading information for key 'r' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject "
             "operation: No response body."), "access denied"),
    (OSError("AWS Error INVALID_ACCESS_KEY_ID during PutObject operation"), "the credentials were refused"),
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
