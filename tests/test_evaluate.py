"""python -m raydiff.evaluate on the session's smoke run: results files, agreement with the run's own
measurement and across worker counts, and bad input; and on class-conditional checkpoints built here: one result
per guidance, the digits' class match, and the same numbers from the in-run evaluation. Its `main` runs in this
process (a driver of the session's cluster), as `python -m raydiff.evaluate` would run it, to save a process start
per call."""

from __future__ import annotations

import json
import math
import signal
import threading

import pytest
from conftest import run_cli_acting, run_cli_interrupted, write_posthoc_run

from raydiff import cli
from raydiff.evaluate import main as evaluate_main

pytestmark = pytest.mark.ray

DIGIT_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 0]  # no nines: never asked for


def write_checkpoint(storage, *, classes: dict | None, step: int = 7, overrides: tuple[str, ...] = ()):
    """A checkpoint folder of a tiny smoke-preset model (random weights), class-conditional when `classes` is
    given ({"names", "counts"}), as training writes it, of the config with `overrides`; returns (its folder, the
    config)."""
    import torch

    from raydiff.config import load_config
    from raydiff.model.unet import build_model
    from raydiff.runs.checkpoint import write_state

    conditional = ["data.labels=auto", f"model.num_classes={len(classes['names'])}"] if classes else []
    cfg = load_config("smoke", [*conditional, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():  # the zero-initialised output layers would make every image the same
        torch.nn.init.normal_(p, std=0.05)
    state = {"step": step, "config": cfg.to_dict(), "ema": model.state_dict(), "model": model.state_dict()}
    if classes:
        state["classes"] = classes
    folder = storage / "run" / f"checkpoint_{step:06d}"
    folder.mkdir(parents=True)
    write_state(folder, state)
    return folder, cfg


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


def test_autoguidance_by_an_earlier_checkpoint_gives_one_result_per_weight(smoke_run, ray_session, capsys):
    """--guide: the run's step-10 checkpoint guides its step-20 one, one result per weight; at W = 1 the model
    alone, the numbers of the unguided evaluation."""
    run_dir, _ = smoke_run
    args = ["--checkpoint", str(run_dir / "checkpoint_00000020"), "--num", "200", "--steps", "10", "--seed", "3"]
    assert cli.run(evaluate_main, [*args, "--guide", str(run_dir / "checkpoint_00000010"), "--guidance", "1,2"]) == 0
    out = capsys.readouterr()
    assert "autoguidance 1,2 by " in out.err
    assert "step 20, 200 images (ddim, 10 steps, seed 3, autoguidance 2)" in out.out
    assert cli.run(evaluate_main, args) == 0
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if '"seed": 3' in line]
    guided_1, guided_2, alone = rows[-3:]
    assert (guided_1["guidance"], guided_2["guidance"], guided_1["guide_step"]) == (1.0, 2.0, 10)
    assert guided_1["digits_fd"] == alone["digits_fd"] != guided_2["digits_fd"]


def test_post_hoc_widths_give_one_result_each_and_the_best(ray_session, tmp_path, capsys):
    """--sigma-rel on a train.ema=posthoc run: each width rebuilt from the snapshots and measured; a tracked width
    measures as its own rebuilt checkpoint folder does (raydiff.ema), and the best is named."""
    from raydiff import ema as ema_command

    run_dir = tmp_path / "run"
    write_posthoc_run(run_dir)
    args = ["--num", "64", "--steps", "5", "--sampler", "ddim"]
    assert cli.run(evaluate_main, ["--checkpoint", str(run_dir), *args, "--sigma-rel", "0.05,0.15"]) == 0
    out = capsys.readouterr().out
    assert "step 60, 64 images (ddim, 5 steps, seed 0, post-hoc EMA sigma_rel 0.15): digits_fd" in out
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["sigma_rel"] for r in rows] == [0.05, 0.15] and rows[0]["digits_fd"] != rows[1]["digits_fd"]
    best = min(rows, key=lambda r: r["digits_fd"])
    assert f"[raydiff] best: sigma_rel {best['sigma_rel']:g}: digits_fd {best['digits_fd']:.4g}" in out
    assert cli.run(ema_command.main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.05", "--out",
                                      str(tmp_path / "rebuilt")]) == 0
    assert cli.run(evaluate_main, ["--checkpoint", str(tmp_path / "rebuilt" / "sigma_rel-0.050"), *args]) == 0
    rebuilt = json.loads((tmp_path / "rebuilt" / "eval.jsonl").read_text())
    assert rebuilt["digits_fd"] == rows[0]["digits_fd"]


def test_post_hoc_widths_of_a_run_without_snapshots_are_one_line(smoke_run, capsys):
    run_dir, _ = smoke_run
    assert cli.run(evaluate_main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.05"]) == 2
    assert "has no post-hoc EMA snapshots at or before step 20" in capsys.readouterr().err


@pytest.mark.parametrize("args, fragment", [
    (["--sigma-rel", "0"], "--sigma-rel = '0': must be comma-separated different numbers in [0.0001, 0.28)"),
    (["--num", "1"], "--num = 1: must be >= 2"),
    (["--metrics", "fid,is"], "--metrics = ['fid', 'is']: must be a list of fid and/or kid, each once"),
    (["--features", "inception", "--weights", "/nonexistent/inception.pth"],
     "--weights = '/nonexistent/inception.pth': no such file"),  # was named --inception_weights
    (["--ref", "/nonexistent/stats.npz"], "--ref = '/nonexistent/stats.npz': no such file or folder"),
    (["--ref", "/nonexistent/images"], "--ref = '/nonexistent/images': no such file or folder"),  # was data.source
])
def test_bad_input_is_one_line_exit_2(smoke_run, args, fragment, capsys):
    run_dir, _ = smoke_run
    assert cli.run(evaluate_main, ["--checkpoint", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len([line for line in err.splitlines() if line.startswith("raydiff:")]) == 1


def test_a_reference_folder_without_images_is_named_as_the_reference(smoke_run, ray_session, tmp_path, capsys):
    """The reference is read as a source is, and its errors named it data.source: the run's own source, which
    the user did not touch; then eval.ref, a config key the user did not write either."""
    run_dir, _ = smoke_run
    (tmp_path / "empty").mkdir()
    assert cli.run(evaluate_main, ["--checkpoint", str(run_dir), "--ref", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"raydiff: error: --ref = '{tmp_path / 'empty'}': no image "
                                                        f"files found (looked for .jpg, .jpeg, .png, .webp, .bmp, "
                                                        f"recursively)")


@pytest.mark.ray
def test_sigterm_stops_an_evaluation_in_one_line(smoke_run, ray_session):
    """SIGTERM while the samples are drawn by Ray tasks: one line and exit 143, where Ray's own handler printed a
    stack dump and aborted (and an exception of raydiff's own, raised inside ray.get, became a SystemError)."""
    run_dir, _ = smoke_run
    code, output = run_cli_interrupted("raydiff.evaluate", "--checkpoint", str(run_dir), "--num", "100000",
                                       at="[raydiff] joined the Ray cluster", sig=signal.SIGTERM, after_s=3)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert output.strip().splitlines()[-1] == "raydiff: stopped by SIGTERM", output[-3000:]
    assert "SIGTERM received at time" not in output and "Traceback" not in output


def test_an_evaluation_beside_a_run_that_holds_every_cpu_says_it_waits_then_measures(ray_session, tmp_path):
    """The cluster's CPUs all held by another job's actor (a training run's workers): the measuring tasks cannot
    start, and the command says so in one line, where it waited in silence; once the actor is gone, it measures."""
    ray = ray_session
    folder, _ = write_checkpoint(tmp_path, classes=None)

    @ray.remote(num_cpus=2)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()  # type: ignore[attr-defined]
    silent_wait = threading.Timer(90, ray.kill, args=(holder,))  # a command that waits without a word fails, not hangs
    try:
        ray.get(holder.ready.remote(), timeout=120)
        silent_wait.start()
        code, output = run_cli_acting("raydiff.evaluate", "--checkpoint", str(folder), "--num", "200", "--steps", "5",
                                      at="wait until one is free", act=lambda proc: ray.kill(holder))
    finally:
        silent_wait.cancel()
        ray.kill(holder)
    assert code == 0, output[-3000:]
    assert output.count("[raydiff] every CPU of the cluster (2) in use (by a training run?): ") == 1, output[-3000:]
    assert "step 7, 200 images (ddim, 5 steps, seed 0): digits_fd" in output


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


@pytest.fixture(scope="module")
def conditional_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("conditional"),
                            classes={"names": [str(d) for d in range(10)], "counts": DIGIT_COUNTS})


def test_conditional_one_result_per_guidance_with_the_class_match(conditional_checkpoint, ray_session, capsys):
    """--guidance 0,2: one line and one eval.jsonl row per W, one file with both; digits_class_match is the share
    of images (asked for classes in the data's frequencies) that the digits classifier reads as their class. One
    torch thread here (the suite's: conftest.py), as in evaluate's Ray tasks: the in-run numbers recomputed below
    then sum in the same order."""
    import torch

    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.unet import build_model
    from raydiff.quality.features import DigitsFeatures
    from raydiff.quality.measure import SampleJob, eval_labels
    from raydiff.runs.state import read_state

    checkpoint, cfg = conditional_checkpoint
    run_dir = checkpoint.parent
    args = ["--checkpoint", str(checkpoint), "--num", "40", "--steps", "2"]
    assert cli.run(evaluate_main, [*args, "--guidance", "0,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in out] == [
        "[raydiff] step 7, 40 images (ddim, 2 steps, seed 0, guidance 0)",
        "[raydiff] step 7, 40 images (ddim, 2 steps, seed 0, guidance 2)"]
    assert "digits_class_match" in out[1]
    result = json.loads((run_dir / "eval" / "7-ddim-2-40.json").read_text())
    assert result["classes"] == [str(d) for d in range(10)] and result["reference_images"] == 1797
    assert [r["guidance"] for r in result["results"]] == [0.0, 2.0]
    unguided, guided = result["results"]
    assert unguided["digits_fd"] != guided["digits_fd"]
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(r["guidance"], r["digits_fd"], r["file"]) for r in rows] == [
        (0.0, unguided["digits_fd"], "eval/7-ddim-2-40.json"), (2.0, guided["digits_fd"], "eval/7-ddim-2-40.json")]
    # The class match, recomputed here: the same images, the classifier's reading against the class asked for.
    state = read_state(checkpoint)
    model = build_model(cfg)
    model.load_state_dict(state["ema"])
    job = SampleJob(model=model.eval(), diffusion=build_diffusion(cfg), shape=(1, 8, 8), sampler="ddim", steps=2,
                    seed=0, class_counts=tuple(DIGIT_COUNTS), guidance=2.0)
    labels = eval_labels(0, range(40), DIGIT_COUNTS)
    assert 9 not in labels
    logits = DigitsFeatures()(job.images(range(40), torch.device("cpu")))[1]
    expected = int((logits.argmax(-1) == torch.tensor(labels)).sum()) / len(labels)
    assert guided["digits_class_match"] == expected

    # Without --guidance: eval.guidance (2 unless the run set it), which the in-run evaluation uses too, with the
    # same classes asked for: the same numbers.
    from raydiff.quality.reference_stats import reference_for
    from raydiff.training.in_run_quality import InRunQuality, evaluate_in_run

    assert cli.run(evaluate_main, args) == 0
    default = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    assert default["guidance"] == 2.0 and default["file"] == "eval/7-ddim-2-40-2.json"
    cfg.eval.num, cfg.eval.steps, cfg.run.storage = 40, 2, str(run_dir.parent)
    features = DigitsFeatures()
    quality = InRunQuality(features, reference_for(cfg, features, keep_features=False),
                           class_names=tuple(str(d) for d in range(10)), class_counts=tuple(DIGIT_COUNTS))
    in_run = evaluate_in_run(quality, model.float(), build_diffusion(cfg), cfg, 0, 1, torch.device("cpu"))
    assert in_run["digits_fd"] == pytest.approx(default["digits_fd"], rel=1e-9)
    assert in_run["digits_class_match"] == default["digits_class_match"]


@pytest.mark.parametrize("guidance, fragment", [
    ("-1", "--guidance = '-1': must be comma-separated different numbers >= 0"),
    ("1,abc", "--guidance = '1,abc': must be comma-separated different numbers >= 0"),
    ("2,nan", "--guidance = '2,nan': must be comma-separated different numbers >= 0"),
    ("1,2,2", "--guidance = '1,2,2': must be comma-separated different numbers >= 0"),  # W = 2 sampled twice
])
def test_bad_guidance_is_one_line_exit_2(conditional_checkpoint, guidance, fragment, capsys):
    checkpoint, _ = conditional_checkpoint
    before = sorted(p.name for p in checkpoint.parent.iterdir())
    assert cli.run(evaluate_main, ["--checkpoint", str(checkpoint), "--guidance", guidance]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len([line for line in err.splitlines() if line.startswith("raydiff:")]) == 1
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == before


def test_guidance_on_an_unconditional_model_is_one_line_exit_2(tmp_path, capsys):
    checkpoint, _ = write_checkpoint(tmp_path, classes=None)
    assert cli.run(evaluate_main, ["--checkpoint", str(checkpoint), "--guidance", "2"]) == 2
    err = capsys.readouterr().err
    assert "--guidance = '2': " in err and "holds an unconditional model" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]


def test_guidance_on_a_model_that_never_dropped_a_label_is_one_line_exit_2(tmp_path, capsys):
    checkpoint, _ = write_checkpoint(tmp_path, classes={"names": ["a", "b"], "counts": [5, 5]},
                                     overrides=("train.label_dropout=0", "eval.guidance=1"))
    assert cli.run(evaluate_main, ["--checkpoint", str(checkpoint), "--guidance", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydiff: config error: --guidance = 2.0: the unconditional prediction it needs is learned "
                          "only from dropped labels, and train.label_dropout = 0") and len(err.splitlines()) == 1
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]


def test_a_result_whose_rows_cannot_be_written_leaves_neither_its_file_nor_some_of_its_rows(tmp_path, monkeypatch):
    """One row per guidance value: a disk that filled after the first left eval/<...>.json and that row, and a
    re-run wrote <...>-2.json beside them."""
    import errno

    from raydiff.evaluate import write_result
    from raydiff.storage.rundir import RunDir

    run_dir = RunDir(str(tmp_path / "run"))
    result = {"step": 7, "sampler": "ddim", "steps": 50, "num": 500,
              "results": [{"guidance": 1.0, "fid": 30.0}, {"guidance": 2.0, "fid": 20.0}]}
    assert write_result(run_dir, result) == "eval/7-ddim-50-500.json"
    before = (tmp_path / "run" / "eval.jsonl").read_text()
    assert [json.loads(line)["guidance"] for line in before.splitlines()] == [1.0, 2.0]

    def full(self, name, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunDir, "append_text", full)
    with pytest.raises(OSError):
        write_result(run_dir, result)
    assert sorted(p.name for p in (tmp_path / "run" / "eval").iterdir()) == ["7-ddim-50-500.json"]
    assert (tmp_path / "run" / "eval.jsonl").read_text() == before


def test_a_run_of_before_blank_texts_were_refused_is_evaluated_with_them_as_none(tmp_path):
    """Runs stored `eval.ref: ''` and `log.wandb_project: ''` (none, then) until 2026-12-07: refused in configs
    since, they made such a run unreadable to raydiff.evaluate."""
    from types import SimpleNamespace

    from raydiff.evaluate import eval_config
    from raydiff.runs.checkpoint import read_state

    checkpoint, _ = write_checkpoint(tmp_path, classes=None)
    state = read_state(checkpoint)
    state["config"]["eval"]["ref"], state["config"]["log"]["wandb_project"] = "", " "
    args = SimpleNamespace(num=None, sampler=None, steps=None, metrics=None, ref=None, seed=None, features=None,
                           weights=None, endpoint=None)
    cfg = eval_config(state, args, str(tmp_path))
    assert cfg.eval.ref is None and cfg.log.wandb_project is None


def test_the_best_width_is_never_one_whose_distance_is_nan():
    """A diverged average's NaN images give a NaN distance (never 0.0); min() over NaN picked whichever came
    first."""
    from raydiff.evaluate import best_line

    rows = [{"sigma_rel": 0.05, "fid": math.nan}, {"sigma_rel": 0.1, "fid": 3.0}, {"sigma_rel": 0.2, "fid": 5.0}]
    assert best_line(rows) == "sigma_rel 0.1: fid 3"
