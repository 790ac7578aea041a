"""The images a run trains on, whichever `data.cache` mode holds them: the driver opens them once (`open_images`:
decoded into memory, `raydiff.data.image_store`, or streamed from prepared shards, `raydiff.data.stream`), and each
worker opens its view of them (`open_tables`).

Why a module of its own: the two modes are two implementations of one thing, `RunImages`; everything above the
data package meets them here and nowhere else.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import ray

from raydiff.data.image_store import ImageStore, load_data
from raydiff.data.loader import ImageTable
from raydiff.data.node_cache import StreamTable, node_shards
from raydiff.data.order import SampleOrder
from raydiff.data.placement import on_training_nodes
from raydiff.data.sharded import ShardedImages
from raydiff.data.sources import Source
from raydiff.data.stream import choose_cache, stream_images

RunImages = ImageStore | ShardedImages  # a run's decoded images: in every node's memory, or streamed from shards


def open_images(data, source: Source, *, storage: str, endpoint: str | None, keep: dict[str, Any] | None = None,
                buffer_share: float = 1.0, lease_stale_s: float = 60.0, use_gpu: bool | str = "auto",
                for_training: bool = False):
    """The run's images as `data.cache` says: an `ImageStore` (memory) or `ShardedImages` (stream), and a phrase
    for the start line saying which and why. `keep`: the layout a continuing run began with (data.json), which
    fixes its sample order: the mode, and for streamed data the shards and the shuffle windows. `buffer_share`:
    this run's part of a node's stream buffer (a sweep's trials that run at once share it). `use_gpu`
    (scaling.use_gpu) names the nodes the run trains on, whose object stores decide (`raydiff.cluster.nodes`).
    `for_training`: a run's workers will read them on those nodes, where memory mode keeps its decoded chunks
    (`raydiff.data.placement`)."""
    if keep is None:
        mode, why = choose_cache(data, source, use_gpu)
    else:
        mode, why = keep["cache"], f"data.cache {data.cache}: {keep['cache']}, as this run began (data.json)"
        if mode == "memory":
            forced = copy.copy(data)
            forced.cache = "memory"
            choose_cache(forced, source, use_gpu)  # warns if it no longer fits
    if mode == "stream":
        images = stream_images(data, source, storage=storage, endpoint=endpoint, keep=keep,
                               buffer_share=buffer_share, lease_stale_s=lease_stale_s, use_gpu=use_gpu)
        return images, f"{why}; {images.describe()}"
    store, moved = load_data(data, source), 0
    if for_training:
        store, moved = on_training_nodes(store, use_gpu)
    kept = f", {moved} chunk(s) moved to the training nodes" if moved else ""
    return store, f"{why}; decoded by {store.decoded_by}{kept}"


def open_tables(images: RunImages, train_indices: np.ndarray, val_indices: np.ndarray, seed: int, group: str):
    """A worker's view of the run's images: (table, order) of the training stream, and (table, indices) of the
    held-out images, for memory (`ImageStore`) or streamed (`ShardedImages`) data. `group`: the same string on
    every worker of one worker group (names the node caches)."""
    if isinstance(images, ShardedImages):
        order = images.order(train_indices, seed)
        table: ImageTable | StreamTable = StreamTable(images, order, node_shards(images, group))
        held_out = None
        if len(val_indices):
            assert images.holdout is not None  # the driver gathered them (`with_holdout`)
            held_labels = None if images.labels is None else images.labels[np.asarray(images.holdout_indices)]
            held_out = ImageTable([ray.get(images.holdout)], labels=held_labels)
        return table, order, held_out, np.arange(len(val_indices))
    table = ImageTable(images.arrays(), labels=images.labels)
    return table, SampleOrder(train_indices, seed), table, val_indices
