"""`python -m raydiff.datasets`: the built-in digits written once into the cache, synthetic images of a chosen size,
format and seed, and a result folder that is taken is refused in one line with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from raydiff import cli
from raydiff.datasets import main


def test_digits_are_written_once_into_the_cache_and_their_folder_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYDIFF_CACHE", str(tmp_path / "cache"))
    assert cli.run(main, ["digits"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.parent == tmp_path / "cache"
    files = sorted(folder.glob("*.png"))
    assert len(files) == 1797 and files[0].name == "0000_digit0.png"
    assert Image.open(files[0]).size == (8, 8) and Image.open(files[0]).mode == "L"
    written = files[0].stat().st_mtime_ns
    assert cli.run(main, ["digits"]) == 0 and files[0].stat().st_mtime_ns == written  # not written again


@pytest.mark.parametrize("fmt", ["png", "jpg"])
def test_synthetic_images_have_the_size_format_and_seed_asked_for(tmp_path, fmt, capsys):
    for out, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert cli.run(main, ["synthetic", str(tmp_path / out), "--num", "5", "--resolution", "12",
                              "--format", fmt, "--seed", str(seed)]) == 0
    assert f"wrote 5 {fmt} images of 12x12 to {tmp_path / 'c'}" in capsys.readouterr().out
    files = {out: sorted((tmp_path / out).iterdir()) for out in "abc"}
    assert [p.name for p in files["a"]] == [f"synthetic_{i:06d}.{fmt}" for i in range(5)]
    assert all(Image.open(p).size == (12, 12) and Image.open(p).mode == "RGB" for p in files["a"])
    assert [p.read_bytes() for p in files["a"]] == [p.read_bytes() for p in files["b"]]
    assert [p.read_bytes() for p in files["a"]] != [p.read_bytes() for p in files["c"]]


def test_a_taken_result_folder_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.png").write_bytes(b"keep")
    (tmp_path / "file").write_text("keep")
    for out in ("taken", "file"):
        assert cli.run(main, ["synthetic", str(tmp_path / out), "--num", "2"]) == 2
        err = capsys.readouterr().err
        assert err == (f"raydiff: error: OUT = '{tmp_path / out}' already exists and is not an empty folder: choose "
                       f"a new folder\n")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.png"]
    assert (tmp_path / "file").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    assert cli.run(main, ["synthetic", str(tmp_path / "empty"), "--num", "2"]) == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--resolution", "3"], "--resolution 3: must be between 8 and 1024"),
    # A run's largest (as raydiff.prepare's): 100000 was killed for its memory, one image of 30 GB.
    (["--resolution", "1025"], "--resolution 1025: must be between 8 and 1024"),
    (["--seed", "-1"], "--seed -1: must be >= 0"),  # numpy's traceback
    (["--num", "0"], "--num 0: must be >= 1"),
])
def test_a_size_seed_or_count_out_of_range_is_refused_in_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        main(["synthetic", str(tmp_path / "out"), "--num", "1", *args])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"raydiff: error: {message} (python -m raydiff.datasets synthetic --help)\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["", " "])
def test_an_empty_result_folder_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys, out):
    # Path("") is "." (an unset shell variable): a traceback in an empty current folder.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["synthetic", out, "--num", "1"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"raydiff: error: OUT = {out!r}: must name a new or empty folder (an empty "
                                       f"value would mean the current folder) (python -m raydiff.datasets synthetic "
                                       f"--help)\n")
    assert list(tmp_path.iterdir()) == []


def test_the_current_folder_empty_is_written_as_any_empty_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.run(main, ["synthetic", ".", "--num", "2"]) == 0
    assert f"to {tmp_path}\n" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["synthetic_000000.png", "synthetic_000001.png"]
