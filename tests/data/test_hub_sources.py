"""hf:// sources (a stand-in for the Hugging Face Hub on loopback, tests/hub_server.py) and glob sources (no Ray)."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydiff.data.builtin import write_synthetic
from raydiff.data.sources import DataError, open_source
from raydiff.storage.rundir import RunDir


def _write_split(folder, name: str, labels: list[int]) -> None:
    """A Parquet file as Hugging Face's `datasets` writes one: images as {bytes, path} structs, a label column."""
    folder.mkdir(parents=True, exist_ok=True)
    images = [{"bytes": f"image {name} {i}".encode(), "path": f"{name}_{i}.png"} for i in range(len(labels))]
    pq.write_table(pa.table({"img": images, "label": labels}), folder / f"{name}.parquet")


@pytest.fixture(scope="module")
def cifar_like(hub_server):
    """Dataset `raydiff-tests/cifar-like`: two train files and a test file side by side, as on the Hub."""
    folder = hub_server.root / "raydiff-tests" / "cifar-like" / "plain_text"
    _write_split(folder, "train-00000-of-00002", [0, 1, 2])
    _write_split(folder, "train-00001-of-00002", [3, 4])
    _write_split(folder, "test-00000-of-00001", [5])
    return "hf://datasets/raydiff-tests/cifar-like/plain_text"


def test_a_glob_picks_one_split_of_a_hub_dataset_and_its_files_read_anywhere(hub_server, cifar_like):
    source = open_source(f"{cifar_like}/train-*.parquet", endpoint=hub_server.endpoint)
    prefix = "datasets/raydiff-tests/cifar-like/plain_text/"
    assert source.kind == "parquet" and source.files == (f"{prefix}train-00000-of-00002.parquet",
                                                         f"{prefix}train-00001-of-00002.parquet")
    assert source.describe() == f"2 Parquet files in {cifar_like}/train-*.parquet"
    filesystem = pickle.loads(pickle.dumps(source.filesystem))  # as a Ray Data task receives it
    table = pq.read_table(source.files[1], filesystem=filesystem)
    assert table.column("label").to_pylist() == [3, 4]
    assert table.column("img").to_pylist()[0]["bytes"] == b"image train-00001-of-00002 0"
    everything = open_source(cifar_like, endpoint=hub_server.endpoint)
    assert len(everything.files) == 3


def test_a_missing_or_private_hub_dataset_is_one_line_that_names_the_token(hub_server, cifar_like):
    for missing in ("hf://datasets/raydiff-tests/no-such-dataset", f"{cifar_like}/validation-*.parquet",
                    f"{cifar_like}/no-such-file.parquet"):
        with pytest.raises(DataError) as info:
            open_source(missing, endpoint=hub_server.endpoint)
        message = str(info.value)
        assert "\n" not in message, message
        assert message == (f"data.source = {missing!r}: " + ("no file matches it" if "*" in missing else
                           "no such file or folder (a private or gated dataset needs a token: HF_TOKEN, or "
                           "`hf auth login`)"))


def test_an_unreachable_hub_is_a_one_line_error():
    from conftest import free_port

    source = "hf://datasets/raydiff-tests/cifar-like"
    with pytest.raises(DataError, match=r"cifar-like'?: cannot read it \(ConnectError: .*refused") as info:
        open_source(source, endpoint=f"http://127.0.0.1:{free_port()}")  # nobody listens
    assert "\n" not in str(info.value)


def test_the_hub_is_a_data_source_only():
    with pytest.raises(ValueError, match=r"hf:// \(the Hugging Face Hub\) is for data.source only"):
        RunDir("hf://datasets/raydiff-tests/runs")


def test_a_glob_selects_files_part_for_part_in_a_folder_too(tmp_path):
    write_synthetic(tmp_path / "train", num=3, resolution=8, fmt="png")
    write_synthetic(tmp_path / "train" / "deeper", num=2, resolution=8, fmt="png")
    write_synthetic(tmp_path / "test", num=2, resolution=8, fmt="png")
    source = open_source(str(tmp_path / "t*" / "*.png"))  # a `*` never crosses a `/`: not train/deeper/
    assert [f.rsplit("/", 2)[1] for f in source.files] == ["test"] * 2 + ["train"] * 3
    assert source.files == tuple(sorted(source.files)) and source.root == str(tmp_path)
    assert len(open_source(str(tmp_path / "train" / "**" / "*.png")).files) == 2  # `**` is one part, like `*`
