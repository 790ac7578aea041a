"""Ray Data ingest through the real pipeline: every kind of source, bad samples, the bad-fraction limit, and the
small local folders the driver decodes itself, exactly as Ray Data would; and, without Ray, the one line a file
Ray Data cannot read becomes."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_messy_folder
from PIL import Image

from raydiff.data import image_store
from raydiff.data.builtin import write_synthetic
from raydiff.data.decode import decode_resize_crop, fit_array
from raydiff.data.errors import check_bad_fraction
from raydiff.data.image_store import decodes_in_driver, load_images
from raydiff.data.labels import plan_labels
from raydiff.data.sources import DataError, open_source


@pytest.mark.ray
def test_folder_is_decoded_resized_and_cropped_in_order(ray_session, tmp_path):
    write_synthetic(tmp_path / "b", num=7, resolution=40, fmt="jpg", seed=1)
    write_synthetic(tmp_path / "a" / "nested", num=5, resolution=20, fmt="png", seed=2)
    Image.new("RGB", (30, 12), (200, 10, 10)).save(tmp_path / "wide.png")  # non-square: center crop
    source = open_source(str(tmp_path))
    store = load_images(source, resolution=16, channels=3)
    assert store.num_images == 13 and store.shape == (3, 16, 16) and not store.bad
    images = np.concatenate(store.arrays())
    assert images.dtype == np.uint8 and images.shape == (13, 3, 16, 16)
    for i, path in enumerate(source.files):  # sample i is file i, decoded exactly as decode_resize_crop does
        assert np.array_equal(images[i], decode_resize_crop(open(path, "rb").read(), 16, 3))
    assert np.all(images[-1][0] == 200) and np.all(images[-1][1] == 10)


@pytest.mark.ray
def test_grayscale_digits(ray_session):
    store = load_images(open_source("builtin:digits"), resolution=16, channels=1)
    assert store.num_images == 1797 and store.shape == (1, 16, 16)
    assert np.concatenate(store.arrays()).max() > 200


def _encoded(tmp_path) -> list[bytes]:
    return [p.read_bytes() for p in write_synthetic(tmp_path / "src", num=12, resolution=20, fmt="png", seed=4)]


def _write(kind: str, encoded: list[bytes], folder) -> dict:
    """Write the images as a source of `kind`; return the load options it needs."""
    folder.mkdir()
    half = len(encoded) // 2
    if kind == "parquet-bytes":  # two files, a custom column name
        for name, part in (("a", encoded[:half]), ("b", encoded[half:])):
            pq.write_table(pa.table({"png": pa.array(part, pa.binary())}), folder / f"{name}.parquet")
        return {"image_column": "png"}
    if kind == "parquet-hf":  # Hugging Face datasets' image struct
        rows = [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(encoded)]
        pq.write_table(pa.table({"image": pa.array(rows)}), folder / "train-00000.parquet")
        return {}
    if kind == "parquet-tensor":  # decoded uint8 HWC tensors at the source resolution
        arrays = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in encoded])
        pq.write_table(pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(arrays)}), folder / "t.parquet")
        return {}
    if kind == "parquet-lists":  # the same as nested lists, CHW: Parquet's plain encoding (Hugging Face's Array3D)
        arrays = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).transpose(2, 0, 1) for b in encoded])
        nested = pa.array(arrays.tolist(), pa.list_(pa.list_(pa.list_(pa.uint8()))))
        pq.write_table(pa.table({"image": nested}), folder / "t.parquet")
        return {}
    # webdataset-mixed: a shard's samples of several image extensions, in either case (a PNG's bytes under any
    # name decode as the PNG they are).
    extensions = ("png", "JPG", "jpeg", "webp") if kind == "webdataset-mixed" else ("png",)
    for shard, part in (("shard-000000.tar", encoded[:half]), ("shard-000001.tar", encoded[half:])):
        with tarfile.open(folder / shard, "w") as tar:
            for i, data in enumerate(part):
                for ext, payload in ((extensions[i % len(extensions)], data), ("cls", b"0")):
                    info = tarfile.TarInfo(f"{shard[:12]}_{i:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return {}


@pytest.mark.ray
@pytest.mark.parametrize("kind", ["parquet-bytes", "parquet-hf", "parquet-tensor", "parquet-lists", "webdataset",
                                  "webdataset-mixed"])
def test_every_kind_of_source_gives_the_same_images_in_order(ray_session, tmp_path, kind):
    """webdataset-mixed: a sample without a .jpg had NaN there (Ray's pandas blocks), taken for its image: "no
    image bytes"; and Ray's suffix list matched case exactly, so a .JPG was never read."""
    encoded = _encoded(tmp_path)
    options = _write(kind, encoded, tmp_path / "data")
    source = open_source(str(tmp_path / "data"))
    assert source.kind == ("webdataset" if kind.startswith("webdataset") else "parquet")
    store = load_images(source, resolution=8, channels=3, **options)
    images = np.concatenate(store.arrays())
    assert store.num_images == 12 and not store.bad
    for i, data in enumerate(encoded):
        expected = (fit_array(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), 8, 3)
                    if kind in ("parquet-tensor", "parquet-lists") else decode_resize_crop(data, 8, 3))
        assert np.array_equal(images[i], expected), i


@pytest.mark.ray
def test_bad_samples_are_skipped_and_reported_awkward_modes_converted(ray_session, tmp_path):
    names = write_messy_folder(tmp_path)
    source = open_source(str(tmp_path))
    store = load_images(source, resolution=8, channels=3)
    assert store.num_images == 48 and store.num_good == 44
    reported = {b.where.rsplit("/", 1)[1]: b.reason for b in store.bad}
    assert sorted(reported) == sorted(names["bad"])
    assert reported["empty.jpg"] == "empty file" and "not an image" in reported["notes.jpg"]
    assert "cannot decode" in reported["truncated.jpg"]
    images = np.concatenate(store.arrays())
    index = {path.rsplit("/", 1)[1]: i for i, path in enumerate(source.files)}
    assert [b.index for b in store.bad] == sorted(index[n] for n in names["bad"])
    assert all(images[b.index].max() == 0 for b in store.bad)  # blank rows, never trained on
    assert sorted(set(range(48)) - set(store.usable_indices().tolist())) == [b.index for b in store.bad]
    assert images[index["cmyk.jpg"]][0].mean() > 200  # red, from CMYK
    assert abs(int(images[index["gray16.png"]].mean()) - 40000 // 257) <= 1
    assert np.all(images[index["alpha.png"]][:, :, -2:] == 255)  # transparent half: white

    check_bad_fraction(store, 0.1)
    with pytest.raises(DataError, match=r"4 of 48 samples .* cannot be used \(8.3% > data.max_bad_fraction = 0.05\)"):
        check_bad_fraction(store, 0.05)


@pytest.mark.ray
@pytest.mark.parametrize("what", ["messy folder", "labelled digits"])
def test_a_small_local_folder_decodes_in_the_driver_exactly_as_ray_data_decodes_it(ray_session, tmp_path,
                                                                                    monkeypatch, what):
    if what == "messy folder":
        write_messy_folder(tmp_path)
        source, labels = open_source(str(tmp_path)), None
    else:
        source = open_source("builtin:digits")
        labels = plan_labels(source, "label")
    assert decodes_in_driver(source, 8, 3) and not decodes_in_driver(source, 2048, 3)  # more than a chunk decoded
    here = load_images(source, resolution=8, channels=3, labels=labels)
    monkeypatch.setattr(image_store, "DRIVER_DECODE_BYTES", 0)  # the same source through Ray Data's tasks
    assert not decodes_in_driver(source, 8, 3)
    by_ray_data = load_images(source, resolution=8, channels=3, labels=labels)
    assert np.array_equal(np.concatenate(here.arrays()), np.concatenate(by_ray_data.arrays()))
    assert (here.decoded_by, by_ray_data.decoded_by) == ("the driver", "Ray Data")
    assert here.num_images == by_ray_data.num_images and here.bad == by_ray_data.bad  # chunks may be cut elsewhere
    assert (here.bad != ()) == (what == "messy folder")
    if labels is not None:
        assert here.classes == by_ray_data.classes == tuple(str(d) for d in range(10))
        assert np.array_equal(here.labels, by_ray_data.labels)


@pytest.mark.ray
def test_a_missing_parquet_column_is_a_one_line_error_that_names_the_files_image_column(ray_session, tmp_path):
    _write("parquet-bytes", _encoded(tmp_path), tmp_path / "data")
    with pytest.raises(DataError, match="data.image_column = 'nope': not a column of .*a.parquet; its columns: png$"):
        load_images(open_source(str(tmp_path / "data")), resolution=8, channels=3, image_column="nope")


@pytest.mark.ray
def test_a_hugging_face_file_is_read_from_its_image_feature_where_the_default_column_is_not(ray_session, tmp_path,
                                                                                          capsys):
    encoded = _encoded(tmp_path)

    def hub_file(folder, features: dict) -> str:
        """A Parquet file as Hugging Face's `datasets` writes CIFAR-10's: images in `img`, said so in its metadata."""
        table = pa.table({name: [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(encoded)]
                          for name in features} | {"label": [0] * len(encoded)})
        (tmp_path / folder).mkdir()
        metadata = {"huggingface": json.dumps({"info": {"features": features}})}
        pq.write_table(table.replace_schema_metadata(metadata), tmp_path / folder / "train-00000-of-00001.parquet")
        return str(tmp_path / folder)

    one = hub_file("one", {"img": {"_type": "Image"}})
    store = load_images(open_source(one), resolution=8, channels=3)  # data.image_column left at its default
    assert store.num_images == len(encoded) and not store.bad
    assert f"data.image_column: 'image' is not a column of {one}; reading 'img', its files' Image feature" in (
        capsys.readouterr().out)
    wanted = r"'picture': not a column of .*/train-00000-of-00001.parquet; its columns: img, label; its images are in"
    with pytest.raises(DataError, match=rf"data.image_column = {wanted} img: --set data.image_column=img$"):
        load_images(open_source(one), resolution=8, channels=3, image_column="picture")  # a name given is kept
    two = hub_file("two", {"img": {"_type": "Image"}, "thumb": {"_type": "Image"}})
    with pytest.raises(DataError, match=r"data.image_column = 'image': .* its images are in img and thumb: --set "
                                        r"data.image_column=img$"):
        load_images(open_source(two), resolution=8, channels=3)  # which of two: the user says


@pytest.mark.ray
def test_gcs_source_against_a_loopback_emulator(ray_session, tmp_path, gcs_server):
    endpoint, fs = gcs_server
    paths = write_synthetic(tmp_path / "images", num=6, resolution=16, fmt="png", seed=5)
    for path in paths:
        with fs.open_output_stream(f"raydiff-gcs/raw/{path.name}") as f:
            f.write(path.read_bytes())
    source = open_source("gs://raydiff-gcs/raw", endpoint=endpoint, anonymous=True)
    assert source.kind == "images" and len(source.files) == 6
    store = load_images(source, resolution=8, channels=3)
    images = np.concatenate(store.arrays())
    assert all(np.array_equal(images[i], decode_resize_crop(p.read_bytes(), 8, 3)) for i, p in enumerate(paths))
    with pytest.raises(DataError, match="no such file or folder"):
        open_source("gs://raydiff-gcs/missing", endpoint=endpoint, anonymous=True)


@pytest.mark.ray
def test_a_shard_cut_short_is_a_one_line_error_without_ray_datas_traceback(ray_session, tmp_path):
    import logging

    encoded = _encoded(tmp_path)
    _write("webdataset", encoded, tmp_path / "data")
    whole = (tmp_path / "data" / "shard-000001.tar").read_bytes()
    (tmp_path / "data" / "shard-000001.tar").write_bytes(whole[:512 + 100])  # a download cut in its first image
    source = open_source(str(tmp_path / "data"))
    for read in (lambda: load_images(source, resolution=8, channels=3),
                 lambda: list(image_store.decode_stream(source, resolution=8, channels=3))):
        with pytest.raises(DataError) as info:
            read()
        assert str(info.value) == (f"data.source = {source.uri!r}: a file of it cannot be read (ReadError: unexpected "
                                   f"end of data); a file cut short, as by an interrupted download, is the usual "
                                   f"cause")
    # What Ray Data logs of such a task before raising it, with its traceback or in the clause handling it: left out
    # while decoding, and only then.
    for name in ("ray.data._internal.execution.streaming_executor_state", "ray.data.exceptions"):
        log = logging.getLogger(name)
        other = log.makeRecord(name, logging.ERROR, __file__, 0, "something else", (), None)
        with image_store.unreadable_files_told_once(source):
            try:
                raise tarfile.ReadError("unexpected end of data")
            except tarfile.ReadError as exc:
                traced = log.makeRecord(name, logging.ERROR, __file__, 0, "a task failed", (),
                                        (type(exc), exc, exc.__traceback__))
                plain = log.makeRecord(name, logging.ERROR, __file__, 0, "an exception in Ray Data", (), None)
                assert not log.filter(traced) and not log.filter(plain)
            assert log.filter(other)
        assert log.filter(traced)


def _unsorted_shard(folder, members: list[str]) -> None:
    folder.mkdir()
    png = write_synthetic(folder / "png", num=1, resolution=8, fmt="png")[0].read_bytes()
    with tarfile.open(folder / "shard-000000.tar", "w") as tar:
        for name in members:
            data = png if name.endswith(".png") else b"3"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    shutil.rmtree(folder / "png")


@pytest.mark.ray
def test_a_webdataset_shard_whose_samples_are_not_kept_together_is_one_line_that_says_how_to_remake_it(ray_session,
                                                                                                        tmp_path):
    """`tar cf s.tar *.png *.cls` keeps a sample's files apart: Ray Data's reader raised its ValueError, as a
    traceback (memory mode), or only once the stream reached the shard."""
    from raydiff.data.stream import estimated_count

    _unsorted_shard(tmp_path / "data", ["000.png", "001.png", "000.cls", "001.cls"])
    source = open_source(str(tmp_path / "data"))
    with pytest.raises(DataError) as info:
        load_images(source, resolution=8, channels=3)
    shard = str(tmp_path / "data" / "shard-000000.tar")
    assert str(info.value) == (f"data.source = {source.uri!r}: a WebDataset shard ({shard}) holds a sample's files "
                               f"apart, or one twice, which WebDataset readers refuse: {image_store.RESORT}")
    with pytest.raises(DataError) as info:
        estimated_count(source)  # stream mode's first look: before training
    assert str(info.value) == (f"data.source = {source.uri!r}: in its shard {shard} the members of sample '000' are "
                               f"not adjacent, which WebDataset readers refuse: {image_store.RESORT}")


@pytest.mark.parametrize(("members", "problem"), [
    (["a/000.png", "a/000.cls", "a/001.png", "a/001.cls"], None),
    (["000.png", "000.cls", "000.png"], "000.png is in it twice"),
    (["000.png", "001.png", "000.cls"], "the members of sample '000' are not adjacent"),
    (["x/000.png", "y/000.png"], None),  # two samples: keys keep their folders
])
def test_the_order_webdataset_readers_need_is_checked_as_they_check_it(members, problem):
    assert image_store.webdataset_order_problem(members) == problem


def test_a_file_the_workers_cannot_read_at_all_is_one_line_naming_it_and_why():
    """No Ray: the error as Ray Data raises it in the driver, the worker's own or a Ray task's error built on it."""
    import logging

    from ray.exceptions import RayTaskError

    source = SimpleNamespace(uri="s3://bucket/images")
    gone = FileNotFoundError(2, "Failed to open local file '/data/images/0001.png'. Detail: [errno 2] No such file")
    denied = RayTaskError("ReadBinary", "Traceback (most recent call last):\n  File ...\nPermissionError",
                          PermissionError(13, "Permission denied", "bucket/images/0002.png")).as_instanceof_cause()
    for error, reason in ((gone, "FileNotFoundError: [Errno 2] Failed to open local file '/data/images/0001.png'. "
                                 "Detail: [errno 2] No such file"),
                          (denied, "PermissionError: [Errno 13] Permission denied: 'bucket/images/0002.png'")):
        with pytest.raises(DataError) as info, image_store.unreadable_files_told_once(source):
            raise error
        assert str(info.value) == (
            f"data.source = 's3://bucket/images': a file of it cannot be read ({reason}); a file removed since it "
            f"was listed, or one that Ray Data's workers may not read (permissions; on a cluster, every node needs "
            f"the bucket's credentials or HF_TOKEN), is the usual cause")
    log = logging.getLogger("ray.data.exceptions")  # Ray Data's own traceback of it: left out
    with image_store.unreadable_files_told_once(source):
        assert not log.filter(log.makeRecord(log.name, logging.ERROR, __file__, 0, "a task failed", (),
                                             (type(denied), denied, None)))
