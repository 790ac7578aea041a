"""python -m raydiff.evaluate on the session's smoke run: results files, agreement with the run's own
measurement and across worker counts, and bad input. Its `main` runs in this process (a driver of the session's
cluster), as `python -m raydiff.evaluate` would run it, to save a process start per call."""

from __future__ import annotations

import json

import pytest

from raydiff import cli
from raydiff.evaluate import main as evaluate_main

pytestmark = pytest.mark.ray


def test_evaluate_matches_the_run_and_never_overwrites(smoke_run, ray_session, capsys):
    run_dir, _ = smoke_run
    args = ["--checkpoint", str(run_dir), "--num", "200", "--steps", "10"]
    assert cli.run(evaluate_main, [*args, "--workers", "1"]) == 0
    assert "step 20, 200 images (ddim, 10 steps, seed 0): digits_fd" in capsys.readouterr().out
    assert cli.run(evaluate_main, [*args, "--workers", "2", "--metrics", "fid,kid"]) == 0
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["20-ddim-10-200-2.json", "20-ddim-10-200.json"]
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["file"] for r in rows] == ["eval/20-ddim-10-200.json", "eval/20-ddim-10-200-2.json"]
    one, two = rows
    assert one == json.loads((run_dir / one["file"]).read_text()) | {"file": one["file"]}
    # Image i is a pure function of (seed, i): one or two workers give the same statistics, and the same images
    # as the run's own evaluation at step 20 (its workers each generated half of them).
    assert two["digits_fd"] == one["digits_fd"] and "digits_kid" in two and "digits_kid" not in one
    in_run = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert one["digits_fd"] == pytest.approx(in_run["digits_fd"], rel=1e-9)
    assert one["digits_coverage"] == in_run["digits_coverage"]
    assert one["reference_images"] == 1797 and one["features"] == "digits-classifier-v2"


@pytest.mark.parametrize("args, fragment", [
    (["--num", "1"], "--num = 1: must be >= 2"),
    (["--metrics", "fid,is"], "--metrics = ['fid', 'is']: must be a list of fid and/or kid"),
    (["--features", "inception", "--weights", "/nonexistent/inception.pth"],
     "--inception_weights = '/nonexistent/inception.pth': no such file"),
    (["--ref", "/nonexistent/stats.npz"], "eval.ref = '/nonexistent/stats.npz': no such file"),
])
def test_bad_input_is_one_line_exit_2(smoke_run, args, fragment, capsys):
    run_dir, _ = smoke_run
    assert cli.run(evaluate_main, ["--checkpoint", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len([line for line in err.splitlines() if line.startswith("raydiff:")]) == 1


def test_missing_run_is_one_line(tmp_path, capsys):
    assert cli.run(evaluate_main, ["--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no such run or checkpoint folder" in capsys.readouterr().err


def test_reference_from_an_npz_or_a_folder(smoke_run, ray_session, capsys, tmp_path):
    """--ref: the run's data.source (cached), the same images as a folder, or their mu/sigma as an .npz give the
    same distance; KID needs features, which an .npz of mu/sigma lacks."""
    import numpy as np

    from raydiff.data.builtin import builtin_folder

    run_dir, _ = smoke_run
    args = ["--checkpoint", str(run_dir), "--num", "100", "--steps", "5"]
    assert cli.run(evaluate_main, args) == 0
    cached = sorted((run_dir.parent / ".raydiff-reference").glob("*.npz"))
    assert cached
    with np.load(cached[0]) as npz:
        np.savez(tmp_path / "digits.npz", mu=npz["mu"], sigma=npz["sigma"])
    assert cli.run(evaluate_main, [*args, "--ref", str(tmp_path / "digits.npz")]) == 0
    assert cli.run(evaluate_main, [*args, "--ref", str(builtin_folder("builtin:digits"))]) == 0
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()][-3:]
    assert rows[0]["digits_fd"] == pytest.approx(rows[1]["digits_fd"], rel=1e-9)
    assert rows[0]["digits_fd"] == pytest.approx(rows[2]["digits_fd"], rel=1e-9)
    assert "digits.npz" in rows[1]["reference"] and rows[2]["reference_images"] == 1797
    capsys.readouterr()
    assert cli.run(evaluate_main, [*args, "--ref", str(tmp_path / "digits.npz"), "--metrics", "kid"]) == 2
    assert "KID needs the reference's features" in capsys.readouterr().err
