"""Streamed data: the shard-aware order, the node cache that reads each shard once (and again after a failed
read-ahead), and the mode choice."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray

from raydiff.data.loader import BatchStream, ImageTable
from raydiff.data.node_cache import READ_AHEAD_WINDOWS, node_shards
from raydiff.data.order import SampleOrder, rank_share
from raydiff.data.run_images import open_tables
from raydiff.data.shard_format import write_prepared
from raydiff.data.sources import DataError, open_source
from raydiff.data.stream import choose_cache, stream_images, while_held
from raydiff.storage.rundir import RunInUse

SHAPE = (3, 4, 4)


def _data(**overrides) -> SimpleNamespace:
    values = {"source": "x", "cache": "stream", "resolution": SHAPE[1], "channels": SHAPE[0],
              "stream_buffer_gb": 0.001, "stream_window_shards": 2, "image_column": "image",
              "max_bad_fraction": 0.1, "labels": "none", "label_column": "label"}
    return SimpleNamespace(**{**values, **overrides})


def _prepared(tmp_path: Path, num: int = 1000, rows: int = 60) -> tuple[str, np.ndarray]:
    images = np.random.default_rng(0).integers(0, 256, (num, *SHAPE), dtype=np.uint8)
    source = open_source(_folder_with_one_png(tmp_path))
    batches = [(images[i:i + 128], []) for i in range(0, num, 128)]
    write_prepared(iter(batches), source, str(tmp_path / "prepared"), shape=SHAPE, rows_per_shard=rows)
    return str(tmp_path / "prepared"), images


def _folder_with_one_png(tmp_path: Path) -> str:
    from raydiff.data.builtin import write_synthetic

    write_synthetic(tmp_path / "raw", num=1, resolution=8)
    return str(tmp_path / "raw")


def test_shard_aware_order_is_a_per_epoch_permutation_in_windows():
    starts = np.cumsum([0] + [10] * 9 + [7])  # 10 shards, the last one short
    train = np.setdiff1d(np.arange(97), [3, 50, 96])  # held-out samples never appear
    order = SampleOrder(train, seed=1, shard_starts=starts, window_shards=3)
    n = len(train)
    for epoch in range(2):
        indices, _ = order.take(epoch * n, n)
        assert sorted(indices.tolist()) == train.tolist()
        # The stream goes window by window; each window's samples come from its own <= 3 shards.
        position, seen = epoch * n, set()
        while position < (epoch + 1) * n:
            key, shards = order.window_shards_at(position)
            end = order.next_window(key)
            window_indices, _ = order.take(position, end - position)
            assert len(shards) <= 3 and set(np.searchsorted(starts, window_indices, "right") - 1) == set(shards)
            assert seen.isdisjoint(shards)
            seen |= set(shards)
            position = end
        assert seen == set(range(10))
    # A pure function of (seed, position), and epochs differ.
    again = SampleOrder(train, seed=1, shard_starts=starts, window_shards=3)
    assert np.array_equal(again.take(130, 40)[0], order.take(130, 40)[0])
    assert not np.array_equal(order.take(0, n)[0], order.take(n, n)[0])


class _NodeWithFailedReads:
    """A node cache (`NodeShards`) without Ray: an answer is a callable (`ray.get` calls it), each shard's rows hold
    its number, and the first `failures` reads of `flaky` fail, as a transient storage error would."""

    def __init__(self, flaky: int, failures: int = 1) -> None:
        self.flaky, self.failures = flaky, failures
        self.asked: list[list[int]] = []
        self.get = SimpleNamespace(remote=self._answer)

    def _answer(self, shards: list[int]):
        fails = self.flaky in shards and sum(self.flaky in asked for asked in self.asked) < self.failures
        self.asked.append(list(shards))

        def answer() -> list:
            if fails:
                raise OSError(f"transient error reading shard {self.flaky}")
            return [[lambda s=s: np.full((10, *SHAPE), s, np.uint8)] for s in shards]

        return answer


def _answered(answer):
    """`ray.get` of a fake node's answers: callables, or lists of them."""
    return [_answered(a) for a in answer] if isinstance(answer, list) else answer()


def test_a_failed_read_ahead_is_read_again_when_its_shards_are_needed(monkeypatch):
    from raydiff.data import node_cache

    monkeypatch.setattr(node_cache, "ray", SimpleNamespace(get=_answered))
    starts = np.arange(0, 81, 10)  # 8 shards of 10 samples
    order = SampleOrder(80, seed=0, shard_starts=starts, window_shards=2)
    first, first_shards = order.window_shards_at(0)
    second_start = order.next_window(first)
    second, second_shards = order.window_shards_at(second_start)
    node = _NodeWithFailedReads(flaky=second_shards[-1])
    images = SimpleNamespace(shard_starts=starts, shape=SHAPE, labels=None, window_shards=2)
    table = node_cache.StreamTable(images, order, node)
    table.prepare(0)  # reads the next windows ahead: the read of `flaky` fails, and with it this whole answer
    # A start asks for its own window first, on its own: its first step waits for that window, not for three.
    [start, read_ahead] = node.asked
    assert start == list(first_shards) and set(second_shards) < set(read_ahead)
    indices, _ = order.take(second_start, order.next_window(second) - second_start)
    out = table.gather(indices, np.empty((len(indices), *SHAPE), np.uint8))
    assert np.array_equal(out[:, 0, 0, 0], indices // 10)
    assert sorted(node.asked[2]) == sorted(second_shards)  # asked again, once, for what the step needs
    third = sorted(s for s in read_ahead if s not in second_shards)  # the rest of the failed answer: asked afresh
    indices = np.array([starts[s] for s in third])
    assert third and np.array_equal(table.gather(indices, np.empty((len(indices), *SHAPE), np.uint8))[:, 0, 0, 0],
                                    third)
    assert node.asked[3:] == [third]

    node = _NodeWithFailedReads(flaky=second_shards[-1], failures=2)  # failing again: the step's error
    table = node_cache.StreamTable(images, order, node)
    table.prepare(0)
    with pytest.raises(OSError, match="transient error reading shard"):
        table.gather(np.array([starts[second_shards[-1]]]), np.empty((1, *SHAPE), np.uint8))
    assert len(node.asked) == 3


def test_read_ahead_answers_for_shards_a_worker_never_touches_are_let_go_of(monkeypatch):
    """A small last shard that one worker's share of its window never reads kept its read-ahead answer, and with
    it every shard that answer holds, alive for epochs beyond the buffer (docs/data.md: the buffer plus one
    shard)."""
    import weakref

    from raydiff.data import node_cache
    from raydiff.data.order import rank_share

    monkeypatch.setattr(node_cache, "ray", SimpleNamespace(get=_answered))
    counts = (64,) * 15 + (1,)
    starts = np.concatenate([[0], np.cumsum(counts)])
    answers = []  # (the step it was asked at, the node's answer, weakly): one alive holds its shards in the store

    def answer_for(shards: list[int]):
        def answer():
            return [[lambda s=s: np.full((counts[s], *SHAPE), s, np.uint8)] for s in shards]

        answers.append((step, weakref.ref(answer)))
        return answer

    order = SampleOrder(int(starts[-1]), seed=0, shard_starts=starts, window_shards=2)
    images = SimpleNamespace(shard_starts=starts, shape=SHAPE, labels=None, window_shards=2)
    table = node_cache.StreamTable(images, order, SimpleNamespace(get=SimpleNamespace(remote=answer_for)))
    share, global_batch = rank_share(64, 8, 3), 64
    oldest_steps = []
    for step in range(int(starts[-1]) // global_batch * 6):  # six epochs of a window of 2 steps
        table.prepare(step * global_batch)
        indices, _ = order.take(step * global_batch + share.offset, share.size)
        table.gather(indices, np.empty((share.size, *SHAPE), np.uint8))
        oldest_steps.append(max((step - asked for asked, ref in answers if ref() is not None), default=0))
    # The window trained and those read ahead: no answer is older than that (one was kept for epochs).
    assert len(answers) > 20 and max(oldest_steps) <= 2 * (node_cache.READ_AHEAD_WINDOWS + 1), max(oldest_steps)


def test_a_loader_left_behind_by_a_rollback_never_takes_the_shards_the_next_one_reads(monkeypatch):
    """A rollback gives up on its loader thread after 5 s (one held up by a slow read) and starts another over the
    same table: the old one, its read done, evicted shards the new one was reading (a KeyError: the step failed,
    and Ray Train restarted the workers)."""
    import threading

    from raydiff.data import node_cache

    monkeypatch.setattr(node_cache, "ray", SimpleNamespace(get=_answered))
    starts = np.arange(0, 81, 10)  # 8 shards of 10 samples; the table keeps 2 (a window of 1 and the one before)
    order = SampleOrder(80, seed=0, shard_starts=starts, window_shards=1)
    new_reads, old_done = threading.Event(), threading.Event()

    def answer_for(shards: list[int]):
        def answer():
            if 2 in shards:  # the old loader's read: slow, until the new loader reads too
                new_reads.wait(timeout=2)
            elif 3 in shards:
                new_reads.set()
                old_done.wait(timeout=2)
            return [[lambda s=s: np.full((10, *SHAPE), s, np.uint8)] for s in shards]
        return answer

    images = SimpleNamespace(shard_starts=starts, shape=SHAPE, labels=None, window_shards=1)
    table = node_cache.StreamTable(images, order, SimpleNamespace(get=SimpleNamespace(remote=answer_for)))

    def gather(*shards: int) -> list[int]:
        indices = np.array([starts[s] for s in shards])
        return table.gather(indices, np.empty((len(shards), *SHAPE), np.uint8))[:, 0, 0, 0].tolist()

    assert gather(0, 1) == [0, 1]
    old = threading.Thread(target=lambda: (gather(2, 4), old_done.set()))
    old.start()
    assert gather(1, 3) == [1, 3]
    old.join()


def _own_store_bytes() -> int:
    """Bytes this node's object store must keep now: its primary copies, pinned for as long as anyone references
    them, the workers' borrowed references included (the raylet's own count; objects nobody references are a
    cache it evicts at will)."""
    from ray._private.internal_api import node_stats

    node = next(n for n in ray.nodes() if n["NodeID"] == ray.get_runtime_context().get_node_id())
    stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
    return stats.store_stats.object_store_bytes_primary_copy


@ray.remote(num_cpus=0, resources={"stream-test-node": 1})
def _two_workers_for_an_epoch(sharded, images: np.ndarray, group: str) -> dict:
    """Two workers of one node (one worker group), each gathering its share of every step for a whole epoch, on a
    node of their own: its object store holds only what they and their node cache hold."""
    train = np.arange(len(images))
    store_before, store_peak, mismatches = _own_store_bytes(), 0, 0
    streams = []
    for rank in range(2):
        table, order, _, _ = open_tables(sharded, train, np.empty(0, np.int64), seed=3, group=group)
        streams.append(BatchStream(table=table, order=order, global_batch=20, share=rank_share(20, 2, rank),
                                   micro_batch=10, start_step=0, pin_memory=False, prefetch_steps=2))
    memory = ImageTable([images])
    expected_order = sharded.order(train, 3)
    for _ in range(len(images) // 20):
        store_peak = max(store_peak, _own_store_bytes() - store_before)
        for stream in streams:
            for batch in next(stream):
                want, _ = expected_order.take(batch.position, len(batch))
                same = np.array_equal(batch.indices, want) and np.array_equal(
                    batch.images.numpy(), memory.gather(want, np.empty((len(want), *SHAPE), np.uint8)))
                mismatches += not same
    for stream in streams:
        stream.close()
    return {"mismatches": mismatches, "store_peak": store_peak,
            "cache": ray.get(node_shards(sharded, group).stats.remote())}


def test_a_reused_copy_is_held_to_this_runs_max_bad_fraction_with_its_left_out_samples():
    """A prepared copy keeps the samples it left out (undecodable) in its manifest, and another run may have
    prepared it under a looser data.max_bad_fraction: this run's limit counts them, with rows without a label."""
    from raydiff.data.errors import BadSample
    from raydiff.data.sharded import ShardedImages
    from raydiff.data.stream import check_unusable

    skipped = tuple({"index": i, "where": f"img{i}.png", "reason": "cannot decode"} for i in range(2))
    images = ShardedImages(uri="prepared", source="raw", filesystem=None, files=("a",), counts=(18,), shape=SHAPE,
                           window_shards=1, buffer_bytes=1, skipped=skipped)
    check_unusable(images, max_bad_fraction=0.1)  # 2 of 20
    with pytest.raises(DataError, match=r"^2 of 20 samples in raw cannot be used \(10.0% > data.max_bad_fraction "
                                        r"= 0.05\), e.g. img0.png: cannot decode; img1.png: cannot decode$"):
        check_unusable(images, max_bad_fraction=0.05)
    unlabelled = (BadSample(index=3, where="a:row 3", reason="no label"),)
    with pytest.raises(DataError, match=r"^3 of 20 samples"):
        check_unusable(dataclasses.replace(images, bad=unlabelled), max_bad_fraction=0.1)
    check_unusable(images, max_bad_fraction=0.05, left_out=False)  # a source the user prepared: as memory mode


def test_a_raw_source_keys_the_same_copy_whatever_megabytes_the_object_store_has_at_the_next_start(
        tmp_path, monkeypatch):
    """Ray sizes its object store from the memory free as it starts: where half of it is under
    data.stream_buffer_gb (a small node, where streaming is chosen), each start keyed a copy of its own and
    prepared the whole source again, leaving another copy on disk."""
    from raydiff.data import stream

    class Found(Exception):
        pass

    keys: list[str] = []

    def prepared_at(out, endpoint):  # where the copy would be: recorded, nothing prepared
        keys.append(out)
        raise Found
    monkeypatch.setattr(stream, "_prepared_at", prepared_at)
    source = open_source(_folder_with_one_png(tmp_path))
    data = _data(resolution=64, stream_buffer_gb=4.0, stream_window_shards=8)
    for store_bytes in (4_500_000_000, 4_501_000_000, 4_520_000_000):
        monkeypatch.setattr(stream, "smallest_object_store", lambda use_gpu="auto", store=store_bytes: store)
        with pytest.raises(Found):
            stream_images(data, source, storage=str(tmp_path / "runs"), endpoint=None)
    assert len(set(keys)) == 1, keys


def test_a_preparation_whose_lease_another_run_took_over_stops_before_its_next_shard():
    """Both would write the same copy: the run that lost the lease stops at its next batch, and after its last one
    (before the manifest), in one line, leaving the copy to the run that holds the lease now."""
    lease = SimpleNamespace(lost=False, unrenewed_s=None)

    def batches():
        yield "first"
        lease.lost = True
        yield "second"

    written = []
    with pytest.raises(RunInUse, match=r"^another raydiff run took over the stream preparation OUT \(this one's"):
        for batch in while_held(lease, "OUT", batches()):
            written.append(batch)
    assert written == ["first"]
    late = SimpleNamespace(lost=False, unrenewed_s=None)

    def one_batch():
        yield "only"
        late.lost = True

    with pytest.raises(RunInUse):
        list(while_held(late, "OUT", one_batch()))
    # Given up unrenewed (the store did not answer): said as it is, not as a takeover.
    unanswered = SimpleNamespace(lost=True, unrenewed_s=31.2)
    with pytest.raises(RunInUse, match=r"^the stream preparation OUT could not renew its lease for 31 s \(the store "
                                       r"did not answer\): stopped"):
        list(while_held(unanswered, "OUT", batches()))


@pytest.mark.ray
def test_workers_of_a_node_share_one_read_of_each_shard_per_epoch(cluster, ray_session, tmp_path):
    uri, images = _prepared(tmp_path)
    # A buffer of exactly 4 windows of 2 shards (2,880 bytes each): less than half the dataset, so the node drops
    # shards as the epoch goes on, and must still read each one only once.
    buffer_gb = 4 * 2 * 60 * 48 / 2 ** 30
    sharded = stream_images(_data(stream_buffer_gb=buffer_gb), open_source(uri), storage=str(tmp_path), endpoint=None)
    assert sharded.counts == (60,) * 16 + (40,) and sharded.window_shards == 2
    assert sharded.buffer_bytes < images.nbytes / 2
    node = cluster.add_node(num_cpus=0, resources={"stream-test-node": 1})
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    try:
        result = ray_session.get(_two_workers_for_an_epoch.remote(sharded, images, f"t-{tmp_path.name}"))
    finally:
        cluster.remove_node(node)
    assert result["mismatches"] == 0  # every batch: the expected samples of the shard-aware order, pixel for pixel
    stats, expected_order = result["cache"], sharded.order(np.arange(len(images)), 3)
    # Every shard read once for both workers; a second time only for the next epoch's first windows, which the
    # loaders (a few steps ahead) and the node (READ_AHEAD_WINDOWS more) read before the streams were closed.
    ahead, position = set(), len(images)
    for _ in range(READ_AHEAD_WINDOWS + 2):
        key, shards = expected_order.window_shards_at(position)
        ahead |= set(shards)
        position = expected_order.next_window(key)
    assert set(stats["reads"]) == set(range(17))
    assert all(count == 1 or (count == 2 and s in ahead) for s, count in stats["reads"].items()), stats["reads"]
    assert stats["peak_bytes"] <= sharded.buffer_bytes and stats["held_bytes"] <= sharded.buffer_bytes
    # What the object store must keep, measured at every step, stays within the buffer, plus one shard per worker
    # that the node has dropped while that worker still releases it, plus Ray's framing of each object (a few
    # hundred bytes; large next to these 2,880-byte shards only).
    shard_bytes, workers = 60 * 48, 2
    objects = sharded.buffer_bytes // shard_bytes + workers
    store_peak = result["store_peak"]
    assert sharded.buffer_bytes // 2 < store_peak <= sharded.buffer_bytes + workers * shard_bytes + objects * 512, \
        (store_peak, sharded.buffer_bytes)


@pytest.mark.ray
def test_held_out_images_are_gathered_by_the_driver(ray_session, tmp_path):
    uri, images = _prepared(tmp_path)
    sharded = stream_images(_data(), open_source(uri), storage=str(tmp_path), endpoint=None)
    held_out = np.array([5, 61, 62, 999])
    with_holdout = sharded.with_holdout(held_out)
    _, _, table, indices = open_tables(with_holdout, np.arange(10), held_out, seed=0, group="h")
    assert np.array_equal(table.gather(indices, np.empty((4, *SHAPE), np.uint8)), images[held_out])
    assert with_holdout.with_holdout(held_out) is with_holdout  # gathered once


@pytest.mark.ray
def test_a_raw_source_is_prepared_once_into_the_run_storage(ray_session, tmp_path):
    data = _data(source="builtin:digits", resolution=8, channels=1, stream_window_shards=4, stream_buffer_gb=0.0001)
    first = stream_images(data, open_source("builtin:digits"), storage=str(tmp_path), endpoint=None)
    assert first.num_images == 1797 and len(first.files) > 4 and str(tmp_path) in first.uri
    manifest = json.loads((Path(first.uri) / "manifest.json").read_text())
    assert manifest["source"] == "builtin:digits" and sum(manifest["shard_counts"]) == 1797
    again = stream_images(data, open_source("builtin:digits"), storage=str(tmp_path), endpoint=None)
    assert again.uri == first.uri  # reused, not written twice
    assert len(list((tmp_path / ".raydiff-stream").glob("*/manifest.json"))) == 1


@pytest.mark.ray
def test_the_cache_mode_follows_the_object_store(ray_session, tmp_path, capsys):
    digits = open_source("builtin:digits")
    assert choose_cache(_data(cache="auto", resolution=8, channels=1), digits)[0] == "memory"
    mode, why = choose_cache(_data(cache="auto", resolution=8192, channels=3), digits)  # 360 GB decoded
    assert mode == "stream" and "data.cache auto: stream" in why and "object store" in why
    assert choose_cache(_data(cache="memory", resolution=8192, channels=3), digits)[0] == "memory"
    warning = capsys.readouterr().err
    assert "data.cache = memory" in warning and "set data.cache=stream" in warning and "MB" in warning
    uri, _ = _prepared(tmp_path)
    with pytest.raises(DataError, match=r"data.stream_buffer_gb = 1e-06: a node must hold 4 shards of"):
        stream_images(_data(stream_buffer_gb=0.000001), open_source(uri), storage=str(tmp_path), endpoint=None)


@pytest.mark.ray
def test_a_failed_read_is_raised_and_tried_again(ray_session, tmp_path):
    uri, images = _prepared(tmp_path)
    sharded = stream_images(_data(), open_source(uri), storage=str(tmp_path), endpoint=None)
    moved = Path(sharded.files[1]).rename(tmp_path / "away.parquet")
    shards = node_shards(sharded, f"f-{tmp_path.name}")
    with pytest.raises(Exception, match="away|No such file|not found|part-00001"):
        ray_session.get(shards.get.remote([1]))
    moved.rename(sharded.files[1])  # back: the next request reads it
    [[ref]] = ray_session.get(shards.get.remote([1]))
    assert np.array_equal(ray_session.get(ref), images[60:120])


def test_a_stream_copy_that_cannot_be_used_is_one_line_that_says_to_remove_it_not_prepared_over(tmp_path):
    """A copy whose manifest is there but a shard gone was taken for no copy: the run said "preparing ... once",
    then refused its own folder as "OUT already exists" (an OUT the user never gave); on an object store a
    listing that failed for a moment deleted the copy. A copy cut short before its manifest is no copy."""
    import numpy as np

    from raydiff.data import stream
    from raydiff.data.shard_format import write_prepared

    source = open_source(_folder_with_one_png(tmp_path))
    out = tmp_path / "runs" / ".raydiff-stream" / "0123abcd"
    out.mkdir(parents=True)
    (out / "part-00000.parquet").write_bytes(b"a shard without its manifest")
    assert stream._prepared_at(str(out), None) is None  # cut short: prepared again
    for part in out.iterdir():
        part.unlink()
    out.rmdir()
    images = np.zeros((20, 3, 8, 8), np.uint8)
    write_prepared(iter([(images, [])]), source, str(out), shape=(3, 8, 8), rows_per_shard=8)
    assert stream._prepared_at(str(out), None).kind == "prepared"
    (out / "part-00001.parquet").unlink()
    with pytest.raises(DataError) as info:
        stream._prepared_at(str(out), None)
    assert str(info.value).startswith(f"data.source = '{out}': prepared data is incomplete (1 shard(s) missing")
    assert str(info.value).endswith(f"(this is the stream copy raydiff prepares of data.source: remove {out}, and the "
                                    f"next run prepares it again)")
