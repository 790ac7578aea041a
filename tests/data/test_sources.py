"""Listing data sources: kinds, order, identity, and one-line errors (no Ray)."""

from __future__ import annotations

import json
import shutil

import pytest

from raydiff.data.builtin import write_synthetic
from raydiff.data.sources import DataError, open_source


def test_folder_is_listed_recursively_and_sorted(tmp_path):
    write_synthetic(tmp_path / "b", num=3, resolution=8, fmt="jpg")
    write_synthetic(tmp_path / "a" / "nested", num=2, resolution=8, fmt="png")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden.png").write_bytes(b"")
    write_synthetic(tmp_path / "b" / ".ipynb_checkpoints", num=2, resolution=8, fmt="jpg")  # hidden folders: not data
    write_synthetic(tmp_path / ".git" / "lfs", num=1, resolution=8, fmt="png")
    source = open_source(str(tmp_path))
    assert source.kind == "images" and len(source.files) == 5 and list(source.files) == sorted(source.files)
    assert open_source(f"file://{tmp_path}").files == source.files
    assert source.describe() == f"5 image files in {tmp_path}"
    single = str(tmp_path / "b" / "synthetic_000000.jpg")
    assert open_source(single).files == (single,) and open_source(single).describe() == f"1 image file in {single}"
    hidden_root = tmp_path / ".cache" / "images"  # a source inside a hidden folder is read as any other
    write_synthetic(hidden_root, num=2, resolution=8, fmt="png")
    assert len(open_source(str(hidden_root)).files) == 2
    assert len(open_source(str(tmp_path / "b" / "*.jpg")).files) == 3  # a glob's files, not its hidden folder's
    named = str(tmp_path / ".hidden.png")  # a hidden file named as the source is taken (it was "no image files")
    assert open_source(named).files == (named,)


def test_identity_follows_names_and_sizes_not_location(tmp_path):
    write_synthetic(tmp_path / "one", num=3, resolution=8)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    first, moved = open_source(str(tmp_path / "one")).identity(), open_source(str(tmp_path / "two")).identity()
    assert first["fingerprint"] == moved["fingerprint"] and first["num_files"] == 3
    (tmp_path / "two" / "synthetic_000001.png").write_bytes(b"changed")
    assert open_source(str(tmp_path / "two")).identity()["fingerprint"] != first["fingerprint"]


def test_kinds_by_extension_and_format_override(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "b.tar").write_bytes(b"")
    (tmp_path / "shards" / "a.tar").write_bytes(b"")
    assert open_source(str(tmp_path / "shards")).kind == "webdataset"
    (tmp_path / "shards" / "x.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="several kinds of files .*set data.format"):
        open_source(str(tmp_path / "shards"))
    source = open_source(str(tmp_path / "shards"), format="webdataset")
    assert source.kind == "webdataset" and [f.rsplit("/", 1)[1] for f in source.files] == ["a.tar", "b.tar"]


def test_prepared_folder_is_recognised_by_its_manifest(tmp_path):
    (tmp_path / "part-00000.parquet").write_bytes(b"x")
    manifest = {"format": "raydiff-prepared", "version": 1, "shards": ["part-00000.parquet", "part-00001.parquet"],
                "resolution": 8, "channels": 3, "count": 2}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="prepared data is incomplete"):
        open_source(str(tmp_path))
    (tmp_path / "part-00001.parquet").write_bytes(b"y")
    source = open_source(str(tmp_path))
    assert source.kind == "prepared" and source.manifest["resolution"] == 8 and len(source.files) == 2


@pytest.mark.parametrize("source, message", [
    (None, "data.source is not set"),
    ("missing", "no such file or folder"),
    ("empty", "no image files found"),
    ("ftp://host/x", "unsupported URI scheme 'ftp://'"),
    ("builtin:cats", "unknown builtin dataset"),
])
def test_unusable_sources_are_one_line_errors(tmp_path, source, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images here")
    given = source if source is None or "://" in source or ":" in source else str(tmp_path / source)
    with pytest.raises(DataError, match=message) as info:
        open_source(given)
    assert "\n" not in str(info.value)


def test_an_unreachable_bucket_is_a_one_line_error_not_a_long_wait(monkeypatch):
    """GCS's client would retry for 15 minutes; raydiff bounds it (a minute; 2 s here)."""
    import datetime

    from conftest import free_port

    monkeypatch.setattr("raydiff.storage.fs.GCS_RETRY_LIMIT", datetime.timedelta(seconds=2))
    with pytest.raises(DataError, match=r"gs://bucket/imgs'?: cannot read it \(.*UNAVAILABLE") as info:
        open_source("gs://bucket/imgs", endpoint=f"http://127.0.0.1:{free_port()}", anonymous=True)  # nobody listens
    assert "\n" not in str(info.value)


def test_builtin_digits_are_image_files():
    source = open_source("builtin:digits")
    assert source.kind == "images" and len(source.files) == 1797 and source.uri == "builtin:digits"


def _cut_tar() -> bytes:
    """A WebDataset shard whose download stopped in its first image."""
    import io
    import tarfile

    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w") as tar:
        member = tarfile.TarInfo("0000.png")
        member.size = 5000
        tar.addfile(member, io.BytesIO(bytes(5000)))
    return whole.getvalue()[:1000]


@pytest.mark.parametrize(("name", "content"), [("b.parquet", b"PAR1 not Parquet"), ("b.tar", b"not a tar archive"),
                                               ("cut.tar", _cut_tar())])
def test_a_file_that_is_not_what_its_name_says_is_a_one_line_error_naming_it(tmp_path, name, content):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydiff.config import load_config
    from raydiff.data.image_store import load_images
    from raydiff.data.labels import plan_labels
    from raydiff.data.stream import choose_cache

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_bytes(content)  # the first file: its footer, schema or first members are read
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"image": [b"x"], "label": [1]}), tmp_path / "data" / "c.parquet")
    source = open_source(str(tmp_path / "data"))
    data = load_config("default", [f"data.source={tmp_path / 'data'}"]).data
    reads = [lambda: choose_cache(data, source, use_gpu=False)]  # every run counts the samples first
    if name.endswith(".parquet"):  # labels, and the decode of `raydiff.prepare`, read the first file's schema
        reads += [lambda: plan_labels(source, "label"), lambda: load_images(source, resolution=8, channels=3)]
    reason = {"b.parquet": "Parquet magic bytes not found in footer", "b.tar": "not a tar archive",
              "cut.tar": "unexpected end of data"}[name]
    for read in reads:
        with pytest.raises(DataError) as info:
            read()
        message = str(info.value)
        assert message.startswith(f"data.source = {source.uri!r}: cannot read {source.files[0]} ({reason}"), message
        assert "\n" not in message


def test_the_footers_of_a_remote_parquet_dataset_are_read_at_once_not_one_after_another(tmp_path):
    """Counting the samples reads every Parquet file's footer before a run starts (and in `raydiff.prepare`): on
    an object store each read waits for the network, so the reads overlap."""
    import threading
    import time

    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from fsspec.implementations.local import LocalFileSystem

    from raydiff.data.sources import Source
    from raydiff.data.stream import estimated_count

    class DistantFiles(LocalFileSystem):
        """Local files, each open waiting as a request to an object store does; counts the opens in flight."""
        lock, in_flight, most_in_flight = threading.Lock(), 0, 0

        def _open(self, *args, **kwargs):
            cls = DistantFiles
            with cls.lock:
                cls.in_flight += 1
                cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
            time.sleep(0.05)
            with cls.lock:
                cls.in_flight -= 1
            return super()._open(*args, **kwargs)

    paths = []
    for i in range(12):
        paths.append(str(tmp_path / f"train-{i:05d}.parquet"))
        pq.write_table(pa.table({"image": [b"x"] * (i + 1)}), paths[-1])
    source = Source(uri="s3://bucket/train", kind="parquet",
                    filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(DistantFiles(skip_instance_cache=True))),
                    files=tuple(paths), sizes=(1,) * len(paths))
    assert estimated_count(source) == sum(range(1, 13))
    assert DistantFiles.most_in_flight >= 4

    (tmp_path / "train-00003.parquet").write_bytes(b"PAR1 not Parquet")  # a damaged file is still named in one line
    with pytest.raises(DataError, match=r"cannot read .*train-00003.parquet \(Parquet magic bytes not found"):
        estimated_count(source)


def test_a_remote_webdataset_shard_is_counted_in_reads_of_a_megabyte_not_one_per_member(tmp_path):
    """`data.cache: auto` counts the first shard's samples from its tar headers: read one after another, each a
    request to an object store (a round trip per member, two per sample: minutes for a shard of a few thousand)."""
    import io
    import tarfile

    import pyarrow.fs as pafs
    from fsspec.implementations.local import LocalFileSystem

    from raydiff.data.sources import Source
    from raydiff.data.stream import estimated_count

    reads = []

    class Counted(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def read(self, size=-1):
            reads.append(size)
            return self.f.read(size)

        def readable(self):
            return True

        def seekable(self):
            return True

        def seek(self, offset, whence=0):
            return self.f.seek(offset, whence)

        def tell(self):
            return self.f.tell()

    class ReadCountingFiles(LocalFileSystem):
        """Local files whose every read is counted, as an object store's requests would be."""

        def _open(self, *args, **kwargs):
            return Counted(super()._open(*args, **kwargs))

    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(400):
            for extension, data in (("png", bytes(2000)), ("cls", b"3")):
                info = tarfile.TarInfo(f"{i:06d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    source = Source(uri="s3://bucket/shards", kind="webdataset",
                    filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(ReadCountingFiles(skip_instance_cache=True))),
                    files=(str(shard),) * 3, sizes=(shard.stat().st_size,) * 3)
    assert estimated_count(source) == 400 * 3
    assert len(reads) <= 4, len(reads)  # 1,600 before: two reads of each member's header


@pytest.mark.parametrize("source", ["~nosuchuser-of-raydiff/images", "file://~nosuchuser-of-raydiff/images"])
def test_a_source_under_an_unknown_user_s_home_is_one_line(source):
    """Path.expanduser raises RuntimeError there: a traceback from prepare, and from training for the file:// form,
    which the config's check takes for a URI."""
    with pytest.raises(DataError) as refused:
        open_source(source)
    assert str(refused.value) == f"data.source = {source!r}: cannot look at it (Could not determine home directory.)"
