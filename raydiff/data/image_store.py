"""Ray Data ingest: decode a source once, in parallel, into uint8 chunks in the Ray object store.

Every kind of source (see `raydiff.data.sources`) goes through one pipeline: read (image files, Parquet rows,
WebDataset samples) -> decode, convert, resize and center-crop (`raydiff.data.decode`) in Ray Data tasks spread
over the cluster's CPUs -> uint8 (N, C, R, R) chunks, in a fixed order so that sample index i means the same
image in every run. Prepared sources skip the decode. A folder of images too small to be worth Ray Data's
start-up (a few MB on the driver's disk: the built-in digits) is decoded by the driver, with the same batch
function. A sample that cannot be decoded keeps its index (as a blank row) and is listed in `ImageStore.bad`;
training excludes it. With `data.labels: auto` each sample's label travels beside its image
(`raydiff.data.labels`), and a sample without one is listed as bad the same way.

Decoding finishes before the trainer reserves its CPUs, so Ray Data and Ray Train never compete for them: no
deadlock on a 2-core laptop, full parallelism on a cluster. Workers then read the chunks zero-copy from
shared memory (`raydiff.data.loader`); the per-epoch work (flip, scale to [-1, 1]) happens on the training device.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from raydiff.cluster.tasks import results_of
from raydiff.data.decode import BadImage, decode_resize_crop, dense_array, fit_array
from raydiff.data.errors import BadSample, DataError, check_bad_fraction, reading
from raydiff.data.hub_features import image_columns
from raydiff.data.labels import (
    UNLISTED_CLASS,
    LabelledSamples,
    LabelPlan,
    class_ids,
    missing_labels,
    plan_labels,
    resolve_classes,
)
from raydiff.data.shard_format import MANIFEST, check_prepared, read_manifest
from raydiff.data.sources import Source, check_on_every_node, source_of

CHUNK_BYTES = 64 * 1024 * 1024  # object-store chunk size: few chunks, cheap gathers
# A local folder of images up to this size (and one chunk decoded) decodes in the driver in less time than Ray Data
# takes to start its tasks' processes (docs/data.md#decode-once); bigger or remote sources use the cluster's CPUs.
DRIVER_DECODE_BYTES = 8 * 1024 * 1024
DECODE_BATCH = 256
WEBDATASET_IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp")
DEFAULT_IMAGE_COLUMN = "image"  # data.image_column's default: in a file whose Image feature is elsewhere, read that
_SEP = "\x1f"  # between where a bad sample came from and why it is bad, in the error column


@dataclass(frozen=True)
class ImageStore(LabelledSamples):
    """A dataset decoded to uint8 (N, C, R, R), held as object-store chunks; picklable, so it travels to workers.
    A bad sample keeps its index as a blank row.

    :param labels: `data.labels: auto`: int32 class id of every sample index (-1 where none: a bad sample);
        None without labels.
    :param classes: the class names, id = position (empty without labels).
    """

    chunks: tuple[ray.ObjectRef, ...]
    counts: tuple[int, ...]
    shape: tuple[int, int, int]
    source: str
    bad: tuple[BadSample, ...] = ()
    labels: np.ndarray | None = field(default=None, compare=False)
    classes: tuple[str, ...] = ()
    decoded_by: str = field(default="Ray Data", compare=False)  # or "the driver" (`decodes_in_driver`)

    def arrays(self) -> list[np.ndarray]:
        """The chunks as read-only numpy arrays; zero-copy when the chunk is on this node."""
        return ray.get(list(self.chunks))

    def bad_report(self, limit: int = 20) -> dict[str, Any]:
        return {"count": len(self.bad), "fraction": round(len(self.bad) / max(self.num_images, 1), 6),
                "examples": [b.to_dict() for b in self.bad[:limit]]}

    def layout(self) -> dict[str, Any]:
        """How the samples are laid out, for data.json: a continuing run keeps it (see `raydiff.data.stream`)."""
        return {"cache": "memory"}


# Decoding, one Ray Data batch at a time.
def _each(values, wheres, fit, resolution: int, channels: int) -> dict[str, np.ndarray]:
    """`fit(value)` -> uint8 (C, R, R) for every value: a blank row and a reason where it raises BadImage."""
    images = np.zeros((len(values), channels, resolution, resolution), np.uint8)
    errors = np.full(len(values), "", dtype=object)
    for i, value in enumerate(values):
        try:
            images[i] = fit(value)
        except BadImage as exc:
            errors[i] = f"{wheres[i]}{_SEP}{exc}"
    return {"image": images, "error": errors}


def _decode_encoded(values, wheres, resolution: int, channels: int) -> dict[str, np.ndarray]:
    """Encoded images (bytes, or HF-style {bytes, path} dicts) -> images, plus a reason per bad one."""

    def decode(value) -> np.ndarray:
        if isinstance(value, dict):  # Hugging Face datasets store images as {bytes, path}
            value = value.get("bytes")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise BadImage("no image bytes")
        return decode_resize_crop(bytes(value), resolution, channels)

    return _each(values, wheres, decode, resolution, channels)


def _with_labels(out: dict[str, np.ndarray], found: list[tuple[str, str]], wheres) -> dict[str, np.ndarray]:
    """Add each row's label text ("" for none) to a decoded batch; a row without a label is bad (its reason)."""
    out["label"] = np.array([text for text, _ in found], dtype=object)
    errors = out["error"]
    for i, (text, why) in enumerate(found):
        if not text and not errors[i]:
            errors[i] = f"{wheres[i]}{_SEP}{why}"
    return out


def _decode_files(batch: dict[str, np.ndarray], resolution: int, channels: int,
                  labels: LabelPlan | None = None) -> dict[str, np.ndarray]:
    out = _decode_encoded(batch["bytes"], batch["path"], resolution, channels)
    if labels is None:
        return out
    return _with_labels(out, [labels.of_path(str(p)) for p in batch["path"]], batch["path"])


def _decode_parquet(batch: dict[str, np.ndarray], column: str, resolution: int, channels: int,
                    prepared: bool = False, labels: LabelPlan | None = None) -> dict[str, np.ndarray]:
    out = _decode_parquet_images(batch, column, resolution, channels, prepared)
    if labels is None:
        return out
    return _with_labels(out, [labels.of_value(v) for v in batch[labels.column]], batch["path"])


def _decode_parquet_images(batch: dict[str, np.ndarray], column: str, resolution: int, channels: int,
                           prepared: bool) -> dict[str, np.ndarray]:
    values, wheres = batch[column], batch["path"]
    shape = (channels, resolution, resolution)
    if prepared and values.dtype != np.uint8:  # version 2: each row's pixels as one fixed-size binary value
        values = np.frombuffer(b"".join(values.tolist()), np.uint8).reshape(-1, *shape)
    if values.dtype == np.uint8 and values.shape[1:] == shape:
        return {"image": values, "error": np.full(len(values), "", dtype=object)}  # prepared: nothing to do
    first = next((v for v in values if v is not None), None)
    if values.dtype != object or isinstance(first, np.ndarray):  # decoded tensors of another shape
        return _each(values, wheres, lambda v: fit_array(dense_array(v), resolution, channels), resolution, channels)
    return _decode_encoded(values, wheres, resolution, channels)


def _decode_webdataset(batch: dict[str, np.ndarray], resolution: int, channels: int,
                       labels: LabelPlan | None = None) -> dict[str, np.ndarray]:
    n = len(batch["__key__"])
    # The sample's image, whichever extension it has, in either case (`.JPG`).
    members = sorted((key for key in batch if key.lower() in WEBDATASET_IMAGE_KEYS),
                     key=lambda key: WEBDATASET_IMAGE_KEYS.index(key.lower()))
    values = np.empty(n, dtype=object)
    values[:] = _first_member([batch[key] for key in members], n, (bytes, bytearray, memoryview))
    wheres = [f"{p}:{k}" for p, k in zip(batch.get("path", [""] * n), batch["__key__"], strict=True)]
    out = _decode_encoded(values, wheres, resolution, channels)
    if labels is None:
        return out
    # Its .cls in either case; a block without any .cls has no such column.
    cls = _first_member([batch[key] for key in batch if key.lower() == "cls"], n, (bytes, bytearray, memoryview, str))
    return _with_labels(out, [labels.of_value(v) for v in cls], wheres)


def _first_member(columns: list[np.ndarray], n: int, kinds: tuple[type, ...]) -> list[Any]:
    """Each of the `n` samples' value in the first of `columns` (one member's column per extension spelling) that
    holds one of `kinds` for it; None where none does. Ray builds the blocks with pandas: a sample without a
    member has NaN in that member's column, not None."""
    return [next((c[i] for c in columns if isinstance(c[i], kinds)), None) for i in range(n)]


def _member_wanted(wanted: frozenset[str], suffix: str) -> bool:
    """Whether a WebDataset member of this extension is read: Ray's suffix list matches case exactly."""
    return suffix.lower() in wanted


# A decode function as map_batches calls it, fn(batch, **fn_kwargs): Ray's annotation knows only fn(batch).
_BatchFn = Callable[..., dict[str, np.ndarray]]


def _read(source: Source, resolution: int, channels: int, image_column: str,
          labels: LabelPlan | None = None) -> ray.data.Dataset:
    """The source as a Ray Data dataset of {image: uint8 (C, R, R), error: str}, plus {label: str} with
    `labels`, in sample order. Its tasks run on any node: a local source must be on every node."""
    check_on_every_node(source)
    files, fs = list(source.files), source.filesystem
    kwargs: dict[str, Any] = {"fn_kwargs": {"resolution": resolution, "channels": channels},
                              "batch_size": DECODE_BATCH, "batch_format": "numpy"}
    if labels is not None:
        kwargs["fn_kwargs"]["labels"] = labels
    if source.kind == "images":
        return (ray.data.read_binary_files(files, filesystem=fs, include_paths=True)
                .map_batches(cast(_BatchFn, _decode_files), **kwargs))
    if source.kind == "webdataset":
        wanted = frozenset([*WEBDATASET_IMAGE_KEYS, *(["cls"] if labels is not None else []), "__key__"])
        return (ray.data.read_webdataset(files, filesystem=fs, decoder=None, include_paths=True,
                                         suffixes=functools.partial(_member_wanted, wanted))
                .map_batches(cast(_BatchFn, _decode_webdataset), **kwargs))
    column = "image" if source.kind == "prepared" else image_column
    with reading(source.uri, files[0]):
        schema = pq.read_schema(files[0], filesystem=fs)
    if source.kind == "parquet" and "image" in schema.names and pa.types.is_fixed_size_binary(
            schema.field("image").type):  # raydiff's prepared shards, read without their manifest
        folder = files[0].rsplit("/", 1)[0]
        with reading(source.uri, folder):
            named = read_manifest(fs, folder) is not None
        if named:  # a shard, or a glob of them, named instead of their folder
            raise DataError(f"data.source = {source.uri!r} names shards of data raydiff.prepare wrote; give their "
                            f"folder, {folder}, whose {MANIFEST} says how to read them")
        raise DataError(f"data.source = {source.uri!r} holds shards of raydiff.prepare without their manifest: a "
                        f"preparation stopped before its end; remove them and prepare again")
    images = image_columns(schema)
    if column not in schema.names and column == DEFAULT_IMAGE_COLUMN and len(images) == 1:
        print(f"[raydiff] data.image_column: {column!r} is not a column of {source.uri}; reading {images[0]!r}, "
              f"its files' Image feature")
        column = images[0]
    if column not in schema.names:
        hint = f"; its images are in {' and '.join(images)}: --set data.image_column={images[0]}" if images else ""
        raise DataError(f"data.image_column = {column!r}: not a column of {files[0]}; its columns: "
                        f"{', '.join(schema.names)}{hint}")
    kwargs["fn_kwargs"].update(column=column, prepared=source.kind == "prepared")
    columns = [column] if labels is None or labels.column == column else [column, labels.column]
    read = ray.data.read_parquet(files, filesystem=fs, columns=columns, include_paths=True)
    if labels is not None and labels.column != column:  # any file's may be pandas' Categorical
        read = read.map_batches(functools.partial(_dictionary_decoded, column=labels.column), batch_format="pyarrow")
    return read.map_batches(cast(_BatchFn, _decode_parquet), **kwargs)


def _dictionary_decoded(table: pa.Table, column: str) -> pa.Table:
    """`table` with `column` as plain values where it is dictionary-encoded (pandas' Categorical): Ray's numpy
    batches gave its nulls the name of some class (nulls stay null here)."""
    index = table.schema.get_field_index(column)
    values = table.column(index)
    if not pa.types.is_dictionary(values.type):
        return table
    return table.set_column(index, column, values.cast(values.type.value_type))


# Ray Data logs a failed read task's traceback in these two, then raises its error in the driver.
_RAY_DATA_LOGS = ("ray.data._internal.execution.streaming_executor_state", "ray.data.exceptions")
_CUT_SHORT = (tarfile.TarError, pa.ArrowException)  # a shard or Parquet file cut short, or not what it is named
# ... or a file the workers may not read: pyarrow's and fsspec's read errors are OSErrors (gone, permissions, a
# node without the bucket's credentials or HF_TOKEN)
_UNREADABLE = (*_CUT_SHORT, OSError)


# Ray Data's WebDataset reader refuses a shard whose samples' members are not adjacent, or repeat (a ValueError).
_OUT_OF_ORDER = ("are not contiguous in the archive", "duplicate file name in tar file")
RESORT = "re-create the shard with its members sorted by name (tar --sort=name, or find | sort | tar -T -)"


def webdataset_order_problem(names: list[str]) -> str | None:
    """Why a WebDataset shard whose members are `names` (in archive order) cannot be read, or None: the members of
    a sample (one key: the name up to the first '.' of its file name) must be adjacent, and each key's
    extensions unique."""
    done: set[str] = set()
    current: str | None = None
    extensions: set[str] = set()
    for name in names:
        match = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
        if not match:
            continue
        key, extension = match.groups()
        if key != current:
            if key in done:
                return f"the members of sample {key!r} are not adjacent"
            if current is not None:
                done.add(current)
            current, extensions = key, set()
        if extension in extensions:
            return f"{name} is in it twice"
        extensions.add(extension)
    return None


def _not_unreadable(record: logging.LogRecord) -> bool:
    """A log filter: False for a record of an error `unreadable_files_told_once` tells in one line (its own, or the
    one being handled where it is logged: Ray Data logs some lines in its except clause without it)."""
    error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
    return not isinstance(error, _UNREADABLE) and not _out_of_order(error)


def _out_of_order(error: BaseException | None) -> bool:
    return isinstance(error, ValueError) and any(said in str(error) for said in _OUT_OF_ORDER)


@contextmanager
def unreadable_files_told_once(source: Source) -> Iterator[None]:
    """Ray Data's reads of `source`: a file that cannot be read past a point (a WebDataset shard or Parquet file cut
    short) or at all (gone since it was listed, or not readable by a node's workers) is one line, not Ray Data's
    traceback and then the error's own. A Ray task's error is an instance of its cause's class too; which file is
    known here only where the cause names it (pyarrow's read errors do; Ray Data's readers do not say)."""
    logs = [logging.getLogger(name) for name in _RAY_DATA_LOGS]
    for log in logs:
        log.addFilter(_not_unreadable)
    try:
        yield
    except _UNREADABLE as exc:
        cause = getattr(exc, "cause", exc)  # a RayTaskError's original error
        first = (str(cause).splitlines() or [""])[0][:200]
        reason = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
        usual = ("a file cut short, as by an interrupted download" if isinstance(cause, _CUT_SHORT) else
                 "a file removed since it was listed, or one that Ray Data's workers may not read (permissions; on "
                 "a cluster, every node needs the bucket's credentials or HF_TOKEN)")
        raise DataError(f"data.source = {source.uri!r}: a file of it cannot be read ({reason}); {usual}, is the "
                        f"usual cause") from None
    except ValueError as exc:  # (after: pyarrow's ArrowInvalid is a ValueError too)
        if not _out_of_order(exc):
            raise
        cause = getattr(exc, "cause", exc)
        where = re.search(r"tar is (\S+?)(?:\)|$)", str(cause))
        raise DataError(f"data.source = {source.uri!r}: a WebDataset shard{f' ({where.group(1)})' if where else ''} "
                        f"holds a sample's files apart, or one twice, which WebDataset readers refuse: {RESORT}") \
            from None
    finally:
        for log in logs:
            log.removeFilter(_not_unreadable)


def _errors_in(errors: np.ndarray) -> tuple[int, list[tuple[int, str]]]:
    """(rows, [(row, error)]) of one chunk's error column: only the bad rows travel back."""
    return len(errors), [(i, str(e)) for i, e in enumerate(errors) if e]


def _labels_in(labels: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(the distinct label texts, each row's position among them) of one chunk's label column: compact."""
    names, inverse = np.unique(labels.astype(str), return_inverse=True)
    return names.tolist(), inverse.astype(np.int32)


_errors_of = ray.remote(num_cpus=0)(_errors_in)  # where the chunk is, for chunks Ray Data decoded
_labels_of = ray.remote(num_cpus=0)(_labels_in)


def _bad_of(errors: np.ndarray, start: int) -> list[BadSample]:
    bad = []
    for row in np.flatnonzero(errors != ""):
        where, _, reason = str(errors[row]).partition(_SEP)
        bad.append(BadSample(index=start + int(row), where=where, reason=reason))
    return bad


def decode_stream(source: Source, *, resolution: int, channels: int, image_column: str = DEFAULT_IMAGE_COLUMN,
                  labels: LabelPlan | None = None):
    """Decode `source` with Ray Data, streaming: yield (uint8 (n, C, R, R) usable images, [BadSample]) in sample
    order, never holding more than Ray Data's bounded window (for `raydiff.prepare` and data.cache=stream).
    `labels`: yield (usable images, [BadSample], their label texts, every label text seen) instead."""
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    start = 0
    batches = _read(source, resolution, channels, image_column, labels).iter_batches(
        batch_size=DECODE_BATCH * 4, batch_format="numpy", prefetch_batches=4)
    with unreadable_files_told_once(source):
        for batch in batches:
            errors = batch["error"]
            bad = _bad_of(errors, start)
            start += len(errors)
            usable = errors == ""
            if labels is None:
                yield batch["image"][usable], bad
            else:
                texts = batch["label"]
                yield batch["image"][usable], bad, texts[usable], {str(t) for t in texts if t}


def rows_per_chunk(resolution: int, channels: int) -> int:
    """How many decoded images make one object-store chunk (at least one)."""
    return max(1, CHUNK_BYTES // (channels * resolution * resolution))


def decodes_in_driver(source: Source, resolution: int, channels: int) -> bool:
    """Whether `load_images` decodes `source` in this process instead of in Ray Data tasks: a folder of images on
    this machine's disk, small enough that decoding it takes less than Ray Data's start-up, whose decoded images
    make one object-store chunk (few images, however small their files, at a high resolution would not)."""
    return (source.kind == "images" and isinstance(source.filesystem, pafs.LocalFileSystem)
            and sum(source.sizes) <= DRIVER_DECODE_BYTES
            and len(source.files) <= rows_per_chunk(resolution, channels))


def _decode_in_driver(source: Source, resolution: int, channels: int,
                      labels: LabelPlan | None) -> tuple[list[ray.ObjectRef], list, list | None]:
    """Decode a small local folder here with Ray Data's batch function: ([the chunk's ref], [its errors], [its
    labels] or None), as `load_images` gets them from Ray Data."""
    encoded = []
    for path in source.files:
        with reading(source.uri, path), source.filesystem.open_input_file(path) as file:
            encoded.append(file.read())
    batch = {"bytes": np.array(encoded, dtype=object), "path": np.array(source.files, dtype=object)}
    decoded = _decode_files(batch, resolution, channels, labels)
    return ([ray.put(decoded["image"])], [_errors_in(decoded["error"])],
            None if labels is None else [_labels_in(decoded["label"])])


def load_images(source: Source, *, resolution: int, channels: int, image_column: str = DEFAULT_IMAGE_COLUMN,
                labels: LabelPlan | None = None) -> ImageStore:
    """Decode every sample of `source` once with Ray Data (in this process where `decodes_in_driver`); return an
    `ImageStore` (bad samples listed). `labels`: also read each sample's label
    (`raydiff.data.labels.plan_labels`); a sample without one is bad."""
    check_prepared(source, resolution, channels)
    in_driver = decodes_in_driver(source, resolution, channels)
    if in_driver:
        chunks, counted, per_chunk = _decode_in_driver(source, resolution, channels, labels)
    else:
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # sample i must be the same image in every run
        with unreadable_files_told_once(source):
            ds = _read(source, resolution, channels, image_column, labels).repartition(
                target_num_rows_per_block=rows_per_chunk(resolution, channels)).materialize()
        chunks = ds.to_numpy_refs(column="image")
        counted = results_of([_errors_of.remote(e) for e in ds.to_numpy_refs(column="error")])
        per_chunk = None if labels is None else results_of([_labels_of.remote(t)
                                                            for t in ds.to_numpy_refs(column="label")])
    bad, start = [], 0
    for rows, errors in counted:
        for row, error in errors:
            where, _, reason = error.partition(_SEP)
            bad.append(BadSample(index=start + row, where=where, reason=reason))
        start += rows
    keep = [(c, n) for c, (n, _) in zip(chunks, counted, strict=True) if n]
    if not keep:
        raise DataError(f"data.source = {source.uri!r}: no samples found in {source.describe()}")
    store = ImageStore(chunks=tuple(c for c, _ in keep), counts=tuple(n for _, n in keep),
                       shape=(channels, resolution, resolution), source=source.uri, bad=tuple(bad),
                       decoded_by="the driver" if in_driver else "Ray Data")
    if labels is None or per_chunk is None:  # no labels asked for (per_chunk is None exactly then)
        return store
    classes = resolve_classes((n for names, _ in per_chunk for n in names), labels, source.uri)
    if not classes:
        raise missing_labels(source)
    ids = np.concatenate([class_ids(np.asarray(names, dtype=object), classes)[inverse] if len(inverse) else inverse
                          for names, inverse in per_chunk]).astype(np.int32)
    # A prepared copy's row whose class its manifest does not list (an edited manifest) is bad, as in stream mode:
    # it trained as class -1, which the loader refused mid-run.
    known = {b.index for b in bad}
    unlisted = [BadSample(index=int(i), where=f"{source.uri}:sample {int(i)}", reason=UNLISTED_CLASS)
                for i in np.flatnonzero(ids < 0) if int(i) not in known]
    if unlisted:
        store = replace(store, bad=tuple(sorted((*store.bad, *unlisted), key=lambda b: b.index)))
    return replace(store, labels=ids, classes=classes)


def load_data(data, source: Source | None = None) -> ImageStore:
    """Decode what a config's `data` section names (listing it unless `source` is given); stop when too much of
    it is unusable. With `data.labels: auto`, also each sample's class (a source with no labels is one line)."""
    source = source or source_of(data)
    labels = plan_labels(source, data.label_column) if data.labels == "auto" else None
    store = load_images(source, resolution=data.resolution, channels=data.channels, image_column=data.image_column,
                        labels=labels)
    check_bad_fraction(store, data.max_bad_fraction)
    return store
