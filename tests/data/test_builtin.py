from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raydiff import cli
from raydiff import datasets as datasets_cli
from raydiff.data import builtin
from raydiff.data.errors import DataError
from raydiff.data.sources import open_source

ADVICE = "point it at a folder raydiff may write, or unset it"


def test_digits_are_written_once_as_png(tmp_path):
    folder = builtin.digits_folder()
    files = sorted(folder.glob("*.png"))
    assert len(files) == 1797
    image = Image.open(files[0])
    assert image.size == (8, 8) and image.mode == "L"
    assert builtin.digits_folder() == folder  # cached
    assert folder.parent == builtin.cache_dir()


@pytest.mark.parametrize("fmt, resolution", [("png", 32), ("jpg", 48), ("png", 7)])
def test_synthetic_images(tmp_path, fmt, resolution):
    paths = builtin.write_synthetic(tmp_path, num=5, resolution=resolution, fmt=fmt, seed=1)
    assert [p.suffix for p in paths] == [f".{fmt}"] * 5
    image = Image.open(paths[0])
    assert image.size == (resolution, resolution) and image.mode == "RGB"
    again = builtin.write_synthetic(tmp_path / "again", num=5, resolution=resolution, fmt=fmt, seed=1)
    assert np.array_equal(np.asarray(Image.open(again[3])), np.asarray(Image.open(paths[3])))


def test_synthetic_cli(tmp_path):
    assert datasets_cli.main(["synthetic", str(tmp_path / "s"), "--num", "3", "--resolution", "16"]) == 0
    assert len(list(Path(tmp_path / "s").glob("*.png"))) == 3


def _refused_in_one_line(capsys) -> str:
    assert cli.run(datasets_cli.main, ["digits"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_cache_variable_naming_a_file_is_one_line_naming_it_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "good.txt").write_text("not a folder")
    monkeypatch.setenv("RAYDIFF_CACHE", str(tmp_path / "good.txt"))  # was: FileExistsError, a traceback
    assert _refused_in_one_line(capsys) == (f"raydiff: error: RAYDIFF_CACHE = '{tmp_path / 'good.txt'}': not a folder "
                                            f"(a file is there); {ADVICE}")
    monkeypatch.setenv("RAYDIFF_CACHE", str(tmp_path / "good.txt" / "cache"))  # was: NotADirectoryError
    assert _refused_in_one_line(capsys) == (f"raydiff: error: RAYDIFF_CACHE = '{tmp_path / 'good.txt' / 'cache'}': "
                                            f"not a folder ({tmp_path / 'good.txt'} is a file); {ADVICE}")
    assert [p.name for p in tmp_path.iterdir()] == ["good.txt"] and (tmp_path / "good.txt").read_text() == \
        "not a folder"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
def test_a_cache_variable_where_no_folder_can_be_made_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("RAYDIFF_CACHE", "/proc/raydiff-nope")  # was: the OSError's text, never naming the variable
    assert _refused_in_one_line(capsys) == (f"raydiff: error: RAYDIFF_CACHE = '/proc/raydiff-nope': cannot make the "
                                            f"folder (no such file or directory); {ADVICE}")


def test_a_cache_variable_with_an_unknown_users_home_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("RAYDIFF_CACHE", "~raydiff-no-such-user/cache")  # was: RuntimeError, a traceback
    assert _refused_in_one_line(capsys) == (f"raydiff: error: RAYDIFF_CACHE = '~raydiff-no-such-user/cache': its ~ "
                                            f"names no home folder on this machine; {ADVICE}")


def test_a_training_source_of_the_digits_names_the_cache_variable_too(tmp_path, monkeypatch):
    """data.source = builtin:digits (train, prepare) writes the digits the same way: the same line, after the
    source it is for."""
    (tmp_path / "good.txt").write_text("")
    monkeypatch.setenv("RAYDIFF_CACHE", str(tmp_path / "good.txt"))
    with pytest.raises(DataError) as refused:
        open_source("builtin:digits")
    assert str(refused.value) == (f"data.source = 'builtin:digits': RAYDIFF_CACHE = '{tmp_path / 'good.txt'}': not a "
                                  f"folder (a file is there); {ADVICE}")


def test_a_default_cache_folder_that_cannot_be_made_says_which_variable_to_set(tmp_path, monkeypatch):
    (tmp_path / "xdg").write_text("")
    monkeypatch.delenv("RAYDIFF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(DataError, match=r"^the cache folder .*/xdg/raydiff: not a folder \(.*/xdg is a file\); set "
                                        r"RAYDIFF_CACHE to a folder raydiff may write$"):
        builtin.digits_folder()
