"""hf:// sources (a stand-in for the Hugging Face Hub on loopback, tests/hub_server.py) and glob sources (no Ray)."""

from __future__ import annotations

import pickle
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydiff.data.builtin import write_synthetic
from raydiff.data.hub_splits import glob_of, splits_of, train_split
from raydiff.data.labels import plan_labels
from raydiff.data.sources import DataError, open_source
from raydiff.storage.fs import glob_match
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


def test_a_hub_datasets_folder_trains_on_its_train_split_and_says_so(hub_server, cifar_like):
    prefix = "datasets/raydiff-tests/cifar-like/plain_text/"
    for folder in (cifar_like, cifar_like.rsplit("/", 1)[0]):  # the split's folder, and the repository's root
        source = open_source(folder, endpoint=hub_server.endpoint)
        assert source.files == (f"{prefix}train-00000-of-00002.parquet", f"{prefix}train-00001-of-00002.parquet")
        assert source.split == "train"
        assert source.describe() == f"2 Parquet files in {folder} (its train split)"
    one_file = open_source(f"{cifar_like}/test-00000-of-00001.parquet", endpoint=hub_server.endpoint)
    assert one_file.split == "" and len(one_file.files) == 1  # a file or a glob is taken as named


def test_images_in_a_hub_datasets_split_folders_keep_their_classes(hub_server):
    repo = hub_server.root / "raydiff-tests" / "pets"
    for split, kind, num in (("train", "cat", 2), ("train", "dog", 1), ("test", "cat", 1)):
        write_synthetic(repo / "data" / split / kind, num=num, resolution=8)
    source = open_source("hf://datasets/raydiff-tests/pets", endpoint=hub_server.endpoint)
    assert source.split == "train" and len(source.files) == 3
    assert source.root == "datasets/raydiff-tests/pets/data/train"
    plan = plan_labels(source, "label")
    assert [plan.of_path(f)[0] for f in source.files] == ["cat", "cat", "dog"]  # not "train"


def test_images_in_class_folders_of_a_hub_dataset_without_splits_keep_their_classes(hub_server):
    """`data/cat/0.png`, `data/dog/1.png` and no split named: the classes are the images' folders, as Hugging
    Face's `datasets` reads them; the repository's root made one class of them all, `data`."""
    repo = hub_server.root / "raydiff-tests" / "pets-whole"
    for kind, num in (("cat", 2), ("dog", 1)):
        write_synthetic(repo / "data" / kind, num=num, resolution=8)
    source = open_source("hf://datasets/raydiff-tests/pets-whole", endpoint=hub_server.endpoint)
    assert source.split == "" and source.root == "datasets/raydiff-tests/pets-whole/data"
    plan = plan_labels(source, "label")
    assert [plan.of_path(f)[0] for f in source.files] == ["cat", "cat", "dog"]
    flat = hub_server.root / "raydiff-tests" / "flat"
    write_synthetic(flat, num=2, resolution=8)  # images in the root: no class folders, the root as before
    assert open_source("hf://datasets/raydiff-tests/flat", endpoint=hub_server.endpoint).root == \
        "datasets/raydiff-tests/flat"


def test_a_hub_dataset_without_a_train_split_is_refused_in_one_line(hub_server):
    folder = hub_server.root / "raydiff-tests" / "eval-only"
    _write_split(folder / "data", "validation", [0])
    _write_split(folder / "data", "test-en", [1])
    _write_split(folder / "data", "test-fr", [2])
    _write_split(folder / "other", "test-de", [3])
    source = "hf://datasets/raydiff-tests/eval-only"
    with pytest.raises(DataError) as info:
        open_source(f"{source}/data", endpoint=hub_server.endpoint)
    assert str(info.value) == (
        f"data.source = '{source}/data' holds several splits and no train split (test: 2 files, e.g. "
        f"test-en.parquet; validation: 1 file, e.g. validation.parquet): name the files of one with a glob, e.g. "
        f"{source}/data/test*.parquet")
    alone = open_source(f"{source}/other", endpoint=hub_server.endpoint)  # one split is the dataset
    assert alone.split == "test" and alone.describe().endswith("(its test split)")


def test_a_hub_dataset_of_files_raydiff_does_not_read_is_one_line_that_names_its_parquet_conversion(hub_server):
    """A dataset of .zip or .csv files (many older ones), or a card's data_dir with none of the kind chosen, raised
    commonpath()'s ValueError."""
    repo = hub_server.root / "raydiff-tests" / "zipped"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "images.zip").write_bytes(b"PK")
    source = "hf://datasets/raydiff-tests/zipped"
    with pytest.raises(DataError) as info:
        open_source(source, endpoint=hub_server.endpoint)
    assert str(info.value) == (
        f"data.source = '{source}': no image files found (looked for .jpg, .jpeg, .png, .webp, .bmp); the Hub's "
        f"Parquet conversion of a dataset of other files is at "
        f"hf://datasets/OWNER/NAME@refs%2Fconvert%2Fparquet/CONFIG")
    write_synthetic(repo, num=1, resolution=8)  # a preview image beside; the card's data_dir holds no image
    _card(repo, "configs:\n- config_name: default\n  data_dir: data\n")
    with pytest.raises(DataError, match=r"no image files found"):
        open_source(source, endpoint=hub_server.endpoint)


def test_a_split_in_several_folders_is_refused_as_several_datasets(hub_server):
    repo = hub_server.root / "raydiff-tests" / "subsets"
    for subset in ("digits", "fashion"):
        _write_split(repo / subset, "train-00000-of-00001", [0, 1])
        _write_split(repo / subset, "test-00000-of-00001", [2])
    source = "hf://datasets/raydiff-tests/subsets"
    with pytest.raises(DataError) as info:
        open_source(source, endpoint=hub_server.endpoint)
    assert str(info.value) == (f"data.source = {source!r}: its train split lies in several folders, subsets of the "
                               f"dataset (digits: 1 file; fashion: 1 file): name one, e.g. {source}/digits")
    one = open_source(f"{source}/fashion", endpoint=hub_server.endpoint)
    assert one.split == "train" and one.files == (f"{one.root}/train-00000-of-00001.parquet",)
    assert one.root == "datasets/raydiff-tests/subsets/fashion"


def _card(repo, configs: str) -> None:
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text(f"---\nlicense: mit\n{configs}---\n\n# A dataset card\n")


def test_a_datasets_card_names_its_train_files_where_names_alone_would_not(hub_server):
    """The card's YAML `configs:` first, as `datasets.load_dataset(name)` reads it: here its train files have no
    split in their names, and a folder named `test` holds files the card does not name at all."""
    repo = hub_server.root / "raydiff-tests" / "carded"
    _write_split(repo / "images", "part-a", [0, 1])
    _write_split(repo / "images", "part-b", [2])
    _write_split(repo / "held-out", "part-c", [3])
    _write_split(repo / "test", "unrelated", [4])
    _card(repo, "configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: images/*.parquet\n"
                "  - split: test\n    path: [held-out/*.parquet]\n")
    source = open_source("hf://datasets/raydiff-tests/carded", endpoint=hub_server.endpoint)
    prefix = "datasets/raydiff-tests/carded/"
    assert source.files == (f"{prefix}images/part-a.parquet", f"{prefix}images/part-b.parquet")
    assert source.split == "train" and source.root == "datasets/raydiff-tests/carded/images"
    assert source.describe() == "2 Parquet files in hf://datasets/raydiff-tests/carded (its train split)"


def test_a_preview_image_beside_a_carded_dataset_s_parquet_files_leaves_the_card_to_decide(hub_server):
    """Many Hub repositories hold a banner or preview image beside their data: "holds several kinds of files"
    refused them, though the card names the train files."""
    repo = hub_server.root / "raydiff-tests" / "with-banner"
    _write_split(repo / "data", "train-00000-of-00001", [0, 1])
    _write_split(repo / "data", "test-00000-of-00001", [2])
    write_synthetic(repo, num=1, resolution=8)  # an image at the repository's root
    _card(repo, "configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n")
    source = open_source("hf://datasets/raydiff-tests/with-banner", endpoint=hub_server.endpoint)
    assert source.kind == "parquet" and source.split == "train"
    assert source.files == ("datasets/raydiff-tests/with-banner/data/train-00000-of-00001.parquet",)
    _card(repo, "license: mit\n")  # no configs: the card cannot decide, and the line says what to set
    with pytest.raises(DataError, match=r"holds several kinds of files \(1 images, 2 parquet\): set data.format"):
        open_source("hf://datasets/raydiff-tests/with-banner", endpoint=hub_server.endpoint)


def test_images_in_the_split_folder_a_card_names_keep_their_classes(hub_server):
    repo = hub_server.root / "raydiff-tests" / "carded-pets"
    for split, kind, num in (("train", "cat", 2), ("train", "dog", 1), ("test", "cat", 1)):
        write_synthetic(repo / split / kind, num=num, resolution=8)
    _card(repo, "configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train/**\n"
                "  - split: test\n    path: test/**\n")
    source = open_source("hf://datasets/raydiff-tests/carded-pets", endpoint=hub_server.endpoint)
    assert source.split == "train" and len(source.files) == 3
    assert source.root == "datasets/raydiff-tests/carded-pets/train"
    plan = plan_labels(source, "label")
    assert [plan.of_path(f)[0] for f in source.files] == ["cat", "cat", "dog"]  # not "train", as without a card


@pytest.mark.parametrize(("configs", "files"), [
    ("configs:\n- config_name: default\n  data_files: one/*.parquet\n", ["one/a.parquet"]),  # a string: train
    ("configs:\n- config_name: default\n  data_files:\n  - one/*.parquet\n  - two/*.parquet\n",
     ["one/a.parquet", "two/b.parquet"]),
    ("configs:\n- config_name: small\n  data_files:\n  - split: train\n    path: two/*\n"
     "- config_name: large\n  default: true\n  data_files:\n  - split: train\n    path: '**/*.parquet'\n",
     ["one/a.parquet", "three/deep/c.parquet", "two/b.parquet"]),  # the default one; ** crosses folders
    ("configs:\n- config_name: only\n  data_dir: three\n", ["three/deep/c.parquet"]),  # its folder, by names
    ("configs:\n- config_name: default\n  data_dir: three\n  data_files: deep/*\n", ["three/deep/c.parquet"]),
    ("configs:\n- config_name: default\n  data_files:\n  - split: validation\n    path: two/*\n",
     ["two/b.parquet"]),  # its only split
    ("dataset_info:\n  features: []\n", ["one/a.parquet", "three/deep/c.parquet", "two/b.parquet"]),  # no configs
])
def test_the_card_s_default_config_gives_its_train_split(hub_server, configs, files):
    name = f"card-{abs(hash(configs)) % 10**8}"  # a repository each: the Hub's listing is cached per process
    repo = hub_server.root / "raydiff-tests" / name
    _write_split(repo / "one", "a", [0])
    _write_split(repo / "two", "b", [1])
    _write_split(repo / "three" / "deep", "c", [2])
    _card(repo, configs)
    source = open_source(f"hf://datasets/raydiff-tests/{name}", endpoint=hub_server.endpoint)
    assert [f.removeprefix(f"datasets/raydiff-tests/{name}/") for f in source.files] == files


@pytest.mark.parametrize(("configs", "error"), [
    ("configs:\n- config_name: digits\n  data_files: one/*.parquet\n- config_name: fashion\n  data_files: "
     "[two/*.parquet]\n", "its card names several configs (digits, fashion) and none is the default: name the "
     "files of one, e.g. hf://datasets/raydiff-tests/{name}/one/*.parquet"),
    ("configs:\n- config_name: default\n  data_files:\n  - split: test\n    path: one/*\n  - split: dev\n"
     "    path: two/*\n", "its card's config 'default' has the splits dev, test and no train split: name the files "
     "of one, e.g. hf://datasets/raydiff-tests/{name}/two/*"),
    ("configs:\n- config_name: default\n  data_files: nowhere/*.parquet\n", "its card's train split "
     "(nowhere/*.parquet) matches none of its Parquet files"),
    ("configs: [unclosed\n", "its card (README.md) has a YAML header that does not parse"),
    ("configs:\n- data_files: 5\n", "its card's configs are not what the Hub documents"),
])
def test_a_card_that_does_not_say_one_train_split_is_a_one_line_error(hub_server, configs, error):
    name = f"bad-card-{abs(hash(configs)) % 10**8}"
    repo = hub_server.root / "raydiff-tests" / name
    _write_split(repo / "one", "a", [0])
    _write_split(repo / "two", "b", [1])
    _card(repo, configs)
    with pytest.raises(DataError) as info:
        open_source(f"hf://datasets/raydiff-tests/{name}", endpoint=hub_server.endpoint)
    assert str(info.value).startswith(f"data.source = 'hf://datasets/raydiff-tests/{name}': "
                                      f"{error.format(name=name)}"), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("files", "found"), [
    (["r/train/a/0.png", "r/train/b/1.png", "r/test/a/2.png"], (["r/train/a/0.png", "r/train/b/1.png"], "r/train")),
    (["r/x/train/0.png", "r/y/train/1.png"], "its train split lies in several folders, subsets of the dataset "
                                             "(x: 1 file; y: 1 file): name one, e.g. hf://d/x"),
    (["r/train-0.tar", "r/more/train-1.tar"], "(.: 1 file; more: 1 file): name one, e.g. hf://d/train*.tar"),
    (["r/a/0.parquet", "r/b/1.parquet"], (["r/a/0.parquet", "r/b/1.parquet"], "r")),  # no split: the folder as it is
])
def test_the_train_split_is_one_folders_files(files, found):
    if isinstance(found, str):
        with pytest.raises(DataError, match=re.escape(found)):
            train_split("hf://d", files, "r")
    else:
        chosen, _, root = train_split("hf://d", files, "r")
        assert (chosen, root) == found


@pytest.mark.parametrize(("paths", "splits"), [
    # The examples of https://huggingface.co/docs/hub/datasets-file-names-and-splits
    (["data.csv"], {}),
    (["train.csv", "test.csv", "validation.csv"], {"train": ["train.csv"], "test": ["test.csv"],
                                                  "validation": ["validation.csv"]}),
    (["my_train_file.csv", "test-file.csv", "validation1.csv", "testfile.csv"],
     {"train": ["my_train_file.csv"], "test": ["test-file.csv"], "validation": ["validation1.csv"]}),
    (["data/train/0.csv", "data/test/0.csv", "data/train.csv"], {"train": ["data/train/0.csv"],
                                                                 "test": ["data/test/0.csv"]}),
    (["training.csv", "dev.csv", "eval.csv"], {"train": ["training.csv"], "validation": ["dev.csv"],
                                               "test": ["eval.csv"]}),
    (["data/random-00000-of-00002.parquet", "data/random-00001-of-00002.parquet", "data/train.parquet"],
     {"random": ["data/random-00000-of-00002.parquet", "data/random-00001-of-00002.parquet"]}),
    (["imagenet1k-train-0000.tar", "imagenet1k-train-0001.tar", "imagenet1k-validation-00.tar"],  # WebDataset
     {"train": ["imagenet1k-train-0000.tar", "imagenet1k-train-0001.tar"],
      "validation": ["imagenet1k-validation-00.tar"]}),
    (["retrain.csv", "trains/a.csv", "contest.csv"], {}),  # a keyword inside a word is no split
])
def test_splits_are_told_from_names_as_the_hub_tells_them(paths, splits):
    assert splits_of(paths) == splits
    for split, found in splits.items():  # the glob an error suggests picks the split's example and its kin
        assert glob_match(found[0], glob_of(found[0], split)), (found[0], glob_of(found[0], split))


def test_the_suggested_glob_keeps_the_examples_shape():
    assert glob_of("plain_text/test-00000-of-00001.parquet", "test") == "plain_text/test*.parquet"
    assert glob_of("data/test/deeper/0.parquet", "test") == "data/test*/*/*.parquet"
    assert glob_of("data/my_eval_set.parquet", "test") == "data/my_eval*.parquet"
    assert glob_of("data/random-00000-of-00002.parquet", "random") == "data/random*.parquet"


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


@pytest.mark.parametrize("source", ["hf://", "hf://datasets", "hf://datasets/uoft-cs", "hf://datasets//cifar10",
                                    "hf://uoft-cs/cifar10", "hf://models/owner/name", "hf://datasets/@main/x"])
def test_a_hub_uri_not_naming_a_dataset_is_a_one_line_error(hub_server, source):
    with pytest.raises(DataError) as info:
        open_source(source, endpoint=hub_server.endpoint)
    assert str(info.value) == (f"data.source = {source!r}: a Hugging Face Hub source is "
                               f"hf://datasets/OWNER/NAME[@REVISION][/PATH]")


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
    assert len(open_source(str(tmp_path / "train" / "**" / "*.png")).files) == 5  # `**`: any number of folders


def test_a_glob_that_names_folders_picks_the_files_in_them(tmp_path):
    """`imgs/2026-*` found "no file matches it": only files were matched, so a folder glob needed `/*.jpg`."""
    for month in ("2026-01", "2026-02", "2025-12"):
        write_synthetic(tmp_path / "imgs" / month, num=2, resolution=8, fmt="png")
    write_synthetic(tmp_path / "imgs" / "2026-02" / "late", num=1, resolution=8, fmt="png")
    source = open_source(str(tmp_path / "imgs" / "2026-*"))
    assert sorted({f.split("/imgs/")[1].split("/")[0] for f in source.files}) == ["2026-01", "2026-02"]
    assert len(source.files) == 5  # a folder's files, in its subfolders too, as the folder given as it is
    with pytest.raises(DataError, match="no file matches it"):
        open_source(str(tmp_path / "imgs" / "2027-*"))
