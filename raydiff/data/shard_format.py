"""The prepared-shard format, in one place: what `python -m raydiff.prepare` and stream mode write, and what
sources, ingest and streaming read.

A prepared folder holds `part-NNNNN.parquet` shards, whose `image` column holds each image's uint8 (C, R, R) pixels
as one fixed-size binary value (version 2; version 1's fixed-shape tensor column is still read, but Parquet stores
a list element by element, which reads many times slower), and `manifest.json`: format, version, count,
resolution, channels, source and its identity, the shards with their row counts and rows per shard, and every
sample that could not be used and why. Version 3 adds labels, where the data was prepared with them: a `label`
column of class names and the manifest's `classes` (id = position; `raydiff.data.labels`); without labels it is
version 2's layout. The manifest is written last: a folder without it is not prepared data (a local folder appears
all at once, by a rename, on disk and readable by others as any new folder: `raydiff.storage.atomic`). A
`manifest.json` of anything else (not a JSON object saying `format: raydiff-prepared`) is another tool's: such a
folder is read as raw data.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydiff.data.errors import BadSample, DataError, check_bad_fraction
from raydiff.data.labels import LABEL_COLUMN, LabelPlan, missing_labels, resolve_classes
from raydiff.storage.atomic import hidden_folder, publish_folder
from raydiff.storage.errors import setting_with
from raydiff.storage.fs import filesystem_for
from raydiff.storage.rundir import RunInUse

MANIFEST = "manifest.json"
PREPARED_FORMAT = "raydiff-prepared"
PREPARED_VERSION = 3
SHARD_BYTES = 128 * 1024 * 1024  # uncompressed image bytes per Parquet shard


class SourceLike(Protocol):
    """What the writer and the checks read of a listed source (`raydiff.data.sources.Source`, which lists
    prepared folders with this module's `read_manifest`)."""

    @property
    def uri(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def manifest(self) -> dict[str, Any]: ...
    def describe(self) -> str: ...
    def identity(self) -> dict[str, Any]: ...


def _shards(decoded, rows_per_shard: int, bad: list, names: set):
    """Regroup decoded batches into shards of `rows_per_shard` rows, in order: (uint8 (n, C, R, R), label texts or
    None). A batch is (usable images, bad samples), or with labels (usable images, bad samples, their labels,
    every label seen in the batch) as `raydiff.data.image_store.decode_stream` yields them; the bad samples are
    collected into `bad`, the labels seen into `names`. Holds at most one shard and one batch."""
    pending: list[np.ndarray] = []
    pending_labels: list[np.ndarray] | None = None
    held = 0
    for images, bad_here, *labelled in decoded:
        bad.extend(bad_here)
        pending.append(images)
        if labelled:
            pending_labels = (pending_labels or []) + [np.asarray(labelled[0], dtype=object)]
            names.update(labelled[1])
        held += len(images)
        if held < rows_per_shard:
            continue
        # Joined once, then cut: a batch of many shards' rows (large images) was copied again for each shard.
        joined = np.concatenate(pending)
        joined_labels = None if pending_labels is None else np.concatenate(pending_labels)
        start = 0
        while held - start >= rows_per_shard:
            end = start + rows_per_shard
            yield joined[start:end], None if joined_labels is None else joined_labels[start:end]
            start = end
        # (the rest, less than a shard, copied: a view would keep the whole batch while the next one is read)
        pending, held = [joined[start:].copy()], held - start
        pending_labels = None if joined_labels is None else [joined_labels[start:].copy()]
    if held:
        yield np.concatenate(pending), None if pending_labels is None else np.concatenate(pending_labels)


def rows_per_shard_for(shape: tuple[int, int, int], shard_bytes: int = SHARD_BYTES) -> int:
    return max(1, shard_bytes // int(np.prod(shape)))


def refuse_occupied(out: str, *, endpoint: str | None = None, name: str = "OUT") -> tuple[pafs.FileSystem, str]:
    """`out`'s filesystem and path, where nothing is yet (or an empty folder); DataError where something is (a file,
    or a folder with anything in it). Every command that writes a new folder refuses an occupied one with this line;
    `name` is the argument that named `out` ("OUT", or an option such as "--out")."""
    shown = setting_with(name, out)
    try:
        filesystem, root = filesystem_for(out, endpoint=endpoint)
    except ValueError as exc:
        raise DataError(f"{shown}: {exc}") from None
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.File or (
            info.type == pafs.FileType.Directory and filesystem.get_file_info(pafs.FileSelector(root))):
        raise DataError(f"{shown} already exists and is not an empty folder: choose a new folder")
    return filesystem, root


def write_prepared(decoded, source: SourceLike, out: str, *, shape: tuple[int, int, int],
                   rows_per_shard: int | None = None, max_bad_fraction: float = 1.0,
                   endpoint: str | None = None, labels: LabelPlan | None = None,
                   max_bad_setting: str = "data.max_bad_fraction") -> dict:
    """Write the batches of `decoded` ((usable uint8 images, bad samples), as `decode_stream` yields them) to `out`
    as prepared shards plus manifest; return the manifest. Streams: memory holds one shard, not the dataset.
    Too many bad samples (> max_bad_fraction, set by `max_bad_setting`) stop it before the manifest, and a local
    `out` is not created.
    `labels`: how the source's labels were read (`decode_stream(labels=...)` yields them): the shards get a label
    column and the manifest the classes; a source none of whose samples has a label is refused."""
    filesystem, root = refuse_occupied(out, endpoint=endpoint)
    local = isinstance(filesystem, pafs.LocalFileSystem)
    target = root
    if local:  # build beside the target and rename it into place: complete or absent
        Path(root).parent.mkdir(parents=True, exist_ok=True)
        target = str(hidden_folder(Path(root), "-"))
    else:
        filesystem.create_dir(root, recursive=True)

    c, r, _ = shape
    rows_per_shard = rows_per_shard or rows_per_shard_for(shape)
    bad: list[BadSample]
    shards, counts, bad = [], [], []
    names: set[str] = set()
    try:
        for i, (images, shard_labels) in enumerate(_shards(decoded, rows_per_shard, bad, names)):
            name = f"part-{i:05d}.parquet"
            images = np.ascontiguousarray(images)
            column = pa.FixedSizeBinaryArray.from_buffers(pa.binary(c * r * r), len(images),
                                                          [None, pa.py_buffer(images)])
            table = {"image": column}
            if labels is not None:
                if shard_labels is None:
                    raise ValueError("write_prepared(labels=...) needs the labels of every batch")
                table[LABEL_COLUMN] = pa.array(shard_labels.tolist(), pa.string())
            # No dictionary for the images: they are unique, and a dictionary attempt makes every read much slower.
            # LZ4: about as small as zstd on decoded images, and read much faster (stream mode reads every epoch).
            # Measured: docs/benchmarks.md#data-ingest. Labels repeat: a dictionary suits them.
            pq.write_table(pa.table(table), f"{target}/{name}", filesystem=filesystem, compression="lz4",
                           use_dictionary=[LABEL_COLUMN] if labels is not None else False)
            shards.append(name)
            counts.append(len(images))
        count = sum(counts)
        if labels is not None and not names:
            raise missing_labels(source)
        if not count:
            raise DataError(f"data.source = {source.uri!r}: no usable samples in {source.describe()}")
        check_bad_fraction(BadCount(source.uri, count + len(bad), tuple(bad)), max_bad_fraction, max_bad_setting)
        manifest = {
            "format": PREPARED_FORMAT, "version": PREPARED_VERSION, "count": count, "resolution": r, "channels": c,
            "source": source.uri, "source_identity": source.identity(), "shards": shards, "shard_counts": counts,
            "rows_per_shard": rows_per_shard,
            "bad": [b.to_dict() for b in bad], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if labels is not None:
            manifest["classes"] = list(resolve_classes(names, labels, source.uri))
        with filesystem.open_output_stream(f"{target}/{MANIFEST}") as f:
            f.write((json.dumps(manifest, indent=1) + "\n").encode())
        if local:
            publish_folder(Path(target), Path(root))
    except BaseException as exc:  # a bad source, or a stop (SIGTERM, Ctrl-C): leave nothing half-written
        if local:
            shutil.rmtree(target, ignore_errors=True)
        elif not isinstance(exc, RunInUse):  # a run that took the preparation over writes there now: its copy
            with contextlib.suppress(Exception):
                filesystem.delete_dir(root)
        raise
    return manifest


@dataclass(frozen=True)
class BadCount:
    """What `check_bad_fraction` reads of a decoded source."""

    source: str
    num_images: int
    bad: tuple[BadSample, ...]


# What the readers of a prepared folder take from its manifest, and what it must be.
REQUIRED = {"shards": "a list of file names", "count": "a number", "resolution": "a number", "channels": "a number"}


def read_manifest(filesystem: pafs.FileSystem, folder: str) -> dict[str, Any] | None:
    """The manifest of a prepared folder, or None where `folder` holds no prepared data (no manifest, or another
    tool's `manifest.json`). A raydiff manifest that lacks what the readers need is a DataError, in one line."""
    path = f"{folder.rstrip('/')}/{MANIFEST}"
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as f:
        text = f.read()
    try:
        manifest = json.loads(text)
    except ValueError:  # not JSON (or not UTF-8): written by something else
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != PREPARED_FORMAT:
        return None
    wrong = [f"{key!r} is not {what}" for key, what in REQUIRED.items() if not _fits(key, manifest.get(key))]
    if not isinstance(manifest.get("version", 1), int):
        wrong.append("'version' is not a number")
    if wrong:
        raise DataError(f"{path}: a {PREPARED_FORMAT} manifest, but {', '.join(wrong)}: it was not written by "
                        f"raydiff.prepare, or was changed since; prepare the data again (python -m raydiff.prepare)")
    return manifest


def _fits(key: str, value: Any) -> bool:
    if key == "shards":
        return isinstance(value, list) and all(isinstance(name, str) for name in value)
    return isinstance(value, int) and not isinstance(value, bool)


def read_shard(filesystem: pafs.FileSystem, path: str, shape: tuple[int, int, int]) -> np.ndarray:
    """A prepared shard's images as uint8 (n, C, R, R): fixed-size binary rows (version 2) or a fixed-shape
    tensor column (version 1)."""
    column = pq.read_table(path, filesystem=filesystem, columns=["image"]).column("image").combine_chunks()
    if pa.types.is_fixed_size_binary(column.type):
        return np.frombuffer(column.buffers()[1], np.uint8, len(column) * int(np.prod(shape)),
                             column.offset * int(np.prod(shape))).reshape(-1, *shape)
    return column.to_numpy_ndarray().reshape(-1, *shape)


def check_prepared(source: SourceLike, resolution: int, channels: int) -> None:
    """A prepared source must have been made at the run's resolution and channels."""
    if source.kind == "prepared":
        made = (source.manifest["resolution"], source.manifest["channels"])
        if made != (resolution, channels):
            raise DataError(f"data.source = {source.uri!r} was prepared at {made[0]}px with {made[1]} channel(s), but "
                            f"data.resolution = {resolution} and data.channels = {channels}: set those, or prepare "
                            f"the raw source again")
