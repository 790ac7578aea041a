"""Labels from every kind of source (`data.labels: auto`), in memory and stream mode; the prepared format's label
column; a source without labels is one line, a sample without one is a bad sample; label dropout is a pure
function of the stream position."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydiff.config import DataSection
from raydiff.data.builtin import write_synthetic
from raydiff.data.errors import DataError
from raydiff.data.image_store import load_data
from raydiff.data.loader import BatchStream, ImageTable
from raydiff.data.noise import dropped_labels
from raydiff.data.order import SampleOrder, rank_share
from raydiff.data.run_images import open_images, open_tables
from raydiff.data.sources import open_source


def _data(source: str, **overrides) -> DataSection:
    values = {"source": source, "resolution": 8, "channels": 3, "labels": "auto", "cache": "memory",
              "max_bad_fraction": 0.5, "stream_buffer_gb": 0.001, "stream_window_shards": 2, **overrides}
    return DataSection(**values)


def _write_tar(path: Path, samples: list[tuple[bytes, bytes | None]], cls_ext: dict[int, str] | None = None) -> None:
    """Sample i's class member is `<key>.cls`, or `<key>.<cls_ext[i]>` (another spelling)."""
    with tarfile.open(path, "w") as tar:
        for i, (image, cls) in enumerate(samples):
            for ext, payload in (("png", image), ((cls_ext or {}).get(i, "cls"), cls)):
                if payload is not None:
                    info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """One labelled source of each kind, each with samples that have no usable label."""
    root = tmp_path_factory.mktemp("labelled")
    write_synthetic(root / "folder" / "dog", num=2, resolution=12, seed=1)
    write_synthetic(root / "folder" / "cat", num=3, resolution=12, seed=2)
    write_synthetic(root / "folder", num=1, resolution=12, seed=3)  # directly in the root: no label
    images = [p.read_bytes() for p in write_synthetic(root / "raw", num=6, resolution=12, seed=4)]
    (root / "ints").mkdir()
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()),
                             "label": pa.array([2, 0, None, 2, -1, 0], pa.int64())}), root / "ints" / "a.parquet")
    (root / "named").mkdir()  # as Hugging Face's `datasets` writes a ClassLabel column: ids, their names aside
    features = {"image": {"dtype": "binary", "_type": "Value"},
                "label": {"names": ["airplane", "automobile", "bird", "cat"], "_type": "ClassLabel"}}
    named = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array([3, 0, None, 7, -1, 0], pa.int64())})
    pq.write_table(named.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
                   root / "named" / "a.parquet")
    (root / "names").mkdir()
    pq.write_table(pa.table({"image": pa.array(images[:4], pa.binary()),
                             "kind": pa.array(["tree", "boat", None, "tree"])}), root / "names" / "a.parquet")
    (root / "categories").mkdir()  # pandas' Categorical: a dictionary-encoded column, nulls included
    pq.write_table(pa.table({"image": pa.array(images[:4], pa.binary()),
                             "kind": pa.array(["tree", "boat", None, "tree"]).dictionary_encode()}),
                   root / "categories" / "a.parquet")
    (root / "wds").mkdir()
    # One sample's class as .CLS: a column of its own in the block, NaN where the others have .cls.
    _write_tar(root / "wds" / "shard-0.tar", [(images[0], b"3\n"), (images[1], b"1"), (images[2], None),
                                              (images[3], b"0"), (images[4], b"2")], cls_ext={4: "CLS"})
    return {kind: str(root / kind) for kind in ("folder", "ints", "named", "names", "categories", "wds")}


EXPECTED = {  # kind: (options, classes, labels by sample index, indices without a label)
    "folder": ({}, ("cat", "dog"), [0, 0, 0, 1, 1, -1], [5]),
    "ints": ({}, ("0", "1", "2"), [2, 0, -1, 2, -1, 0], [2, 4]),
    "named": ({}, ("airplane", "automobile", "bird", "cat"), [3, 0, -1, -1, -1, 0], [2, 3, 4]),
    "names": ({"label_column": "kind"}, ("boat", "tree"), [1, 0, -1, 1], [2]),
    # Ray's numpy batches gave the null a class's name: it trained as "tree", never reported.
    "categories": ({"label_column": "kind"}, ("boat", "tree"), [1, 0, -1, 1], [2]),
    "wds": ({}, ("0", "1", "2", "3"), [3, 1, -1, 0, 2], [2]),  # the .CLS one was read as having no label
}


@pytest.mark.ray
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_each_source_kind_reads_its_labels_in_memory(ray_session, sources, kind):
    options, classes, labels, unlabelled = EXPECTED[kind]
    store = load_data(_data(sources[kind], **options))
    assert store.classes == classes and store.labels is not None and store.labels.dtype == np.int32
    assert store.labels.tolist() == labels
    assert [b.index for b in store.bad] == unlabelled and all(b.reason.startswith("no label") for b in store.bad)
    counts = np.bincount([c for c in labels if c >= 0], minlength=len(classes)).tolist()
    assert store.class_counts() == counts
    assert store.label_summary() == {"classes": list(classes), "class_counts": counts}
    # Without labels, nothing is read: the store is what it always was.
    plain = load_data(_data(sources[kind], labels="none", **options))
    assert plain.labels is None and plain.classes == () and not plain.bad and plain.label_summary() == {}
    assert plain.class_counts() == []


@pytest.mark.ray
def test_digits_are_labelled_by_their_digit_in_the_same_order(ray_session):
    from sklearn.datasets import load_digits

    store = load_data(_data("builtin:digits", channels=1))
    assert store.classes == tuple("0123456789") and not store.bad
    assert np.array_equal(store.labels, load_digits().target)
    assert sum(store.class_counts()) == 1797


@pytest.mark.ray
def test_unlabelled_samples_count_against_the_bad_fraction(ray_session, sources):
    with pytest.raises(DataError, match=r"1 of 6 samples .* data.max_bad_fraction = 0.1.*no label: not in a class"):
        load_data(_data(sources["folder"], max_bad_fraction=0.1))


@pytest.mark.ray
def test_stream_mode_and_prepare_keep_the_labels(ray_session, sources, tmp_path):
    from raydiff.prepare import main as prepare

    streamed, _ = open_images(_data(sources["folder"], cache="stream"), open_source(sources["folder"]),
                              storage=str(tmp_path), endpoint=None)
    assert streamed.classes == ("cat", "dog") and streamed.labels.tolist() == [0, 0, 0, 1, 1]
    assert streamed.bad_report()["count"] == 1 and streamed.class_counts() == [3, 2]
    unlabelled, _ = open_images(_data(sources["folder"], cache="stream", labels="none"),
                                open_source(sources["folder"]), storage=str(tmp_path), endpoint=None)
    assert unlabelled.uri != streamed.uri and unlabelled.labels is None and unlabelled.num_images == 6
    # The held-out images keep their labels.
    held = streamed.with_holdout(np.array([1, 4]))
    _, _, table, indices = open_tables(held, np.array([0, 2, 3]), np.array([1, 4]), seed=0, group="labels")
    assert table.labels[indices].tolist() == [0, 1]

    out = tmp_path / "prepared"
    assert prepare([sources["folder"], str(out), "--resolution", "8", "--labels", "auto",
                    "--max-bad-fraction", "0.5"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["classes"] == ["cat", "dog"] and len(manifest["bad"]) == 1
    assert pq.read_table(out / manifest["shards"][0]).column("label").to_pylist() == ["cat"] * 3 + ["dog"] * 2
    store = load_data(_data(str(out)))
    assert store.classes == ("cat", "dog") and store.labels.tolist() == [0, 0, 0, 1, 1] and not store.bad
    assert np.array_equal(np.concatenate(store.arrays()), np.concatenate(list(streamed.iter_arrays())))
    # A class its manifest does not list (an edited manifest): those rows are bad, as in stream mode (memory mode
    # kept them as class -1, which the loader refused mid-run).
    manifest_path = out / "manifest.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "classes": ["cat"]}))
    edited = load_data(_data(str(out)))
    assert edited.classes == ("cat",) and edited.labels.tolist() == [0, 0, 0, -1, -1]
    assert [(b.index, b.reason) for b in edited.bad] == [(i, "no label: its class is not one of the manifest's "
                                                             "classes") for i in (3, 4)]
    assert edited.class_counts() == [3]

    # A version 2 folder (no label column) is still read without labels, and refused with them.
    v2 = Path(unlabelled.uri)
    manifest = json.loads((v2 / "manifest.json").read_text())
    (v2 / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    assert load_data(_data(str(v2), labels="none")).num_images == 6
    with pytest.raises(DataError, match=r"is prepared data without labels \(version 2, made before labels existed\)"):
        load_data(_data(str(v2)))


@pytest.mark.ray
@pytest.mark.parametrize("kind, message", [
    ("flat", r"data.labels = 'auto': data.source = '.*flat' has no class subfolders; put each class's images in "
             r".*flat/<class>/$"),
    ("parquet", r"data.label_column = 'label' is not a column of .*a.parquet; its columns: image, kind$"),
    ("wds", r"has no .cls members; give each sample its class as <key>.cls \(an integer id or a name\)$"),
])
def test_a_source_without_labels_is_one_line(ray_session, sources, tmp_path, kind, message):
    if kind == "flat":
        write_synthetic(tmp_path / "flat", num=2, resolution=12)
        source = str(tmp_path / "flat")
    elif kind == "parquet":
        source = sources["names"]
    else:
        (tmp_path / "wds").mkdir()
        pngs = [p.read_bytes() for p in write_synthetic(tmp_path / "src", num=2, resolution=12)]
        _write_tar(tmp_path / "wds" / "a.tar", [(pngs[0], None), (pngs[1], None)])
        source = str(tmp_path / "wds")
    with pytest.raises(DataError, match=message) as raised:
        load_data(_data(source))
    assert "\n" not in str(raised.value)


def test_batch_labels_and_dropout_are_a_pure_function_of_position():
    n, seed, null = 23, 5, 7
    images = np.zeros((n, 1, 2, 2), np.uint8)
    labels = (np.arange(n) % 7).astype(np.int32)
    table = ImageTable([images[:10], images[10:]], labels=labels)
    order = SampleOrder(n, seed=seed)

    def step_labels(step: int, world: int, micro: int) -> torch.Tensor:
        parts = []
        for rank in range(world):
            stream = BatchStream(table=table, order=order, global_batch=8, share=rank_share(8, world, rank),
                                 micro_batch=micro, start_step=step, pin_memory=False, noise=(seed, 100),
                                 labels=(0.3, null))
            parts += [b.labels for b in next(stream)]
            stream.close()
        return torch.cat(parts)

    for step in range(3):
        one = step_labels(step, 1, 8)
        assert torch.equal(one, step_labels(step, 2, 3)) and one.dtype == torch.int64
        indices, _ = order.take(step * 8, 8)
        dropped = dropped_labels(seed, step * 8, 8, 0.3)
        expected = torch.from_numpy(labels[indices].astype(np.int64))
        expected[dropped] = null
        assert torch.equal(one, expected)
    plain = BatchStream(table=table, order=order, global_batch=8, share=rank_share(8, 1, 0), micro_batch=8,
                        start_step=0, pin_memory=False, noise=(seed, 100))
    batch = next(plain)[0]
    plain.close()
    assert batch.labels is None and batch.label_inputs(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="needs noise"):
        BatchStream(table=ImageTable([images]), order=order, global_batch=8, share=rank_share(8, 1, 0), micro_batch=8,
                    start_step=0, pin_memory=False, noise=(seed, 100), labels=(0.1, null))


def test_a_prepared_copy_reads_class_names_as_written_spaces_and_all():
    """Class folders "cat " and " " prepared: the copy's names are as written, and memory mode read them trimmed
    ("cat" is no class: every such sample had no label, and training stopped), where stream mode did not."""
    from raydiff.data.labels import LabelPlan

    plan = LabelPlan("prepared", "manifest", column="label", classes=(" ", "cat ", "dog"))
    assert [plan.of_value(name)[0] for name in ("cat ", " ", "dog", b"cat ")] == ["cat ", " ", "dog", "cat "]
    assert plan.of_value("")[0] == ""  # no label
    text = LabelPlan("parquet", "text", column="label")
    assert text.of_value(" cat ")[0] == "cat"  # a user's column: trimmed, as before


def test_class_texts_that_python_calls_digits_but_are_no_numbers_are_names():
    """str.isdigit takes "²", which int() refuses: a ValueError traceback."""
    from raydiff.data.labels import LabelPlan, resolve_classes

    assert resolve_classes(["²", "1"], LabelPlan("cls", "text"), "x") == ("1", "²")
    assert resolve_classes(["10", "2"], LabelPlan("cls", "text"), "x") == tuple(str(i) for i in range(11))


def test_labels_of_a_source_that_is_one_image_file_ask_for_a_folder(tmp_path):
    """Its "root" is the file itself: the line told to put the classes in image.png/<class>/."""
    from raydiff.data.labels import plan_labels

    (path,) = write_synthetic(tmp_path, num=1, resolution=8)
    with pytest.raises(DataError) as refused:
        plan_labels(open_source(str(path)), "label")
    assert str(refused.value) == (f"data.labels = 'auto': data.source = '{path}' is one image file: its class would "
                                  f"be the name of a subfolder of a folder source; give the folder of class "
                                  f"subfolders")


def test_a_source_of_no_usable_sample_is_said_so_even_where_every_one_may_be_bad():
    """With data.max_bad_fraction = 1 the run went on to refuse data.val_images = 0 as "below the number of usable
    images (0)"."""
    from types import SimpleNamespace

    from raydiff.data.errors import BadSample, check_bad_fraction

    store = SimpleNamespace(num_images=2, source="/data", bad=(BadSample(0, "/data/a.png", "not an image"),
                                                               BadSample(1, "/data/b.png", "empty file")))
    with pytest.raises(DataError) as refused:
        check_bad_fraction(store, 1.0)
    assert str(refused.value) == ("none of the 2 samples in /data can be used, e.g. /data/a.png: not an image; "
                                  "/data/b.png: empty file")


def test_a_prepared_shard_cut_short_is_one_line_naming_it_when_its_labels_are_read(tmp_path):
    """Stream mode reads a prepared source's labels on the driver before training: a shard cut short gave pyarrow's
    traceback there (memory mode's read says it in one line)."""
    import pyarrow.fs as pafs

    from raydiff.data.labels import LABEL_COLUMN, read_labels

    files = []
    for n in range(2):
        path = tmp_path / f"part-{n:05d}.parquet"
        pq.write_table(pa.table({LABEL_COLUMN: ["cat", "dog"]}), path)
        files.append(str(path))
    labels = read_labels(pafs.LocalFileSystem(), tuple(files), ("cat", "dog"), str(tmp_path))
    assert labels.tolist() == [0, 1, 0, 1]
    (tmp_path / "part-00001.parquet").write_bytes((tmp_path / "part-00001.parquet").read_bytes()[:40])
    with pytest.raises(DataError, match=rf"^data.source = '{tmp_path}': cannot read {files[1]} \("):
        read_labels(pafs.LocalFileSystem(), tuple(files), ("cat", "dog"), str(tmp_path))
