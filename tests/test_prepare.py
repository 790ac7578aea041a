"""Decode once: prepare -> train round trips (local and S3), a messy folder that trains and reports, and a split of a
Hugging Face Hub dataset that trains."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, write_messy_folder

pytestmark = pytest.mark.ray

# One worker: what these tests look at (decoding, skipping, preparing, streaming from a bucket) happens before or
# beside the workers; two workers cost each run one more process start-up.
TINY = ["--config", "smoke", "--set", "data.channels=3", "--set", "train.total_steps=10",
        "--set", "train.sample_every=0", "--set", "scaling.num_workers=1"]


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("messy")
    return folder, write_messy_folder(folder)


def summary_of(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_messy_folder_trains_to_completion_and_reports_its_bad_files(messy, tmp_path):
    folder, names = messy
    proc = run_cli("raydiff.train", *TINY, "--set", f"data.source={folder}", "--set", f"run.storage={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "44 images from 48 image files" in proc.stdout and "4 skipped as unusable" in proc.stdout
    run = summary_of(tmp_path / "smoke")
    assert run["status"] == "finished" and run["bad_images"]["count"] == 4
    assert run["bad_images"]["fraction"] == pytest.approx(4 / 48, abs=1e-4)
    listed = json.loads((tmp_path / "smoke" / "bad_images.json").read_text())
    assert sorted(b["where"].rsplit("/", 1)[1] for b in listed) == sorted(names["bad"])
    assert all(b["reason"] for b in listed)

    strict = run_cli("raydiff.train", *TINY, "--set", f"data.source={folder}", "--set", f"run.storage={tmp_path}",
                     "--set", "run.name=strict", "--set", "data.max_bad_fraction=0.05")
    assert strict.returncode == 2 and strict.stderr.count("\n") == 1, strict.stderr
    assert "4 of 48 samples" in strict.stderr and "data.max_bad_fraction = 0.05" in strict.stderr
    assert not (tmp_path / "strict").exists()


@pytest.mark.slow
def test_prepare_then_train_on_the_prepared_folder(messy, tmp_path):
    folder, _ = messy
    out = tmp_path / "prepared"
    proc = run_cli("raydiff.prepare", str(folder), str(out), "--resolution", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prepared 44 images at 8px" in proc.stdout and "4 unusable sample(s) skipped" in proc.stdout
    # raydiff's lines, not Ray Data's INFO log of its execution plan.
    assert "streaming_executor" not in proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["count"] == 44 and manifest["resolution"] == 8 and manifest["channels"] == 3
    assert len(manifest["bad"]) == 4 and manifest["shards"] == ["part-00000.parquet"]
    assert manifest["version"] == 3 and "classes" not in manifest  # prepared without labels
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepared")]  # no temporary left behind

    again = run_cli("raydiff.prepare", str(folder), str(out), "--resolution", "8")
    assert again.returncode == 2 and "already exists and is not an empty folder: choose a new folder" in again.stderr

    train = run_cli("raydiff.train", *TINY, "--set", f"data.source={out}", "--set", f"run.storage={tmp_path}")
    assert train.returncode == 0, train.stderr[-3000:]
    assert "44 images from 1 prepared shard in" in train.stdout
    run = summary_of(tmp_path / "smoke")
    assert run["status"] == "finished" and run["bad_images"]["count"] == 0

    wrong = run_cli("raydiff.train", *TINY, "--set", f"data.source={out}", "--set", "data.channels=1",
                    "--set", f"run.storage={tmp_path}", "--set", "run.name=wrong")
    assert wrong.returncode == 2 and "was prepared at 8px with 3 channel(s)" in wrong.stderr


@pytest.mark.slow
def test_s3_source_prepare_and_train_against_a_loopback_server(s3_server, tmp_path):
    from raydiff.data.builtin import write_synthetic

    endpoint, client = s3_server
    client.create_bucket(Bucket="raydiff-data")
    for path in write_synthetic(tmp_path / "images", num=30, resolution=16, fmt="jpg"):
        client.upload_file(str(path), "raydiff-data", f"raw/{path.name}")
    proc = run_cli("raydiff.prepare", "s3://raydiff-data/raw", "s3://raydiff-data/prepared", "--resolution", "8",
                   "--endpoint", endpoint)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prepared 30 images at 8px from 30 image files in s3://raydiff-data/raw" in proc.stdout
    objects = client.list_objects_v2(Bucket="raydiff-data", Prefix="prepared/")["Contents"]
    keys = sorted(o["Key"] for o in objects if not o["Key"].endswith("/"))  # "prepared/": a folder marker
    assert keys == ["prepared/manifest.json", "prepared/part-00000.parquet"]

    for source, cache in (("s3://raydiff-data/raw", "memory"), ("s3://raydiff-data/prepared", "stream")):
        name = source.rsplit("/", 1)[1]
        train = run_cli("raydiff.train", *TINY, "--set", f"data.source={source}", "--set", f"data.endpoint={endpoint}",
                        "--set", f"run.storage={tmp_path}", "--set", f"run.name={name}", "--set", f"data.cache={cache}")
        assert train.returncode == 0, train.stderr[-3000:]
        assert summary_of(tmp_path / name)["status"] == "finished"
    assert "streamed from s3://raydiff-data/prepared: 1 shards" in train.stdout  # read from S3 by the node cache

    missing = run_cli("raydiff.train", *TINY, "--set", "data.source=s3://raydiff-data/nothing",
                      "--set", f"data.endpoint={endpoint}", "--set", f"run.storage={tmp_path}")
    assert missing.returncode == 2 and "s3://raydiff-data/nothing': no such file or folder" in missing.stderr


def test_prepare_refuses_a_parquet_file_without_its_footer_in_one_line_before_ray_starts(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydiff import cli, prepare
    from raydiff.data.builtin import write_synthetic

    (tmp_path / "data").mkdir()
    pngs = write_synthetic(tmp_path / "images", num=2, resolution=8)
    pq.write_table(pa.table({"image": [p.read_bytes() for p in pngs]}), tmp_path / "data" / "a.parquet")
    (tmp_path / "data" / "b.parquet").write_bytes(b"PAR1 cut short")  # the second file: not the one schemas come from
    out = tmp_path / "prepared"
    assert cli.run(prepare.main, [str(tmp_path / "data"), str(out), "--resolution", "8"]) == 2
    err = capsys.readouterr().err
    assert err == (f"raydiff: error: data.source = {str(tmp_path / 'data')!r}: cannot read {tmp_path / 'data'}/"
                   f"b.parquet (Parquet magic bytes not found in footer. Either the file is corrupted or this is not a "
                   f"parquet file.)\n")
    assert not out.exists()


def test_prepare_refuses_an_occupied_out_in_one_line_before_ray_starts(tmp_path, capsys, monkeypatch):
    from raydiff import cli, prepare
    from raydiff.cluster import start
    from raydiff.data.builtin import write_synthetic

    def no_ray():
        raise AssertionError("Ray started")

    monkeypatch.setattr(start, "init_ray", no_ray)
    write_synthetic(tmp_path / "images", num=2, resolution=8)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    assert cli.run(prepare.main, [str(tmp_path / "images"), str(tmp_path / "out"), "--resolution", "8"]) == 2
    assert capsys.readouterr().err == (f"raydiff: error: OUT = {str(tmp_path / 'out')!r} already exists and is not "
                                       f"an empty folder: choose a new folder\n")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_a_source_file_prepare_may_not_read_is_told_as_the_sources_not_out(tmp_path, capsys, monkeypatch):
    """The source's own one line (a file of it this user may not read): it was told as OUT's write failing,
    'make it writable or set another OUT', of an OUT that was fine."""
    from raydiff import cli, prepare
    from raydiff.cluster import start
    from raydiff.data import image_store
    from raydiff.data.builtin import write_synthetic
    from raydiff.data.errors import DataError

    def unreadable(source, **kwargs):
        try:
            raise PermissionError(13, "Permission denied", "images/0001.png")
        except PermissionError as exc:
            raise DataError("data.source = 'images': a file of it cannot be read (PermissionError: [Errno 13] "
                            "Permission denied: 'images/0001.png')") from exc
        yield  # a generator, as decode_stream is

    monkeypatch.setattr(start, "init_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(image_store, "decode_stream", unreadable)
    write_synthetic(tmp_path / "images", num=2, resolution=8)
    assert cli.run(prepare.main, [str(tmp_path / "images"), str(tmp_path / "out"), "--resolution", "8"]) == 2
    assert capsys.readouterr().err == ("raydiff: error: data.source = 'images': a file of it cannot be read "
                                       "(PermissionError: [Errno 13] Permission denied: 'images/0001.png')\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_hub_dataset_trains_on_its_train_split_from_its_hf_uri(hub_server, tmp_path):
    """As `--set data.source=hf://datasets/uoft-cs/cifar10` trains on CIFAR-10's training split: Parquet files as
    Hugging Face's `datasets` writes them, beside the test split's, read over HTTP by every process, their images
    found by the files' `Image` feature and their classes named by its `ClassLabel`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydiff.data.builtin import write_synthetic

    folder = hub_server.root / "raydiff-tests" / "synthetic" / "plain_text"
    folder.mkdir(parents=True)
    pngs = write_synthetic(tmp_path / "images", num=30, resolution=16, fmt="png")
    features = {"img": {"_type": "Image"}, "label": {"names": ["cat", "dog", "frog"], "_type": "ClassLabel"}}
    for name, part in (("train-00000-of-00002", pngs[:12]), ("train-00001-of-00002", pngs[12:24]),
                       ("test-00000-of-00001", pngs[24:])):
        images = [{"bytes": p.read_bytes(), "path": p.name} for p in part]
        table = pa.table({"img": images, "label": [i % 3 for i in range(len(part))]})
        pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
                       folder / f"{name}.parquet")
    source = "hf://datasets/raydiff-tests/synthetic"
    train = run_cli("raydiff.train", *TINY, "--set", f"data.source={source}",
                    "--set", f"data.endpoint={hub_server.endpoint}", "--set", "data.labels=auto",
                    "--set", "model.num_classes=auto", "--set", f"run.storage={tmp_path}", "--set", "run.name=hub")
    assert train.returncode == 0, train.stderr[-3000:]
    assert summary_of(tmp_path / "hub")["status"] == "finished"
    assert f"24 images from 2 Parquet files in {source} (its train split)" in train.stdout, train.stdout[-3000:]
    assert "class-conditional on 3 classes" in train.stdout
    assert "data.image_column: 'image' is not a column of hf://datasets/raydiff-tests/synthetic; reading 'img'" in (
        train.stdout)
    assert json.loads((tmp_path / "hub" / "data.json").read_text())["classes"] == ["cat", "dog", "frog"]
    read = [path for method, path in hub_server.requests if "/resolve/" in path]
    assert any("train-00001-of-00002" in path for path in read) and not any("test-" in path for path in read)


@pytest.mark.parametrize(("args", "line"), [
    (["--image-column", ""], "--image-column '': must name a column"),
    (["--label-column", ""], "--label-column '': must name a column"),
    (["--endpoint", "foo"], "--endpoint 'foo': must be a URL such as http://127.0.0.1:9000"),
])
def test_prepare_refuses_what_the_config_refuses_in_one_line_before_reading_anything(tmp_path, capsys, args, line):
    """An empty image column and an endpoint without a scheme were taken (the config refuses both), and the whole
    source prepared."""
    from raydiff import cli, prepare

    with pytest.raises(SystemExit) as refused:
        cli.run(prepare.main, ["builtin:digits", str(tmp_path / "out"), "--resolution", "8", *args])
    assert refused.value.code == 2
    assert capsys.readouterr().err == f"raydiff: error: {line} (python -m raydiff.prepare --help)\n"
    assert not (tmp_path / "out").exists()
