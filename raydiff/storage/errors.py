"""Storage errors that no retry can fix, told apart from those a retry can: one line for the user, and no worker
restarts spent on a full disk.

Why: a full disk, a read-only mount, a refused permission or credential and a missing bucket fail the same way on
every retry, so Ray Train's restarts (`run.max_failures`) would only multiply the tracebacks; a 503, a timeout or a
dropped connection passes, and those keep being retried (pyarrow retries each request, Ray restarts the workers:
`retryable_in` tells, from its text, an error that outlasted the retries).
Both kinds arrive as OSError: pyarrow puts the S3 or GCS error in the message. A write may fail in a local folder
other than the storage it is for (a checkpoint staged in the temporary folder on its way to a mount or a bucket):
`ElsewhereError` carries that folder, so that the line names it, its free space and the setting that chose it,
not the run's storage. A command's output (`output_errors`) is told in one line too when a folder stands where
its file goes, or a file where its folder does: a mistaken --out, not a storage failure, but no traceback either.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# errno -> what the user reads.
PERMANENT_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                    errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                    errno.EPERM: "operation not permitted", errno.EFBIG: "file too large"}
# Text in pyarrow's S3 / GCS errors (and in errors that crossed a process as text) -> what the user reads.
PERMANENT_MESSAGES = (
    ("No space left on device", "no space left on device"), ("Disk quota exceeded", "disk quota exceeded"),
    ("Read-only file system", "read-only file system"), ("Permission denied", "permission denied"),
    ("NO_SUCH_BUCKET", "the bucket does not exist"), ("NoSuchBucket", "the bucket does not exist"),
    ("The specified bucket does not exist", "the bucket does not exist"),
    ("ACCESS_DENIED", "access denied"), ("AccessDenied", "access denied"), ("PERMISSION_DENIED", "access denied"),
    ("InvalidAccessKeyId", "the credentials were refused"), ("INVALID_ACCESS_KEY_ID", "the credentials were refused"),
    ("SignatureDoesNotMatch", "the credentials were refused"),
    ("SIGNATURE_DOES_NOT_MATCH", "the credentials were refused"),
    ("UNAUTHENTICATED", "the credentials were refused"),
    # Temporary credentials that ran out, and a bucket switched off: a restart meets them again.
    ("ExpiredToken", "the credentials were refused"), ("EXPIRED_TOKEN", "the credentials were refused"),
    ("The provided token has expired", "the credentials were refused"),
    ("InvalidToken", "the credentials were refused"), ("AllAccessDisabled", "access denied"),
)
# Text in pyarrow's S3 / GCS errors that a retry can fix (as Ray Data's `retried_io_errors`): a server's 5xx or
# throttling, a dropped connection, a timeout. Met by raydiff, such an error outlasted the filesystem's retries.
RETRYABLE_MESSAGES = ("HTTP status 5", "SLOW_DOWN", "SlowDown", "INTERNAL_FAILURE", "NETWORK_CONNECTION",
                      "Timeout was reached", "UNAVAILABLE", "DEADLINE_EXCEEDED")
ADVICE = {  # {setting}: where the user chose the storage (run.storage, or a command's --out)
    "no space left on device": "free space there or set another {setting}",
    "disk quota exceeded": "raise the quota, free space or set another {setting}",
    "file too large": "raise the file-size limit or set another {setting}",
    "the bucket does not exist": "create the bucket or correct {setting}",
    "the credentials were refused": "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                                    "GOOGLE_APPLICATION_CREDENTIALS or the instance's role)",
}
FULL = ("no space left on device", "disk quota exceeded")  # a full disk or quota: room to make
# Where the file system's free space is worth telling: a quota is this user's own, which its free space does not show.
NO_SPACE = "no space left on device"
# A disk full or read-only: the machine's state, never a fault of the program, wherever it is met; what to do.
DISK_FIXES = {
    errno.ENOSPC: "make room there", errno.EDQUOT: "make room there",
    errno.EFBIG: "raise the file-size limit", errno.EROFS: "make it writable",
}


def permanent_reason(exc: BaseException) -> str | None:
    """What makes `exc` (or an error it was raised from) a storage error no retry can fix; None when a retry might."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in PERMANENT_ERRNOS:
            return PERMANENT_ERRNOS[error.errno]
        reason = permanent_reason_in(str(error))
        if reason is not None:
            return reason
        error = error.__cause__ or error.__context__
    return None


def permanent_reason_in(text: str) -> str | None:
    """`permanent_reason` of an error known only by its text (a log line, an error that crossed a process)."""
    return next((reason for needle, reason in PERMANENT_MESSAGES if needle in text), None)


def retryable_in(text: str) -> bool:
    """Whether an object store's error, known by its text, is one a retry can fix (RETRYABLE_MESSAGES)."""
    return permanent_reason_in(text) is None and any(needle in text for needle in RETRYABLE_MESSAGES)


class StorageFailure(RuntimeError):
    """A storage error no retry can fix; the message is the one line the user reads (`failure_message`)."""


class ElsewhereError(OSError):
    """An OSError met in a local folder other than the storage a write is for; made by `elsewhere`."""

    folder: str = ""  # the local folder, whose free space a full disk's line tells
    where: str = ""  # how the line names it, e.g. "temporary folder /tmp (where checkpoints are staged ...)"
    setting: str = ""  # what chose it, in the advice: "set another TMPDIR"


def elsewhere(error: OSError, folder: str, where: str, setting: str) -> ElsewhereError:
    """`error`, met in the local `folder` rather than in the storage the write was for, as `storage_failure` should
    name it: `where` (how the line names the folder) and `setting` (what chose it). Same errno and text."""
    moved = ElsewhereError(*error.args)  # (errno, strerror) or the message: pickles as OSError does
    moved.filename = error.filename
    moved.folder, moved.where, moved.setting = folder, where, setting
    return moved


def failure_message(storage: str, operation: str, reason: str, detail: str = "", *, where: str = "",
                    setting: str = "run.storage") -> str:
    """What failed where, why, and what to do, in one line.

    :param storage: the run's storage (the run directory).
    :param operation: what was being written, e.g. "writing the checkpoint of step 80".
    :param reason: what went wrong, from `permanent_reason`.
    :param detail: more about it (the free space and what the write needed), or "".
    :param where: how to name the folder that failed, when it is not the run's storage.
    :param setting: what chose that folder, for the advice.
    """
    return (f"{where or 'storage ' + storage}: {operation} failed: {reason}{'; ' + detail if detail else ''}. "
            f"Nothing already saved was lost; {advice(reason, setting)}, then run the same command again to continue "
            f"from the newest checkpoint")


def advice(reason: str, setting: str = "run.storage") -> str:
    """What to do about a storage error no retry can fix, where `setting` chose the storage."""
    return ADVICE.get(reason, "make it writable or set another {setting}").format(setting=setting)


def storage_failure(exc: BaseException, storage: str, operation: str, *,
                    needed_bytes: int | None = None) -> StorageFailure | None:
    """`exc` as a StorageFailure when no retry can fix it (None otherwise). A full local disk says how much is
    free and, given `needed_bytes`, what the write needed. An error met in another local folder (`elsewhere`) is
    told of that folder instead of `storage`."""
    reason = permanent_reason(exc)
    if reason is None:
        return None
    where, setting = "", "run.storage"
    other = _elsewhere(exc)
    if other is not None:
        storage, where, setting = other.folder, other.where, other.setting
    detail = ""
    if reason == NO_SPACE and "://" not in storage:
        free = free_bytes(storage)
        if free is not None:
            detail = f"{megabytes(free)} free" + (f", {megabytes(needed_bytes)} needed" if needed_bytes else "")
    elif reason in FULL and needed_bytes:
        detail = f"{megabytes(needed_bytes)} needed"
    return StorageFailure(failure_message(storage, operation, reason, detail, where=where, setting=setting))


def _elsewhere(exc: BaseException) -> ElsewhereError | None:
    """The ElsewhereError that `exc` is or was raised from, if any."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, ElsewhereError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def setting_with(name: str, value: object) -> str:
    """A command's argument and its value as its messages show them: `--out 'x'` for an option, `OUT = 'x'` for a
    positional."""
    return f"{name} {value!r}" if name.startswith("-") else f"{name} = {value!r}"


@contextmanager
def output_errors(setting: str, path: str | os.PathLike, *,
                  passing: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Raise the storage errors no retry can fix that the block meets writing a command's output `path` (chosen by
    `setting`, e.g. "--out") as one StorageFailure line: what failed, why, the free space of a full local disk, and
    what to do; and so a folder met where the block writes a file there, or a file where it makes a folder. The
    block's writes leave nothing half-written (`raydiff.storage.atomic`); its other errors pass, and those of
    `passing` as they are: lines already told of what the block reads (a source file it may not read)."""
    try:
        yield
    except passing:
        raise
    except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:
        # A folder where a file goes, or a file where a folder does (the commands check what they can first).
        if not _within(exc, path):  # met elsewhere (reading a source): not the output's to tell
            raise
        why = f"{exc.strerror.lower()}: {exc.filename2 or exc.filename}" if exc.strerror else str(exc)
        raise StorageFailure(f"{setting} {path}: writing it failed: {why}; nothing half-written was left there; "
                             f"choose another {setting}") from None
    except Exception as exc:  # OSError, or a library's own (safetensors': "I/O error: No space left on device")
        reason = permanent_reason(exc)
        if reason is None:
            raise
        free = free_bytes(str(path)) if reason == NO_SPACE and "://" not in str(path) else None
        detail = "" if free is None else f" ({megabytes(free)} free)"
        raise StorageFailure(f"{setting} {path}: writing it failed: {reason}{detail}; nothing half-written was left "
                             f"there; {advice(reason, setting)}") from None


def _within(exc: OSError, path: str | os.PathLike) -> bool:
    """Whether `exc` names where the output's writes go: the local `path` itself, inside it, a folder on the way
    to it (a file there), or the hidden name it is built under beside it (`raydiff.storage.atomic`); not another
    file beside it (a source read from the same folder)."""
    if "://" in str(path):
        return False
    out = Path(path).expanduser().resolve()
    named = [Path(os.fsdecode(name)).expanduser().resolve() for name in (exc.filename, exc.filename2)
             if isinstance(name, (str, bytes, os.PathLike))]
    return any(name == out or out in name.parents or name in out.parents
               or (name.parent == out.parent and name.name.startswith(f".{out.name}")) for name in named)


def disk_failure(exc: OSError) -> str | None:
    """`exc` in one line when it is a full or read-only disk (DISK_FIXES), met where no command expected a write to
    fail: the reason, the file where the system names it, what to do; None for any other error."""
    if exc.errno not in DISK_FIXES:
        return None
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{PERMANENT_ERRNOS[exc.errno]}{where}; {DISK_FIXES[exc.errno]}, then run the same command again"


def free_bytes(folder: str) -> int | None:
    """Free bytes on the file system of a local folder (its nearest existing ancestor); None if unknown."""
    usage = disk_usage(folder)
    return None if usage is None else usage.free


def disk_usage(folder: str) -> shutil._ntuple_diskusage | None:
    """shutil.disk_usage of a local folder's file system (its nearest existing ancestor's): total, used and free
    bytes, free as an unprivileged user may use it; None if unknown."""
    try:
        return shutil.disk_usage(nearest_existing(folder))
    except OSError:
        return None


def nearest_existing(folder: str) -> Path:
    """`folder`, or its nearest ancestor that exists (where a folder not made yet will be)."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
