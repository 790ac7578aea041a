"""Streamed data (`data.cache=stream`): train on datasets bigger than a node's memory.

Memory mode (`raydiff.data.image_store`) keeps the whole decoded dataset in every node's object store. Stream mode
reads prepared Parquet shards (`raydiff.prepare`; a raw source is prepared once into the run storage) one
window at a time:

- the sample order is shard-aware (`SampleOrder(shard_starts=...)`): each epoch shuffles the shards, groups
  them into windows of `data.stream_window_shards` and shuffles the samples within a window, so a step needs
  the shards of one window (two at a window's edge), and a step's samples are still a pure function of
  (seed, step);
- one `NodeShards` actor per node reads each shard once per epoch into the node's object store and hands it
  to every worker of that node (zero-copy), reading two windows ahead of the one being trained; it holds at
  most `data.stream_buffer_gb` and drops the oldest shards first;
- the held-out validation images are gathered once by the driver (a few hundred images);
- labels (`data.labels: auto`) are small: the driver reads the shards' label column once, and every worker holds
  the class id of every sample index, as in memory mode. A raw source is prepared with its labels into a copy of
  its own (unlabelled samples left out and reported, like undecodable ones).

`data.cache=auto` chooses memory when the decoded dataset takes at most MEMORY_SHARE of the smallest object store
of the nodes the run trains on (`raydiff.cluster.nodes`), else stream.

This module decides on the driver: which mode, and the shards to stream (a raw source prepared once).
`raydiff.data.sharded` describes them; `raydiff.data.node_cache` serves them on each node.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydiff.cluster.nodes import smallest_object_store
from raydiff.data.errors import BadSample, DataError, check_bad_fraction, reading
from raydiff.data.image_store import RESORT, WEBDATASET_IMAGE_KEYS, decode_stream, webdataset_order_problem
from raydiff.data.labels import UNLISTED_CLASS, LabelPlan, plan_labels, read_labels
from raydiff.data.node_cache import WINDOWS_HELD
from raydiff.data.shard_format import (
    MANIFEST,
    SHARD_BYTES,
    BadCount,
    check_prepared,
    read_manifest,
    rows_per_shard_for,
    write_prepared,
)
from raydiff.data.sharded import GB, ShardedImages
from raydiff.data.sources import Source, check_on_every_node, open_source
from raydiff.storage.fs import filesystem_for
from raydiff.storage.lease import Lease, hold, this_process
from raydiff.storage.rundir import RunDir, RunInUse

MEMORY_SHARE = 0.5  # auto: memory mode when the decoded dataset takes at most this share of a node's object store
STORE_SHARE = 0.5  # the stream buffer takes at most this share of the smallest node's object store
STREAM_FOLDER = ".raydiff-stream"  # raw sources prepared for streaming, under run.storage
FOOTER_READS = 16  # Parquet footers read at once: on an object store each read is mostly a wait for the network
HEADER_READ_BYTES = 2**20  # a WebDataset shard's headers are read through a buffer of this size (a request each)


# The driver's side: which mode, and the shards to stream.
def estimated_count(source: Source) -> int:
    """Samples in `source` without decoding it: exact for folders and Parquet (footers), estimated for
    WebDataset (the first shard's images times the shards)."""
    if source.kind == "prepared":
        return int(source.manifest["count"])
    if source.kind == "images":
        return len(source.files)
    if source.kind == "parquet":
        return sum(_rows_of(source))
    # The headers through a buffer: read one by one, each would be a request to an object store (two per sample).
    with (reading(source.uri, source.files[0]),
          io.BufferedReader(source.filesystem.open_input_file(source.files[0]), HEADER_READ_BYTES) as f,
          tarfile.open(fileobj=f) as tar):
        members = [m.name for m in tar.getmembers() if m.isfile()]
    out_of_order = webdataset_order_problem(members)
    if out_of_order:  # found now, not by Ray Data's reader once the stream reaches it
        raise DataError(f"data.source = {source.uri!r}: in its shard {source.files[0]} {out_of_order}, which "
                        f"WebDataset readers refuse: {RESORT}")
    return sum(name.rsplit(".", 1)[-1].lower() in WEBDATASET_IMAGE_KEYS for name in members) * len(source.files)


def _rows_of(source: Source) -> list[int]:
    """The rows of each Parquet file of `source`, from their footers, read at once (a damaged or unreadable file:
    one line naming the first such in the files' order)."""
    def rows(path: str) -> int:
        with reading(source.uri, path):
            return pq.read_metadata(path, filesystem=source.filesystem).num_rows

    with ThreadPoolExecutor(min(FOOTER_READS, max(1, len(source.files)))) as pool:
        return list(pool.map(rows, source.files))


def _mb(nbytes: float) -> str:
    mb = nbytes / 2 ** 20
    return f"{mb:,.0f} MB" if mb >= 10 else f"{mb:.2g} MB"


def choose_cache(data, source: Source, use_gpu: bool | str = "auto") -> tuple[str, str]:
    """(memory | stream, why) for `data.cache`, from the nodes the run trains on (`use_gpu`: scaling.use_gpu);
    warns on stderr when memory mode is forced where it does not fit."""
    image_bytes = data.channels * data.resolution ** 2
    decoded = estimated_count(source) * image_bytes
    store = smallest_object_store(use_gpu)
    sizes = f"the decoded dataset ({_mb(decoded)}) and the smallest worker node's object store ({_mb(store)})"
    fits = decoded <= MEMORY_SHARE * store
    if data.cache == "memory" and not fits:
        print(f"[raydiff] warning: data.cache = memory, but {sizes}: every node would spill it to disk; "
              f"set data.cache=stream", file=sys.stderr)
    if data.cache != "auto":
        return data.cache, f"data.cache {data.cache}"
    mode = "memory" if fits else "stream"
    return mode, f"data.cache auto: {mode}, from {sizes}"


def stream_images(data, source: Source, *, storage: str, endpoint: str | None,
                  keep: dict[str, Any] | None = None, buffer_share: float = 1.0,
                  lease_stale_s: float = 60.0, use_gpu: bool | str = "auto") -> ShardedImages:
    """The shards to stream `source` from: itself when prepared, else a prepared copy under
    `<storage>/.raydiff-stream/` (written once, with Ray Data, and reused by later runs and sweep trials). `keep`:
    a continuing run's layout (data.json): its shards and shuffle windows, or a one-line refusal. With
    `data.labels: auto`, the labels too (a raw source's copy is prepared with them)."""
    shape = (data.channels, data.resolution, data.resolution)
    buffer = min(int(data.stream_buffer_gb * GB), int(STORE_SHARE * smallest_object_store(use_gpu)) or 2 ** 62)
    buffer = int(buffer * buffer_share)
    labelled = data.labels == "auto"
    copied = source.kind != "prepared"  # raydiff's own copy of a raw source
    if not copied:
        check_on_every_node(source)  # each node's cache reads its shards
    else:
        rows = keep["rows_per_shard"] if keep else None
        plan = plan_labels(source, data.label_column) if labelled else None
        source = _prepared_copy(data, source, shape, buffer, storage, endpoint, rows=rows,
                                lease_stale_s=lease_stale_s, labels=plan)
    check_prepared(source, data.resolution, data.channels)
    plan = plan_labels(source, data.label_column) if labelled else None
    manifest = source.manifest
    counts = manifest.get("shard_counts") or _rows_of(source)
    shard_bytes = max(counts) * int(np.prod(shape))
    fits = buffer // (WINDOWS_HELD * shard_bytes)
    window = min(data.stream_window_shards, len(counts), fits)
    if keep is not None and window != keep["window_shards"]:
        if fits < keep["window_shards"]:
            need_gb = WINDOWS_HELD * keep["window_shards"] * shard_bytes / GB
            raise DataError(f"data.stream_buffer_gb = {data.stream_buffer_gb:g}: this run shuffles in windows of "
                            f"{keep['window_shards']} shards (data.json), which need {need_gb:.3g} GB per node; the "
                            f"buffer holds {fits} (at most {STORE_SHARE:.0%} of the smallest node's object store): "
                            f"raise it, or use run.name=NEW for a new run")
        window = keep["window_shards"]
    if window < 1:
        raise DataError(f"data.stream_buffer_gb = {data.stream_buffer_gb:g}: a node must hold {WINDOWS_HELD} shards "
                        f"of {shard_bytes / 2 ** 20:.3g} MB of {source.uri} (the buffer is {buffer / 2 ** 20:.3g} MB, "
                        f"at most {STORE_SHARE:.0%} of the smallest node's object store): raise it, or prepare "
                        f"smaller shards")
    if keep is None and window < min(data.stream_window_shards, len(counts)):
        print(f"[raydiff] data.stream_window_shards = {data.stream_window_shards}: shuffling windows of {window} "
              f"shards instead, the most of which {WINDOWS_HELD} fit the {_mb(buffer)} buffer")
    images = ShardedImages(uri=source.uri, source=data.source, filesystem=source.filesystem, files=source.files,
                           counts=tuple(int(c) for c in counts), rows_per_shard=int(manifest.get("rows_per_shard", 0)),
                           shape=shape, window_shards=window,
                           buffer_bytes=buffer, skipped=tuple(manifest.get("bad", ())))
    if plan is not None:
        images = _with_labels(images, plan)
    check_unusable(images, data.max_bad_fraction, left_out=copied)
    return images


def check_unusable(images: ShardedImages, max_bad_fraction: float, *, left_out: bool = True) -> None:
    """`check_bad_fraction` of the rows without a label and, with `left_out` (raydiff's own copy of a raw source,
    which another run may have prepared under a looser limit and is reused as it is), the samples the copy left
    out, out of all the source's samples. A source the user prepared was held to a limit as it was prepared, and
    is read as memory mode reads it."""
    left = tuple(BadSample(index=int(d.get("index", -1)), where=str(d.get("where", "?")),
                           reason=str(d.get("reason", "?"))) for d in images.skipped) if left_out else ()
    check_bad_fraction(BadCount(images.source, images.num_images + len(left), (*left, *images.bad)),
                       max_bad_fraction)


def _with_labels(images: ShardedImages, plan: LabelPlan) -> ShardedImages:
    """The shards' labels (their label column, read once); a row without one is a bad sample."""
    labels = read_labels(images.filesystem, images.files, plan.classes, images.uri)
    if len(labels) != images.num_images:
        raise DataError(f"data.source = {images.uri!r}: {len(labels)} labels for {images.num_images} images: "
                        f"the prepared data is damaged; prepare it again")
    starts, bad = images.shard_starts, []
    for i in np.flatnonzero(labels < 0):
        shard = int(np.searchsorted(starts, i, "right")) - 1
        bad.append(BadSample(index=int(i), where=f"{images.files[shard]}:row {int(i - starts[shard])}",
                             reason=UNLISTED_CLASS))
    return replace(images, labels=labels, classes=plan.classes, bad=tuple(bad))


def _prepared_copy(data, source: Source, shape, buffer: int, storage: str, endpoint: str | None, *,
                   rows: int | None = None, lease_stale_s: float = 60.0, labels: LabelPlan | None = None) -> Source:
    """The prepared copy of a raw source under `<storage>/.raydiff-stream/<key>`, written once. One run prepares a
    key at a time (it holds the key's lease; others wait, then use its copy), and it cleans what an earlier
    preparation, killed half-way, left behind. `labels`: a copy with them, under a key of its own."""

    if rows is None:  # shards small enough that WINDOWS_HELD windows fit the buffer (a continuing run keeps its)
        budget = min(SHARD_BYTES, buffer // (WINDOWS_HELD * data.stream_window_shards))
        # Rounded down to a power of two bytes: Ray sizes its object store from the memory free as it starts, so
        # the buffer moves by megabytes from one start to the next, and each start would key a copy of its own.
        budget = 1 << (budget.bit_length() - 1) if budget > 0 else 0
        rows = rows_per_shard_for(shape, budget)
    what: list[Any] = [source.identity(), list(shape), data.image_column, rows]
    if labels is not None:  # an unlabelled copy keeps the key it always had
        what.append({"labels": "auto", "label_column": data.label_column})
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()
    out = f"{storage.rstrip('/')}/{STREAM_FOLDER}/{key[:24]}"
    found = _prepared_at(out, endpoint)
    if found is not None:
        return found
    check_on_every_node(source)  # before anything is written (Ray Data's reads would find it again)
    with hold(RunDir(out, endpoint=endpoint), this_process(), stale_s=lease_stale_s, what="the stream preparation",
              wait=True) as lease:
        found = _prepared_at(out, endpoint)  # another run may have prepared it while this one waited
        if found is not None:
            return found
        print(f"[raydiff] data.cache stream: preparing {source.describe()} once into {out} ({rows} images per "
              f"shard)")
        _clear_partial(out, endpoint)
        decoded = while_held(lease, out, decode_stream(source, resolution=data.resolution, channels=data.channels,
                                                       image_column=data.image_column, labels=labels))
        write_prepared(decoded, source, out, shape=shape, rows_per_shard=rows,
                       max_bad_fraction=data.max_bad_fraction, endpoint=endpoint, labels=labels)
    return open_source(out, endpoint=endpoint)


def while_held(lease: Lease, out: str, batches: Iterator[Any]) -> Iterator[Any]:
    """`batches`, as long as this run holds the lease of the preparation `out`, and once more after the last (the
    manifest comes next): a run that took the lease over prepares the copy anew, and shards of both would mix."""
    for batch in batches:
        _check_held(lease, out)
        yield batch
    _check_held(lease, out)


def _check_held(lease: Lease, out: str) -> None:
    if lease.lost and lease.unrenewed_s is not None:
        raise RunInUse(f"the stream preparation {out} could not renew its lease for {lease.unrenewed_s:.0f} s (the "
                       f"store did not answer): stopped, as another raydiff run may take it over; run the command "
                       f"again once the store answers")
    if lease.lost:
        raise RunInUse(f"another raydiff run took over the stream preparation {out} (this one's lease was not renewed "
                       f"within run.lease_stale_s): stopped; run the command again to use the copy it prepares")


def _prepared_at(out: str, endpoint: str | None) -> Source | None:
    """The stream copy at `out`, or None where there is none yet, or only a preparation cut short (no manifest).
    A copy with its manifest that cannot be used (a shard gone, a newer format) is one line that says to remove
    it: prepared over, it was refused as "already exists", and on an object store a listing that failed for a
    moment deleted a copy other runs may be streaming from."""
    filesystem, root = filesystem_for(out, endpoint=endpoint)
    with reading(out, f"{root.rstrip('/')}/{MANIFEST}"):
        manifest = read_manifest(filesystem, root)
    if manifest is None:
        return None
    try:
        return open_source(out, endpoint=endpoint)
    except DataError as exc:
        raise DataError(f"{exc} (this is the stream copy raydiff prepares of data.source: remove {out}, and the next "
                        f"run prepares it again)") from None


def _clear_partial(out: str, endpoint: str | None) -> None:
    """What a preparation cut short left (a killed process cleans nothing): on an object store the copy without
    its manifest, locally the hidden folders it was building beside `out` (`raydiff.data.shard_format.write_prepared`).
    Only the holder of the key's lease calls this, so nothing it removes is in use."""
    filesystem, root = filesystem_for(out, endpoint=endpoint)
    if isinstance(filesystem, pafs.LocalFileSystem):
        for partial in Path(root).parent.glob(f".{Path(root).name}-*"):
            shutil.rmtree(partial, ignore_errors=True)
    elif filesystem.get_file_info(root).type == pafs.FileType.Directory:
        filesystem.delete_dir(root)
