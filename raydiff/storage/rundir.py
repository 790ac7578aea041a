"""A run directory on any storage: a local or NFS folder, or an s3:// / gs:// prefix.

Everything raydiff writes next to Ray Train's checkpoints (config, metrics, events, samples, summary) goes
through this class, so the same run works on a laptop's disk and on a cluster's bucket. Writes are whole-file
and atomic: a local file is written beside its target and renamed; an object store PUT is atomic already.
"""

from __future__ import annotations

import io
import os
import tempfile
import uuid
from pathlib import Path, PurePosixPath

import pyarrow.fs as pafs

from raydiff.storage.atomic import append_lines, new_file
from raydiff.storage.errors import advice, permanent_reason
from raydiff.storage.fs import filesystem_for, is_remote


class RunInUse(RuntimeError):
    """Another live raydiff run holds the folder's lease (`raydiff.storage.lease`): the same run directory, from this
    machine, another Ray instance or another cluster sharing the storage."""


def unwritable(folder: RunDir | str | os.PathLike, *, endpoint: str | None = None) -> str | None:
    """Why files cannot be written in `folder` (a RunDir, or its URI; existing or to be created), in one line;
    None if they can. Nothing is left behind (see RunDir.check_writable)."""
    try:
        (folder if isinstance(folder, RunDir) else RunDir(folder, endpoint=endpoint)).check_writable()
    except ValueError as exc:  # an unsupported URI scheme
        return str(exc)
    except OSError as exc:
        if exc.strerror and exc.filename:
            return f"{exc.strerror}: {exc.filename}"
        reason = permanent_reason(exc)  # an object store's error, in pyarrow's words
        return f"{reason}: {advice(reason)}" if reason else str(exc).splitlines()[0][:200]
    return None


class RunDir:
    """A folder of files addressed by relative names (`metrics.jsonl`, `samples/step_00000100.png`).

    :param uri: a local path or an s3:// / gs:// URI.
    :param endpoint: S3/GCS endpoint URL override (null: AWS_ENDPOINT_URL or the provider's default).
    """

    def __init__(self, uri: str | os.PathLike, *, endpoint: str | None = None) -> None:
        uri = str(uri)
        self.fs, self.path = filesystem_for(uri, endpoint=endpoint)  # before the URI is trimmed: s3:// is no s3:
        self.remote = is_remote(uri)
        self.uri = uri.rstrip("/") if self.remote else str(Path(uri.removeprefix("file://")).expanduser().resolve())
        self.endpoint = endpoint

    def __reduce__(self):  # pickles as (uri, endpoint): each process opens its own filesystem
        return RunDir._open, (self.uri, self.endpoint)

    @staticmethod
    def _open(uri: str, endpoint: str | None) -> RunDir:
        return RunDir(uri, endpoint=endpoint)

    def __truediv__(self, name: str) -> RunDir:
        return RunDir(f"{self.uri}/{name}", endpoint=self.endpoint)

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"RunDir({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def parent(self) -> RunDir:
        if not self.remote:  # (`/runs`' is `/`, not the current folder)
            return RunDir(str(Path(self.uri).parent), endpoint=self.endpoint)
        return RunDir(self.uri.rsplit("/", 1)[0], endpoint=self.endpoint)

    @property
    def local(self) -> Path | None:
        """The folder as a local path, or None on an object store."""
        return None if self.remote else Path(self.path)

    def _full(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path

    # Reading.
    def exists(self, name: str = "") -> bool:
        return self.fs.get_file_info(self._full(name)).type != pafs.FileType.NotFound

    def is_file(self, name: str) -> bool:
        return self.fs.get_file_info(self._full(name)).type == pafs.FileType.File

    def is_empty(self) -> bool:
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.NotFound:
            return True
        return not self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self._full(name)) as f:
            return f.read()

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def _names(self, kind: pafs.FileType, pattern_prefix: str) -> list[str]:
        if not self.exists():
            return []
        gcs_folders = kind == pafs.FileType.Directory and self.uri.startswith(("gs://", "gcs://"))
        # pyarrow lists a GCS folder only where an object marks it, and an upload (a checkpoint's state.pt) leaves
        # none: there the folders are those the objects below are in.
        entries = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True, recursive=gcs_folders))
        if gcs_folders:
            names = [PurePosixPath(e.path).relative_to(self.path).parts[0] for e in entries
                     if len(PurePosixPath(e.path).relative_to(self.path).parts) > 1 or e.type == kind]
        else:
            names = [PurePosixPath(e.path).name for e in entries if e.type == kind]
        return [name for name in dict.fromkeys(names) if name.startswith(pattern_prefix)]

    def subdirs(self, pattern_prefix: str = "") -> list[RunDir]:
        """Immediate sub-folders whose names start with `pattern_prefix`."""
        return [self / name for name in self._names(pafs.FileType.Directory, pattern_prefix)]

    def files(self, pattern_prefix: str = "") -> list[str]:
        """Names of the immediate files whose names start with `pattern_prefix`."""
        return self._names(pafs.FileType.File, pattern_prefix)

    # Writing.
    def check_writable(self) -> None:
        """Raise OSError (with the reason) if files cannot be written here; leaves nothing behind. Locally the
        check is a temporary folder in the nearest existing ancestor; on an object store, a probe object."""
        if self.remote:
            probe = f"{self.path}/.raydiff-write-check-{uuid.uuid4().hex}"
            with self.fs.open_output_stream(probe) as f:
                f.write(b"")
            self.fs.delete_file(probe)
            return
        existing = Path(self.path)
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        try:
            with tempfile.TemporaryDirectory(dir=existing, prefix=".raydiff-write-check-"):
                pass
        except OSError as exc:  # name the folder, not the probe
            raise type(exc)(exc.errno, exc.strerror, str(existing)) from None

    def write_bytes(self, name: str, data: bytes) -> None:
        target = self._full(name)
        if not self.remote:
            with new_file(target) as tmp:  # makes the folder too
                tmp.write_bytes(data)
            return
        self.fs.create_dir(str(PurePosixPath(target).parent), recursive=True)
        with self.fs.open_output_stream(target) as f:
            f.write(data)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def append_text(self, name: str, text: str) -> None:
        """Append whole lines to a local file, all or none (`atomic.append_lines`); on an object store (which cannot
        append) rewrite it."""
        if self.remote:
            self.write_bytes(name, (self.read_bytes(name) if self.is_file(name) else b"") + text.encode())
            return
        append_lines(self._full(name), text)

    def remove(self, name: str) -> None:
        """Delete one file (there must be one)."""
        self.fs.delete_file(self._full(name))

    def remove_all(self) -> None:
        """Delete the folder and everything in it."""
        self.fs.delete_dir_contents(self.path, missing_dir_ok=True)
        if self.exists():  # a folder's own object, where one marks it (GCS uploads leave none)
            self.fs.delete_dir(self.path)

    def move_to(self, target: RunDir) -> None:
        """Move the whole folder (a rename locally; copy and delete on an object store)."""
        if not self.remote:
            os.replace(self.path, target.path)
            return
        pafs.copy_files(self.path, target.path, source_filesystem=self.fs, destination_filesystem=target.fs)
        self.fs.delete_dir(self.path)

    def open_binary(self, name: str) -> io.BytesIO:
        return io.BytesIO(self.read_bytes(name))
