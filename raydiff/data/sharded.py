"""The description of a prepared dataset that is streamed (`data.cache=stream`): its shards, shuffle windows,
buffer, held-out images and labels.

It is what the driver decides and what travels to the workers, so it is picklable and holds no data but the
small held-out set. `raydiff.data.stream` builds it; `raydiff.data.node_cache` reads its shards on each node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydiff.cluster.tasks import results_of
from raydiff.data.errors import BadSample
from raydiff.data.labels import LabelledSamples
from raydiff.data.order import SampleOrder
from raydiff.data.shard_format import read_shard

GB = 1024 ** 3


@dataclass(frozen=True)
class ShardedImages(LabelledSamples):
    """A prepared dataset read shard by shard; picklable, so it travels to the workers.

    :param uri: where the prepared shards are.
    :param source: `data.source` as the user gave it.
    :param files, counts: the shards (paths in `filesystem`) and their rows.
    :param window_shards: shards shuffled together (`data.stream_window_shards`).
    :param buffer_bytes: the most a node holds at once.
    :param holdout: uint8 images of the held-out indices, once gathered (`with_holdout`).
    :param skipped: samples of the raw source that could not be decoded (not in the shards; reported only).
    :param labels: `data.labels: auto`: int32 class id of every sample index (-1: none, a bad sample); else None.
    :param classes: the class names, id = position (empty without labels).
    :param bad: samples in the shards that cannot be trained on (a prepared row without a label).
    """

    uri: str
    source: str
    filesystem: pafs.FileSystem
    files: tuple[str, ...]
    counts: tuple[int, ...]
    shape: tuple[int, int, int]
    window_shards: int
    buffer_bytes: int
    rows_per_shard: int = 0  # the rows of a full shard, as prepared (0: unknown, the largest shard's)
    holdout: ray.ObjectRef | None = None
    holdout_indices: tuple[int, ...] = ()
    skipped: tuple[dict, ...] = ()
    labels: np.ndarray | None = field(default=None, compare=False)
    classes: tuple[str, ...] = ()
    bad: tuple[BadSample, ...] = ()  # undecodable samples were left out of the shards: every index holds an image

    @property
    def shard_starts(self) -> np.ndarray:
        return np.cumsum([0, *self.counts])

    def bad_report(self, limit: int | None = 20) -> dict[str, Any]:
        total = self.num_images + len(self.skipped)
        examples = [*self.skipped, *(b.to_dict() for b in self.bad)]
        return {"count": len(examples), "fraction": round(len(examples) / max(total, 1), 6),
                "examples": examples[:limit]}

    def order(self, indices: np.ndarray, seed: int) -> SampleOrder:
        return SampleOrder(indices, seed, shard_starts=self.shard_starts, window_shards=self.window_shards)

    def layout(self) -> dict[str, Any]:
        """How the samples are laid out, for data.json: the shuffle windows and the shards fix the sample order,
        so a continuing run keeps them (`open_images(keep=...)`)."""
        return {"cache": "stream", "window_shards": self.window_shards,
                "rows_per_shard": self.rows_per_shard or max(self.counts),
                "shards": len(self.files)}

    def describe(self) -> str:
        shard_mb = max(self.counts) * int(np.prod(self.shape)) / 2 ** 20
        return (f"streamed from {self.uri}: {len(self.files)} shards of up to {shard_mb:.3g} MB, shuffled in "
                f"windows of {self.window_shards}, at most {self.buffer_bytes / GB:.3g} GB per node")

    def with_holdout(self, indices: np.ndarray) -> ShardedImages:
        """A copy that carries the held-out images (gathered in parallel, one Ray task per shard holding any)."""
        indices = np.asarray(indices)
        if tuple(indices.tolist()) == self.holdout_indices and self.holdout is not None:
            return self
        shard_of = np.searchsorted(self.shard_starts, indices, "right") - 1
        starts = self.shard_starts
        # Ray documents placement_group=None as "no group", but annotates the parameter without None.
        no_group = PlacementGroupSchedulingStrategy(placement_group=None)  # type: ignore[arg-type]
        options = {"num_cpus": 1, "scheduling_strategy": no_group}
        parts = results_of([_rows.options(**options).remote(self.filesystem, self.files[s], self.shape,
                                                            indices[shard_of == s] - starts[s])
                            for s in np.unique(shard_of)])
        images = np.concatenate(parts) if parts else np.empty((0, *self.shape), np.uint8)
        return replace(self, holdout=ray.put(images), holdout_indices=tuple(indices.tolist()))

    def iter_arrays(self, max_bytes: int = 256 * 2 ** 20):
        """All images in index order, a few shards (up to about `max_bytes`) at a time."""
        pending, held = [], 0
        for path in self.files:
            pending.append(read_shard(self.filesystem, path, self.shape))
            held += pending[-1].nbytes
            if held >= max_bytes:
                yield np.concatenate(pending)
                pending, held = [], 0
        if pending:
            yield np.concatenate(pending)


@ray.remote
def _rows(filesystem, path: str, shape, rows: np.ndarray) -> np.ndarray:
    return read_shard(filesystem, path, shape)[rows]
