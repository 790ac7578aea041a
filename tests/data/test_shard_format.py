"""The prepared-shard format: what is written reads back bit for bit, in order and with its labels; a folder is
prepared whole or not at all, and readable by others as any new folder; the older version's tensor column is still
read; a mismatched or foreign folder is told apart, and a broken raydiff manifest is one line."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raydiff.data.errors import BadSample, DataError
from raydiff.data.labels import LabelPlan
from raydiff.data.shard_format import (
    MANIFEST,
    check_prepared,
    read_manifest,
    read_shard,
    rows_per_shard_for,
    write_prepared,
)
from raydiff.data.sources import open_source
from raydiff.storage.rundir import RunInUse

SHAPE = (3, 4, 4)
LOCAL = pafs.LocalFileSystem()


@pytest.fixture
def source(tmp_path):
    from raydiff.data.builtin import write_synthetic

    write_synthetic(tmp_path / "raw", num=1, resolution=8)
    return open_source(str(tmp_path / "raw"))


def _images(num: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num, *SHAPE), dtype=np.uint8)


def test_uneven_batches_become_full_shards_that_read_back_bit_for_bit_with_their_labels(source, tmp_path):
    images = _images(250)
    labels = np.array([f"class{i % 3}" for i in range(250)], dtype=object)
    cuts = [0, 7, 90, 91, 200, 250]  # batches of 7, 83, 1, 109 and 50 images
    bad = [BadSample(index=250, where="raw/broken.png", reason="truncated")]
    batches = [(images[a:b], bad if a == 0 else [], labels[a:b].tolist(), sorted(set(labels[a:b])))
               for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    plan = LabelPlan(where="folder", rule="names")
    manifest = write_prepared(iter(batches), source, str(tmp_path / "out"), shape=SHAPE, rows_per_shard=64,
                              labels=plan)

    assert manifest["shard_counts"] == [64, 64, 64, 58] and manifest["count"] == 250
    assert manifest["shards"] == [f"part-{i:05d}.parquet" for i in range(4)]
    assert manifest["classes"] == ["class0", "class1", "class2"]
    assert manifest["bad"] == [{"index": 250, "where": "raw/broken.png", "reason": "truncated"}]
    assert read_manifest(LOCAL, str(tmp_path / "out")) == manifest
    read = np.concatenate([read_shard(LOCAL, str(tmp_path / "out" / name), SHAPE) for name in manifest["shards"]])
    assert np.array_equal(read, images)
    read_labels = [x for name in manifest["shards"]
                   for x in pq.read_table(tmp_path / "out" / name, columns=["label"]).column("label").to_pylist()]
    assert read_labels == labels.tolist()


def test_a_stopped_preparation_leaves_nothing_behind(source, tmp_path):
    def stopped():
        yield _images(100), []
        raise KeyboardInterrupt  # Ctrl-C, after a shard was written

    with pytest.raises(KeyboardInterrupt):
        write_prepared(stopped(), source, str(tmp_path / "out"), shape=SHAPE, rows_per_shard=64)
    assert list(tmp_path.iterdir()) == [tmp_path / "raw"]  # neither the folder nor the copy it was built in


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RunInUse])
def test_a_stopped_bucket_preparation_removes_its_copy_unless_another_run_took_it_over(s3_server, source, stop):
    """On a bucket the shards go straight under the copy's name: a stop removes them; a preparation that lost its
    lease leaves them, as they are the shards of the run that holds it now."""
    endpoint, client = s3_server
    bucket = f"prep-{stop.__name__.lower()}"
    client.create_bucket(Bucket=bucket)

    def stopped():
        yield _images(100), []
        client.put_object(Bucket=bucket, Key="copy/shard_00009.parquet", Body=b"the other run's")
        raise stop("stopped")

    with pytest.raises(stop):
        write_prepared(stopped(), source, f"s3://{bucket}/copy", shape=SHAPE, rows_per_shard=64, endpoint=endpoint)
    keys = {entry["Key"] for entry in client.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert ("copy/shard_00009.parquet" in keys) == (stop is RunInUse)


def test_too_many_bad_samples_stop_it_before_the_manifest(source, tmp_path):
    bad = [BadSample(index=i, where=f"raw/{i}.png", reason="not an image") for i in range(10, 15)]
    with pytest.raises(DataError, match=r"5 of 15 samples .* > data.max_bad_fraction = 0.1"):
        write_prepared(iter([(_images(10), bad)]), source, str(tmp_path / "out"), shape=SHAPE,
                       max_bad_fraction=0.1)
    assert not (tmp_path / "out").exists()
    # `raydiff.prepare` names its own flag, which is what its user set.
    with pytest.raises(DataError, match=r"5 of 15 samples .* \(33.3% > --max-bad-fraction = 0.1\)"):
        write_prepared(iter([(_images(10), bad)]), source, str(tmp_path / "out"), shape=SHAPE,
                       max_bad_fraction=0.1, max_bad_setting="--max-bad-fraction")
    assert not (tmp_path / "out").exists()


def test_an_occupied_or_empty_result_is_refused(source, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(DataError, match=f"^OUT = '{tmp_path / 'out'}' already exists and is not an empty folder: "
                                        f"choose a new folder$"):
        write_prepared(iter([(_images(3), [])]), source, str(tmp_path / "out"), shape=SHAPE)
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    with pytest.raises(DataError, match="no usable samples"):
        write_prepared(iter([]), source, str(tmp_path / "none"), shape=SHAPE)


def test_version_1_s_tensor_column_is_still_read(tmp_path):
    images = _images(5)
    column = pa.FixedShapeTensorArray.from_numpy_ndarray(images)
    pq.write_table(pa.table({"image": column}), tmp_path / "part-00000.parquet")
    assert np.array_equal(read_shard(LOCAL, str(tmp_path / "part-00000.parquet"), SHAPE), images)


def test_only_a_raydiff_manifest_makes_a_prepared_folder(tmp_path):
    assert read_manifest(LOCAL, str(tmp_path)) is None
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "someone-else", "count": 3}))
    assert read_manifest(LOCAL, str(tmp_path)) is None


@pytest.mark.parametrize("foreign", [b'[{"file": "0.png"}]', b'{"images": [', b'"raydiff-prepared"', b"\xff\xfe"],
                         ids=["a JSON list", "not JSON", "a JSON string", "not text"])
def test_another_tool_s_manifest_leaves_a_folder_raw_data(source, tmp_path, foreign):
    """A folder of images with a manifest.json of its own (a labelling tool's, a dataset export's) is read as the
    images it holds, not refused with a traceback."""
    (tmp_path / "raw" / MANIFEST).write_bytes(foreign)
    assert read_manifest(LOCAL, str(tmp_path / "raw")) is None
    assert open_source(str(tmp_path / "raw")).kind == "images"


@pytest.mark.parametrize("manifest, wrong", [
    ({"count": 3, "resolution": 4, "channels": 3}, "'shards' is not a list of file names"),
    ({"shards": "part-00000.parquet", "count": 3, "resolution": 4, "channels": 3},
     "'shards' is not a list of file names"),
    ({"shards": [], "count": "3", "resolution": 4}, "'count' is not a number, 'channels' is not a number"),
], ids=["no shards", "shards not a list", "count and channels"])
def test_a_raydiff_manifest_without_what_it_needs_is_one_line(tmp_path, manifest, wrong):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "raydiff-prepared", **manifest}))
    with pytest.raises(DataError) as refused:
        open_source(str(tmp_path))
    assert str(refused.value) == (f"{tmp_path}/{MANIFEST}: a raydiff-prepared manifest, but {wrong}: it was not "
                                  f"written by raydiff.prepare, or was changed since; prepare the data again "
                                  f"(python -m raydiff.prepare)")


def test_a_prepared_folder_is_as_readable_by_others_as_any_new_folder(source, tmp_path):
    """mkdtemp's 0o700 would stay on it after the rename, shutting other users and pods of a shared mount out."""
    umask = os.umask(0o022)
    try:
        write_prepared(iter([(_images(3), [])]), source, str(tmp_path / "out"), shape=SHAPE)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755


def test_prepared_data_must_match_the_run_s_resolution_and_channels(source, tmp_path):
    write_prepared(iter([(_images(3), [])]), source, str(tmp_path / "out"), shape=SHAPE)
    prepared = open_source(str(tmp_path / "out"))
    check_prepared(prepared, resolution=4, channels=3)
    with pytest.raises(DataError, match=r"prepared at 4px with 3 channel\(s\), but data.resolution = 8"):
        check_prepared(prepared, resolution=8, channels=3)
    assert rows_per_shard_for(SHAPE, shard_bytes=480) == 10  # 48 bytes per image


@pytest.mark.ray
def test_shards_of_a_preparation_stopped_before_its_manifest_are_refused_in_one_line(source, tmp_path, ray_session):
    """On a bucket the shards appear one by one and the manifest last: a preparation killed before it left raw
    Parquet files to a run, which read every row as "not an image" and said that none of the samples was usable."""
    from raydiff.data.image_store import load_images

    write_prepared(iter([(_images(20), [])]), source, str(tmp_path / "out"), shape=SHAPE, rows_per_shard=8)
    # A shard of a whole preparation named instead of its folder: told to name the folder, not to remove it.
    shard = open_source(str(tmp_path / "out" / "part-00000.parquet"))
    with pytest.raises(DataError) as info:
        load_images(shard, resolution=4, channels=3)
    assert str(info.value) == (f"data.source = {shard.uri!r} names shards of data raydiff.prepare wrote; give their "
                               f"folder, {tmp_path / 'out'}, whose manifest.json says how to read them")
    (tmp_path / "out" / "manifest.json").unlink()
    cut = open_source(str(tmp_path / "out"))
    assert cut.kind == "parquet"
    with pytest.raises(DataError) as info:
        load_images(cut, resolution=4, channels=3)
    assert str(info.value) == (f"data.source = {cut.uri!r} holds shards of raydiff.prepare without their manifest: a "
                               f"preparation stopped before its end; remove them and prepare again")
