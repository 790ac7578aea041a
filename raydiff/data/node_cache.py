"""The worker side of streamed data: one cache actor per node holds a few windows of shards in the node's object
store for all the node's workers, and each worker maps the shards it needs from there, zero-copy.

A shard is read from storage once per node and epoch whatever the number of workers, and a node never holds
more than its share of the buffer (`ShardedImages.buffer_bytes`): the oldest shards are dropped first. The
worker asks for the next windows as a window begins, so the reads overlap training.
"""

from __future__ import annotations

import gc
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydiff.data.order import SampleOrder
from raydiff.data.shard_format import read_shard
from raydiff.data.sharded import ShardedImages

READ_AHEAD_WINDOWS = 2  # windows the node reads ahead of the one being trained
WINDOWS_HELD = READ_AHEAD_WINDOWS + 2  # those, the one being trained and the one before (a step may straddle two)


# ray.remote's keyword overload lists task options only, not actor options such as max_concurrency.
@ray.remote(num_cpus=0, max_concurrency=16)  # type: ignore[call-overload]
class NodeShards:
    """The shards one node holds in its object store for all its workers, least recently used dropped first."""

    def __init__(self, images: ShardedImages, readers: int = 2) -> None:
        self._images = images
        self._lock = threading.Lock()
        self._held: OrderedDict[int, tuple[ray.ObjectRef, int]] = OrderedDict()
        self._loading: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="raydiff-shards")
        self._reads: Counter = Counter()
        self._peak_bytes = self._dropped_bytes = 0
        gc.freeze()  # what exists now (modules, mostly) lives on: the collections after evictions skip it

    def _request(self, shard: int) -> Future:
        with self._lock:
            if shard in self._held:
                self._held.move_to_end(shard)
                done: Future = Future()
                done.set_result(self._held[shard][0])
                return done
            if shard not in self._loading:
                self._loading[shard] = self._pool.submit(self._load, shard)
            return self._loading[shard]

    def _load(self, shard: int) -> ray.ObjectRef:
        images = self._images
        try:
            array = read_shard(images.filesystem, images.files[shard], images.shape)
        except BaseException:
            with self._lock:  # the asking worker gets the error; a later request tries again
                del self._loading[shard]
            raise
        ref = ray.put(array)
        with self._lock:
            self._held[shard] = (ref, array.nbytes)
            self._reads[shard] += 1
            del self._loading[shard]
            held = sum(n for _, n in self._held.values())
            while held > images.buffer_bytes and len(self._held) > 1:
                _, (_, nbytes) = self._held.popitem(last=False)
                held, self._dropped_bytes = held - nbytes, self._dropped_bytes + nbytes
            self._peak_bytes = max(self._peak_bytes, held)
            collect = self._dropped_bytes >= images.buffer_bytes // WINDOWS_HELD
            if collect:
                self._dropped_bytes = 0
        if collect:  # handing references over leaves closure cycles behind that keep dropped shards alive: once a
            gc.collect()  # window's worth is dropped, collect them (gc.freeze keeps that cheap)
        return ref

    def get(self, shards: list[int]) -> list[list[ray.ObjectRef]]:
        """Object refs of `shards` (read now if not held). Each is wrapped in a list, so that Ray hands over the
        reference rather than the array."""
        futures = [self._request(s) for s in shards]
        return [[f.result()] for f in futures]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"reads": dict(self._reads), "held_bytes": sum(n for _, n in self._held.values()),
                    "peak_bytes": self._peak_bytes}


def node_shards(images: ShardedImages, group: str) -> ray.actor.ActorHandle:
    """This node's `NodeShards` for worker group `group` (created by the first worker of the node to ask). It
    lives as long as the worker that created it: a restarted worker group gets new ones."""
    node_id = ray.get_runtime_context().get_node_id()
    actor_class: Any = NodeShards  # an ActorClass at run time; mypy, which refused the decorator, sees the class
    return actor_class.options(
        name=f"raydiff-shards-{group}-{node_id}", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(images)


class StreamTable:
    """Random access by sample index over streamed shards, for one worker (see `raydiff.data.loader.ImageTable`).

    `prepare(position)`, called before each step, asks the node for the next READ_AHEAD_WINDOWS windows when a
    new window begins.
    """

    def __init__(self, images: ShardedImages, order: SampleOrder, shards: ray.actor.ActorHandle) -> None:
        self._order, self._shards = order, shards
        self._starts = images.shard_starts
        self.shape = images.shape
        self.labels = images.labels  # class id by sample index (small: every worker holds them all), or None
        self._arrays: OrderedDict[int, np.ndarray] = OrderedDict()
        self._keep = 2 * images.window_shards  # the window being trained and the one before; the node holds the rest
        self._window: tuple[int, int] | None = None
        self._upcoming: dict[int, tuple] = {}  # shard -> (the node's answer on its way, the shards it answers)
        # One reader at a time: a rollback that gave up waiting on its loader thread (a slow read) starts another,
        # and the old one, its read done, would evict shards the new one is reading.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def prepare(self, position: int) -> None:
        with self._lock:
            self._prepare(position)

    def _prepare(self, position: int) -> None:
        window, current = self._order.window_shards_at(position)
        if window != self._window:  # a new window: ask for the next ones now (the node reads them while we train)
            if self._window is None:  # a start: this window's shards first, not behind the read-ahead's
                wanted = [s for s in current if s not in self._arrays]
                if wanted:
                    self._upcoming.update(dict.fromkeys(wanted, (self._shards.get.remote(wanted), wanted)))
            self._window = window
            upcoming, ahead = [], window
            for _ in range(READ_AHEAD_WINDOWS):
                ahead, shards = self._order.window_shards_at(self._order.next_window(ahead))
                upcoming += shards
            # Answers only for shards this window or the read-ahead needs: each pins its whole answer's shards in
            # the object store, and one for a shard this worker's share never reads is never popped by a gather.
            relevant = {*current, *upcoming}
            self._upcoming = {s: answer for s, answer in self._upcoming.items() if s in relevant}
            upcoming = [s for s in dict.fromkeys(upcoming) if s not in self._arrays and s not in self._upcoming]
            if upcoming:
                answer = (self._shards.get.remote(upcoming), upcoming)
                self._upcoming.update(dict.fromkeys(upcoming, answer))

    def _fetch(self, shards: list[int]) -> None:
        """Map `shards` (zero-copy from the node's object store); one call to the node for those not asked for
        ahead, and one more for those whose read-ahead failed."""
        ahead = [self._upcoming.pop(s) for s in shards if s in self._upcoming]
        now = [s for s in shards if all(s not in names for _, names in ahead)]
        asked_now = self._shards.get.remote(now) if now else None
        refs: dict[int, ray.ObjectRef] = {}
        for answer, names in {id(answer): (answer, names) for answer, names in ahead}.values():
            try:
                wrapped = ray.get(answer)
            except Exception:  # a read ahead failed (a transient error, maybe a window ago): the node reads again
                self._upcoming = {s: a for s, a in self._upcoming.items() if a[0] is not answer}  # its others too
                names = [s for s in names if s in shards]
                wrapped = ray.get(self._shards.get.remote(names))  # failing again: raised, the step's error
            refs.update(zip(names, (w[0] for w in wrapped), strict=True))
        if asked_now is not None:
            refs.update(zip(now, (w[0] for w in ray.get(asked_now)), strict=True))
        for s, array in zip(shards, ray.get([refs[s] for s in shards]), strict=True):
            self._arrays[s] = array

    def gather(self, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._gather(indices, out)

    def _gather(self, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        needed = np.unique(shard_of).tolist()
        missing = [s for s in needed if s not in self._arrays]
        if missing:
            self._fetch(missing)
        for s in needed:
            self._arrays.move_to_end(s)
            selected = shard_of == s
            out[selected] = self._arrays[s][indices[selected] - self._starts[s]]
        while len(self._arrays) > max(self._keep, len(needed)):
            self._arrays.popitem(last=False)
        return out
