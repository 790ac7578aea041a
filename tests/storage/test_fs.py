"""Which filesystem a run, data or checkpoint URI lives on, and the path within it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

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
    assert is_remote("s3://bucket") and is_remote("gs://bucket") and scheme_of("s3://bucket/x") == "s3://"
    assert join_uri("s3://bucket/runs/", "a", "b.json") == "s3://bucket/runs/a/b.json"


def test_an_unsupported_scheme_is_refused_naming_what_is_supported():
    with pytest.raises(ValueError, match=r"unsupported URI scheme 'hdfs://'; supported: .*s3://.* or a local path"):
        filesystem_for("hdfs://namenode/data")
