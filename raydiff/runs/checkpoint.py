"""Checkpoint files: the full training state in one `state.pt`, loaded with `weights_only=True`.

A checkpoint is the folder `<run.storage>/<run.name>/checkpoint_<step>` (on a local or NFS folder, or an object
store) holding that one file. This module writes checkpoints so that none is ever visible before it is complete
(`CheckpointWriter`), reads them back from any storage, finds a run's checkpoints, and removes what an
interrupted write left behind, raydiff's or Ray Train's. On a local or mounted folder a checkpoint is on disk
before it takes its name (fsync): with `run.keep_checkpoints` 1 (sweeps) a power loss after the older one was
pruned must not leave an empty `state.pt` as the only one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from raydiff.model.unet import build_model, count_parameters
from raydiff.storage.atomic import is_new_file_tmp, new_file, scratch_folder, sync_folder, sync_tree
from raydiff.storage.errors import StorageFailure, elsewhere, permanent_reason
from raydiff.storage.rundir import RunDir

STATE_FILE = "state.pt"
PARTIAL = ".partial-"  # a checkpoint folder being written: `.checkpoint_<step>.partial-<id>`, never listed
_NAME = re.compile(r"checkpoint_(\d{8})(?:-(\d+))?$")
UPLOAD_CHUNK = 8 * 2**20
# Ray Train's list of the checkpoints a run reported, beside them in the run directory.
RAY_CHECKPOINT_LIST = "checkpoint_manager_snapshot.json"

Location = str | os.PathLike | RunDir


def as_rundir(location: Location) -> RunDir:
    return location if isinstance(location, RunDir) else RunDir(location)


def checkpoint_name(step: int, run_dir: Location | None = None) -> str:
    """`checkpoint_<step>`; a step reported again after a rollback or a fallback gets `-1`, `-2`, ... so that it
    never shares a folder with a checkpoint Ray Train already tracks (and may delete)."""
    name, n = f"checkpoint_{step:08d}", 0
    run = as_rundir(run_dir) if run_dir is not None else None
    while run is not None and run.exists(name):
        n += 1
        name = f"checkpoint_{step:08d}-{n}"
    return name


def checkpoint_step(location: Location) -> int:
    match = _NAME.search(as_rundir(location).name)
    assert match is not None, f"not a checkpoint folder: {location}"
    return int(match.group(1))


def checkpoint_order(location: Location) -> tuple[int, int]:
    """Sort key: step, then the repeat suffix (`checkpoint_00000010-1` comes after `checkpoint_00000010`)."""
    match = _NAME.search(as_rundir(location).name)
    assert match is not None, f"not a checkpoint folder: {location}"
    step, repeat = match.groups()
    return int(step), int(repeat or 0)


def write_state(directory: Path, state: dict[str, Any], *, durable: bool = True) -> Path:
    """Save `state` (tensors, numbers, strings, lists, dicts only) into a local folder so that a reader sees all
    of it or none, and with `durable` a power loss too (`atomic.new_file`). Written through a Python file, so that
    a full disk raises OSError(ENOSPC) rather than torch's errno-less "file write failed"; its zip writer, closed
    after such a write, raises a RuntimeError of its own ("unexpected pos") over it: the OSError is what raises."""
    path = Path(directory) / STATE_FILE
    with new_file(path, durable=durable) as tmp, open(tmp, "wb") as f:
        try:
            torch.save(state, f)
        except RuntimeError as exc:
            written = exc.__context__ or exc.__cause__
            if isinstance(written, OSError):
                raise written from None
            raise
    return path


def checkpoint_bytes(cfg) -> int:
    """About how many bytes one checkpoint of `cfg`'s model takes: the weights, the EMA and AdamW's two moments in
    fp32 (16 bytes per parameter), with `train.ema: posthoc` one more fp32 copy per width of
    `train.ema_sigma_rels` (4 bytes per parameter each), and a little for the rest (a class-conditional model's
    `auto` classes are not known yet: counted as none, a few rows of one embedding). The one estimate of it: the
    driver's room check and a full disk's message (`raydiff.training.chief_writes`) both use it."""
    t = cfg.train
    copies = 4 + (len(t.ema_sigma_rels) if t.ema == "posthoc" else 0)
    return 4 * copies * parameters_known_now(cfg) + 2**20


def parameters_known_now(cfg) -> int:
    """The parameters of `cfg`'s model, counted without building it (on the meta device); `auto` classes, which the
    data's labels resolve later, counted as none (a few rows of one embedding)."""
    counted = copy.deepcopy(cfg)
    if counted.model.num_classes == "auto":
        counted.model.num_classes = 0
    with torch.device("meta"):  # no memory, no initialisation work
        return count_parameters(build_model(counted))


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time, never visible on storage before they are complete.

    On a local folder of the same file system as the temporary folder the state is written under a hidden name
    beside its final one (`.checkpoint_<step>.partial-<id>`, which no reader lists) and renamed into place: no copy,
    and the write's error (a full disk) arrives at once. Elsewhere the state is saved to a local staging folder and
    moved to storage on a background thread, so that training does not wait for the network: to a mounted file
    system (NFS, a disk of its own) under the hidden name, then renamed; to an object store as one object, which a
    bucket lists only once it is whole. Then the error arrives with `outcome`.
    """

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raydiff-checkpoint")
        self._pending: tuple[str, Future] | None = None
        self._in_place = run_dir.local is not None and _same_file_system(run_dir.local, Path(tempfile.gettempdir()))

    @property
    def pending(self) -> str | None:
        """The name of the checkpoint being written (or written, and not yet collected by `outcome`)."""
        return self._pending[0] if self._pending else None

    def start(self, name: str, state: dict[str, Any]) -> None:
        """Write `state` as checkpoint `name`; the previous write must have been collected (`outcome`)."""
        assert self._pending is None, f"checkpoint {self._pending and self._pending[0]} is still being written"
        future: Future = Future()
        try:
            if self._in_place:  # written here (a full disk is known at once), on disk and named on the writer's thread
                partial = self._filled(name, lambda folder: write_state(folder, state, durable=False))
                future = self._pool.submit(self._publish, partial, name)
            else:
                future = self._pool.submit(self._move, self._stage(state), name)
        except OSError as exc:  # the write's (or the staging's): it arrives with `outcome`, as one moved later does
            future.set_exception(exc)
        self._pending = (name, future)

    @staticmethod
    def _stage(state: dict[str, Any]) -> Path:
        """`state` (this step's, before training changes it) in a scratch folder of the temporary folder. Its
        errors are the temporary folder's, not the run storage's: a full one is named as such (`elsewhere`)."""
        staging = None
        try:
            staging = scratch_folder("ckpt")
            write_state(staging, state, durable=False)  # a scratch copy: no fsync
            return staging
        except BaseException as exc:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                temp = tempfile.gettempdir()
                raise elsewhere(exc, temp, f"temporary folder {temp} (where checkpoints are staged on their way to "
                                           f"run.storage)", "TMPDIR") from exc
            raise

    def outcome(self, *, wait: bool) -> tuple[str, BaseException | None] | None:
        """(name, the error or None) of the pending write once it has finished, waiting for it with `wait`; None
        while it is still running, or when there is none. A finished write is collected: asked once."""
        if self._pending is None or (not wait and not self._pending[1].done()):
            return None
        name, future = self._pending
        self._pending = None
        return name, future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _filled(self, name: str, fill: Callable[[Path], Any]) -> Path:
        """A local or mounted folder: a hidden folder beside checkpoint `name`'s, filled by `fill`."""
        partial = Path(self.run_dir.path) / f".{name}{PARTIAL}{uuid.uuid4().hex[:8]}"
        try:
            partial.mkdir(parents=True)
            fill(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return partial

    def _publish(self, partial: Path, name: str) -> None:
        """Rename the `_filled` folder into place as checkpoint `name`: its files on disk before the rename (fsync,
        which can take seconds for a large state: off the training thread) and its name after."""
        final = partial.with_name(name)
        try:
            sync_tree(partial)
            os.rename(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        sync_folder(final.parent)

    def _move(self, staging: Path, name: str) -> None:
        """The staged state onto storage (on the writer's thread)."""
        try:
            if self.run_dir.remote:
                target = f"{self.run_dir.path}/{name}/{STATE_FILE}"
                try:
                    with open(staging / STATE_FILE, "rb") as source, \
                            self.run_dir.fs.open_output_stream(target) as sink:
                        shutil.copyfileobj(source, sink, UPLOAD_CHUNK)
                except BaseException:
                    # pyarrow completes an upload as its stream closes, an error or not: what that published is cut
                    # short (and would be read, and passed over, as the newest checkpoint). Nothing to remove where
                    # the upload itself failed.
                    with contextlib.suppress(Exception):
                        self.run_dir.fs.delete_file(target)
                    raise
            else:
                self._publish(self._filled(name, lambda f: shutil.copyfile(staging / STATE_FILE, f / STATE_FILE)), name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _same_file_system(folder: Path, other: Path) -> bool:
    """Whether `folder` (or its nearest existing ancestor) is on the file system of `other`."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return os.stat(folder).st_dev == os.stat(other).st_dev
    except OSError:
        return False


def remove_partial_writes(run_dir: Location) -> list[str]:
    """Remove what interrupted writes left in a local run folder: checkpoints (`.checkpoint_*.partial-*`) and the
    hidden files of any other write renamed into place (`atomic.new_file`: post-hoc EMA snapshots, sample grids,
    records), which a process killed outright cannot remove and which can be the size of the model; returns their
    paths in the run folder. Only the run's driver, holding its lease, calls it. (On an object store a checkpoint's
    upload that failed part way is removed as it fails, where the store answers: `CheckpointWriter._move`; a
    state cut short that stayed is read as bad and passed over for the one before.)"""
    run = as_rundir(run_dir)
    if run.local is None or not run.local.is_dir():
        return []
    removed = []
    for partial in sorted(run.local.glob(f".checkpoint_*{PARTIAL}*")):
        shutil.rmtree(partial, ignore_errors=True)
        removed.append(partial.name)
    for folder in (run.local, *(p for p in sorted(run.local.iterdir()) if p.is_dir() and not p.name.startswith("."))):
        for hidden in sorted(folder.glob(".*.tmp")):
            if is_new_file_tmp(hidden.name) and hidden.is_file():
                hidden.unlink(missing_ok=True)
                removed.append(str(hidden.relative_to(run.local)))
    return removed


def drop_unusable_ray_checkpoint_list(run_dir: Location) -> str | None:
    """Remove Ray Train's checkpoint list if Ray would refuse to start the run over it; returns why, or None.

    Ray rewrites the list in place, so a driver killed during the write leaves it cut short; a list written by
    another Ray version, or naming a checkpoint folder that is gone, is refused too: each time Ray Train stops
    before training. raydiff needs no list (it restores the newest checkpoint it finds on storage,
    `state.checkpoint_candidates`), so the list goes and Ray starts a new one. The checkpoints are kept; once
    Ray's new list names newer ones, a start removes them (`remove_checkpoints_ray_never_kept`).
    """
    run = as_rundir(run_dir)
    if not run.is_file(RAY_CHECKPOINT_LIST):
        return None
    text = run.read_text(RAY_CHECKPOINT_LIST)
    listed = _ray_list(text)
    if listed is None:
        why = f"cut short by an interrupted write ({len(text)} bytes)" if text else "empty: its write was interrupted"
    else:
        written_by, names = listed
        gone, running = [name for name in names if not run.exists(name)], version("ray")
        if written_by != running:
            why = f"written by Ray {written_by}, this is Ray {running}"
        elif gone:
            why = f"it lists {gone[0]}, which is gone"
        else:
            return None
    run.remove(RAY_CHECKPOINT_LIST)
    return (f"removed Ray Train's checkpoint list {RAY_CHECKPOINT_LIST} ({why}); the run continues from the newest "
            f"checkpoint on storage")


def remove_checkpoints_ray_never_kept(run_dir: Location, keep: int) -> list[str]:
    """Remove the checkpoint folders that Ray Train's checkpoint list does not name, that are older than every one
    it names and that are not among the newest `keep` (`run.keep_checkpoints`); returns their names, oldest first.

    Ray Train keeps the newest `run.keep_checkpoints` of the checkpoints it was told of and removes the rest. A
    checkpoint written but never told of escapes that: the workers were lost, or resized, between rank 0's write and
    its report (the next start restores it all the same), or it was named in a list that was dropped
    (`drop_unusable_ray_checkpoint_list`). Once Ray keeps only checkpoints newer than such a folder, and `keep`
    newer ones are on storage, it is one Ray would have removed: it goes at the next start. The newest (the one a
    start restores) always stays, and so do as many as `keep` asks for, to fall back on.
    """
    run = as_rundir(run_dir)
    listed = _ray_list(run.read_text(RAY_CHECKPOINT_LIST)) if run.is_file(RAY_CHECKPOINT_LIST) else None
    if listed is None:
        return []
    found = list_checkpoints(run)  # oldest first
    named = [c for c in found if c.name in listed[1]]
    if not named:
        return []
    removed = [c for c in found[:-keep] if c not in named and checkpoint_order(c) < checkpoint_order(named[0])]
    for checkpoint in removed:
        checkpoint.remove_all()
    return [c.name for c in removed]


def _ray_list(text: str) -> tuple[str, list[str]] | None:
    """Ray Train's checkpoint list as (the Ray version that wrote it, the checkpoint folders it names), or None
    where it cannot be read."""
    try:
        listed = json.loads(text)
        return listed["ray_version"], [r["checkpoint_dir_name"] for r in listed["checkpoint_results"]]
    except (ValueError, KeyError, TypeError):
        return None


def read_state(directory: Location) -> dict[str, Any]:
    """The state of a checkpoint folder, local or on an object store; only tensors and plain data are loaded."""
    run = as_rundir(directory)
    if run.local is not None:
        return torch.load(run.local / STATE_FILE, map_location="cpu", weights_only=True)
    return torch.load(run.open_binary(STATE_FILE), map_location="cpu", weights_only=True)


def list_checkpoints(run_dir: Location, *, where: str | None = None) -> list[RunDir]:
    """Checkpoint folders of a run that hold a state file, oldest first. With `where` (a command's flag and value
    that named the run it reads), a folder it cannot read is one line (`input_errors`)."""
    run = as_rundir(run_dir)
    with input_errors(where, run):
        folders = [c for c in run.subdirs("checkpoint_") if _NAME.match(c.name)]
    found = []
    for folder in folders:
        with input_errors(where, folder):
            if folder.is_file(STATE_FILE):
                found.append(folder)
    return sorted(found, key=checkpoint_order)


@contextmanager
def input_errors(where: str | None, path: Location | None = None) -> Iterator[None]:
    """A command reading what the user named (a run, a checkpoint, a snapshot): a storage error no retry can fix
    (a refused permission) met in the block is one StorageFailure line, `<where>: cannot read <path> (<reason>)`
    (`it` without `path`), where pathlib's or pyarrow's traceback would come; a missing file and the errors a
    retry may fix pass as they are. `where` None: as they are too (training's own reads and writes of its
    storage keep their tracebacks: docs/resume-and-elastic.md)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        reason = permanent_reason(exc)
        if where is None or reason is None:
            raise
        raise StorageFailure(f"{where}: cannot read {'it' if path is None else path} ({reason})") from None


def checkpoint_location(uri: str, endpoint: str | None, *, where: str | None = None,
                        runs_only: bool = False) -> RunDir:
    """The RunDir of a command's --checkpoint (or of what `where` names, e.g. "--guide URI"): a local path or an
    s3:// / gs:// URI of a run folder, or of a checkpoint folder unless `runs_only`. Looked at once: a user error
    in one line (FileNotFoundError, StorageFailure) for an unsupported URI scheme, a file, or storage that cannot
    be read (a wrong endpoint, no network, refused credentials, a local folder this user may not read or enter)
    where pyarrow's or pathlib's traceback would come at the first listing."""
    where = where or f"--checkpoint {uri}"
    try:
        location = RunDir(uri, endpoint=endpoint)
    except ValueError as exc:
        raise FileNotFoundError(f"{where}: {exc}") from None
    try:
        is_file = location.is_file("")
        if location.local is not None and location.local.is_dir():  # a folder this user may not read or enter
            os.listdir(location.local)
            (location.local / STATE_FILE).exists()
    except FileNotFoundError:
        raise
    except OSError as exc:
        reason = permanent_reason(exc) or str(exc).splitlines()[0][:200]
        things = ["the address", "the credentials", "the network"]
        endpoint = endpoint or (os.environ.get("AWS_ENDPOINT_URL") if uri.startswith("s3://") else None)
        if endpoint:
            things.append(f"the endpoint ({endpoint})")
        check = f"; check {', '.join(things[:-1])} and {things[-1]}" if location.remote else ""
        raise StorageFailure(f"{where}: cannot read it ({reason}){check}") from None
    if is_file:
        hint = ("give the run folder" if runs_only else
                f"give the checkpoint folder that holds it, {location.parent}" if location.name == STATE_FILE else
                "give a run folder or a checkpoint folder")
        raise FileNotFoundError(f"{where}: {location} is a file; {hint}")
    return location
