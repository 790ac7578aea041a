"""Which filesystem a run, data or checkpoint URI lives on, and the path within it."""

from __future__ import annotations

import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import raydiff.storage.fs
from raydiff.storage.fs import filesystem_for, is_remote, join_uri, scheme_of


def test_local_paths_and_file_uris_resolve_to_absolute_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = filesystem_for("runs/a")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "runs" / "a")
    assert filesystem_for(f"file://{tmp_path}/b")[1] == str(tmp_path / "b")
    assert filesystem_for("~/c")[1] == str(Path.home() / "c")
    assert not is_remote(str(tmp_path)) and scheme_of(str(tmp_path)) is None


def test_buckets_get_their_own_filesystem_and_an_endpoint_override():
    fs, path = filesystem_for("s3://bucket/runs/a/", endpoint="http://127.0.0.1:9000")
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/runs/a"
    fs, path = filesystem_for("gs://bucket/data", endpoint="http://127.0.0.1:4443", anonymous=True)
    assert isinstance(fs, pafs.GcsFileSystem) and path == "bucket/data"
    assert fs.__reduce__()[1][0]["scheme"] == "http"  # as the endpoint says
    # Anonymous reads of a public bucket: over https (pyarrow's anonymous client defaulted to plain http).
    assert filesystem_for("gs://bucket/data", anonymous=True)[0].__reduce__()[1][0]["scheme"] == "https"
    assert is_remote("s3://bucket") and is_remote("gs://bucket") and scheme_of("s3://bucket/x") == "s3://"
    assert join_uri("s3://bucket/runs/", "a", "b.json") == "s3://bucket/runs/a/b.json"


def test_an_s3_buckets_region_is_asked_once_per_process_and_again_where_s3_did_not_say(monkeypatch):
    """A run builds a file system for every path it touches: without AWS_REGION, each asked S3 for the bucket's
    region. Asked once; a question S3 did not answer (offline for a moment) is not remembered."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    asked: list[str] = []

    def resolve(bucket: str) -> str:
        asked.append(bucket)
        if len(asked) == 1:
            raise OSError("no answer")
        return "eu-west-3"

    monkeypatch.setattr(pafs, "resolve_s3_region", resolve)
    monkeypatch.setattr(raydiff.storage.fs, "_REGIONS", {})
    assert filesystem_for("s3://far-bucket/runs/a")[0].region != "eu-west-3"  # not known: the default, for now
    assert [filesystem_for(f"s3://far-bucket/runs/{n}")[0].region for n in "bcd"] == ["eu-west-3"] * 3
    assert asked == ["far-bucket", "far-bucket"]


def test_an_unsupported_scheme_is_refused_naming_what_is_supported():
    with pytest.raises(ValueError, match=r"unsupported URI scheme 'hdfs://'; supported: .*s3://.* or a local path"):
        filesystem_for("hdfs://namenode/data")


def test_s3_storage_rides_out_a_throttled_bucket_for_a_whole_run_also_where_ray_unpickles_it(s3_server):
    """503s several times in a row, and more than a hundred retried ones in one filesystem's life (where pyarrow's
    default retries would have failed the first after 3 attempts and stopped retrying after about a hundred), through
    the filesystem as Ray Train's controller and workers get it: pickled."""
    from flaky_s3 import FlakyS3

    endpoint, client = s3_server
    client.create_bucket(Bucket="throttled")
    with FlakyS3(endpoint, rate=0.0) as proxy:
        fs, path = filesystem_for("s3://throttled/runs/smoke", endpoint=proxy.endpoint)
        fs = pickle.loads(pickle.dumps(fs))
        proxy.fail_next("HEAD", 6)
        assert fs.get_file_info(f"{path}/checkpoint_00000015").type == pafs.FileType.NotFound
        for _ in range(120):
            proxy.fail_next("HEAD", 1)
            assert fs.get_file_info(f"{path}/checkpoint_00000015").type == pafs.FileType.NotFound
        assert proxy.counts["slow_down"] == 126
