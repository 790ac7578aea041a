"""python -m raydiff.sample on class-conditional and unconditional checkpoints: what --class and --guidance ask
for, and each request a model cannot serve refused in one line before anything is sampled or written."""

from __future__ import annotations

import pytest
from test_export import CLASSES, CONDITIONAL, write_checkpoint

from raydiff import cli, sample
from raydiff.config import load_config
from raydiff.runs.images import grid_row, image_labels


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three smoke-shaped runs (T = 50): `conditional` (classes zero, one, two), `unconditional`, and
    `no-null-class` (conditional, trained without dropped labels)."""
    root = tmp_path_factory.mktemp("sample")
    write_checkpoint(root / "conditional", load_config("smoke", CONDITIONAL, check_source=False), classes=CLASSES)
    write_checkpoint(root / "unconditional", load_config("smoke", ["diffusion.timesteps=50"], check_source=False))
    no_null_class = [*CONDITIONAL, "train.label_dropout=0", "eval.guidance=1"]  # conditional, never unconditional
    write_checkpoint(root / "no-null-class", load_config("smoke", no_null_class, check_source=False), classes=CLASSES)
    return root


def test_every_class_by_default_one_row_each(runs, tmp_path, capsys):
    out = tmp_path / "grid.png"
    assert cli.run(sample.main, ["--checkpoint", str(runs / "conditional"), "--num", "6", "--sampler", "ddim",
                                 "--steps", "2", "--out", str(out)]) == 0
    assert "; every class: 0 (zero), 1 (one), 2 (two), guidance 2" in capsys.readouterr().out
    assert grid_row([0, 1, 2], 6) == 2 and grid_row([0, 1, 2], 7) is None  # else a square grid
    assert grid_row([1], 6) is None  # one class: a square grid, not one long row
    assert image_labels([0, 1, 2], 7) == [0, 0, 0, 1, 1, 2, 2]


def test_fewer_images_than_classes_say_which_classes_they_are(runs, tmp_path, capsys):
    """The start line listed every class where --num 2 samples two of the three."""
    assert cli.run(sample.main, ["--checkpoint", str(runs / "conditional"), "--num", "2", "--sampler", "ddim",
                                 "--steps", "2", "--out", str(tmp_path / "grid.png")]) == 0
    assert "; class 0 (zero), 1 (one) (2 of its 3 classes: --num 2), guidance 2" in capsys.readouterr().out


@pytest.mark.parametrize(("run", "args", "message"), [
    ("unconditional", ["--class", "1"], "--class 1: the model is unconditional (model.num_classes = 0); --class "
                                        "applies to class-conditional models only"),
    ("unconditional", ["--guidance", "2"], "--guidance 2: the model is unconditional (model.num_classes = 0); "
                                           "--guidance applies to class-conditional models only"),
    ("conditional", ["--class", "zero,seven"], "--class 'seven': not a class of this model; use an id 0..2 or a "
                                               "name: 0 'zero', 1 'one', 2 'two'"),
    ("conditional", ["--class", "3"], "--class '3': not a class of this model; use an id 0..2 or a name: 0 'zero', "
                                      "1 'one', 2 'two'"),
    ("conditional", ["--class", "-1"], "--class '-1': not a class of this model"),
    ("conditional", ["--class", "0,2", "--num", "1"], "--num 1: fewer images than the 2 classes asked (--class 0,2); "
                                                      "give --num 2 or more"),
    ("no-null-class", ["--guidance", "0"], "--guidance 0: this model never learned the unconditional prediction "
                                           "that guidance needs (trained with train.label_dropout = 0: no labels "
                                           "dropped); use --guidance 1"),
])
def test_a_request_the_model_cannot_serve_is_one_line_and_writes_nothing(runs, tmp_path, capsys, run, args, message):
    out = tmp_path / "samples"
    assert cli.run(sample.main, ["--checkpoint", str(runs / run), "--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"raydiff: error: {message}") and captured.err.count("\n") == 1
    assert "sampling" not in captured.out and not out.exists()


def test_a_negative_guidance_is_refused_before_reading_the_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        sample.main(["--checkpoint", str(tmp_path / "missing"), "--guidance", "-1", "--out", str(tmp_path / "x")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == ("raydiff: error: --guidance -1: must be >= 0 (diffusers' convention: 0 unconditional, 1 "
                   "conditional without guidance, more follows the class more closely) (python -m raydiff.sample "
                   "--help)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("sampler", "steps", "taken"), [("dpmpp_2m", "1000", 49), ("ddim", "1000", 50),
                                                         ("ddpm", None, 50), ("heun", None, 18)])
def test_the_start_line_says_the_steps_the_sampler_takes(runs, tmp_path, capsys, sampler, steps, taken):
    # T = 50: DPM-Solver++ takes at most 49 steps (asked for 50 or more, its images were NaN), DDIM and DDPM 50.
    out = tmp_path / "grid.png"
    args = ["--checkpoint", str(runs / "unconditional"), "--num", "1", "--sampler", sampler, "--out", str(out)]
    assert cli.run(sample.main, args + (["--steps", steps] if steps else [])) == 0
    # On CPUs the command keeps the host memory each pass frees, as the run's workers did (train.keep_host_memory).
    assert f"with {sampler}, {taken} steps, on cpu, host memory kept" in capsys.readouterr().out


def test_a_run_trained_without_keeping_host_memory_samples_without_it_too(tmp_path, capsys):
    run = tmp_path / "returned"
    write_checkpoint(run, load_config("smoke", ["diffusion.timesteps=50", "train.keep_host_memory=false"],
                                      check_source=False))
    args = ["--checkpoint", str(run), "--num", "1", "--sampler", "ddim", "--steps", "2"]
    assert cli.run(sample.main, [*args, "--out", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert "with ddim, 2 steps, on cpu\n" in out and "host memory" not in out


def test_evaluate_takes_autoguidance_weight_0_as_the_guide_alone_as_sample_does(monkeypatch):
    """`--guide G --guidance 0`: raydiff.sample samples the guide alone (weight 0), and so must raydiff.evaluate's
    row labelled guidance 0 (it measured the model alone, weight 1). Its Ray tasks and metrics are stood in for:
    what is checked is the model each value hands them."""
    from types import SimpleNamespace

    import torch

    from raydiff import evaluate
    from raydiff.cluster import start
    from raydiff.model.unet import build_model
    from raydiff.quality import measure, reference_stats

    cfg = load_config("smoke", ["diffusion.timesteps=50"], check_source=False)
    state = {"step": 7, "config": cfg.to_dict(), "ema": build_model(cfg).state_dict()}
    weights: list[float] = []

    def parallel_stats(kind, job, *args, **kwargs):
        weights.append(job.model.weight)
        return None

    monkeypatch.setattr(start, "init_ray", lambda: None)
    monkeypatch.setattr(reference_stats, "reference_for",
                        lambda *args, **kwargs: SimpleNamespace(description="stand-in", count=1))
    monkeypatch.setattr(measure, "parallel_stats", parallel_stats)
    monkeypatch.setattr(measure, "scores", lambda *args, **kwargs: {"fid": 1.0})
    with torch.no_grad():
        result = evaluate.evaluate(state, cfg, features=SimpleNamespace(name="stand-in"), guidance=(0.0, 2.0),
                                   guide=state)
    assert [row["guidance"] for row in evaluate.rows(result)] == [0.0, 2.0]
    assert weights == [0.0, 2.0]
    conditional = {"config": load_config("smoke", CONDITIONAL, check_source=False).to_dict(), "classes": CLASSES}
    assert sample.class_request(conditional, None, 0.0, autoguided=True)[1] == 0.0


@pytest.mark.parametrize("eta", ["1.5", "-0.5", "nan"])
def test_an_eta_outside_0_to_1_is_refused_before_reading_the_checkpoint(tmp_path, capsys, eta):
    # Above 1, DDIM's steps clamped their noise and gave images of the wrong spread without a word.
    with pytest.raises(SystemExit) as caught:
        sample.main(["--checkpoint", str(tmp_path / "missing"), "--sampler", "ddim", "--eta", eta,
                     "--out", str(tmp_path / "x")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"raydiff: error: --eta {float(eta):g}: must be in [0, 1] (0: deterministic DDIM, 1: DDPM's "
                   f"posterior) (python -m raydiff.sample --help)\n")
    assert list(tmp_path.iterdir()) == []


def _refused_before_sampling(runs, out: str, capsys) -> str:
    """Sample one image into `out`, which must be refused (exit 2) before any sampling, in one line: that line."""
    with pytest.raises(SystemExit) as caught:
        sample.main(["--checkpoint", str(runs / "unconditional"), "--num", "1", "--sampler", "ddim", "--steps", "2",
                     "--out", out])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert "sampling" not in captured.out and captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_and_the_current_folder_is_left_alone(runs, tmp_path, monkeypatch, capsys, out):
    # Path("") is "." (an unset shell variable): the samples went into the current folder, and its own
    # sample_NNNNN.png from --num up were removed.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sample_00001.png").write_bytes(b"mine")
    assert _refused_before_sampling(runs, out, capsys) == (
        f"raydiff: error: --out {out!r}: must name a grid image (.png, .jpg, .jpeg, .webp) or a folder (an empty "
        f"value would mean the current folder) (python -m raydiff.sample --help)")
    assert [p.name for p in tmp_path.iterdir()] == ["sample_00001.png"]


def test_a_grid_name_that_is_a_folder_is_refused_before_sampling(runs, tmp_path, capsys):
    # The folder was found only when the grid was renamed onto it, after all the sampling: a traceback.
    (tmp_path / "adir.png").mkdir()
    assert _refused_before_sampling(runs, str(tmp_path / "adir.png"), capsys) == (
        f"raydiff: error: --out {tmp_path / 'adir.png'}: is a folder; a name ending in .png is written as one grid "
        f"image file (a folder of samples takes a name without it) (python -m raydiff.sample --help)")
    assert list((tmp_path / "adir.png").iterdir()) == []


@pytest.mark.parametrize("name", ["fresh.png/", "fresh.webp//"])
def test_a_grid_name_with_a_trailing_slash_is_refused_before_sampling(runs, tmp_path, capsys, name):
    # The user asked for a folder named like a grid: a grid FILE fresh.png was written, exit 0 (the docs said no).
    out = f"{tmp_path}/{name}"
    suffix = name.rstrip("/").removeprefix("fresh")
    assert _refused_before_sampling(runs, out, capsys) == (
        f"raydiff: error: --out {out}: names a folder (the trailing /); a name ending in {suffix} is written as one "
        f"grid image file (a folder of samples takes a name without it) (python -m raydiff.sample --help)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("steps", ["100001", "1000000000000"])
def test_more_sampling_steps_than_any_schedule_has_are_refused_before_reading_the_checkpoint(tmp_path, capsys, steps):
    """Heun steps between timesteps, with no cap: 10^12 of them was a MemoryError's traceback (its timestep
    table)."""
    with pytest.raises(SystemExit) as caught:
        sample.main(["--checkpoint", str(tmp_path / "none"), "--sampler", "heun", "--steps", steps,
                     "--out", str(tmp_path / "x.png")])
    assert caught.value.code == 2
    assert capsys.readouterr().err == (f"raydiff: error: --steps {steps}: must be in [1, 100,000] (python -m "
                                       f"raydiff.sample --help)\n")


def test_a_sample_folder_holding_a_folder_of_a_sample_s_name_gets_none_of_the_new_samples(runs, tmp_path, capsys):
    """A folder named sample_00001.png was met at its rename: grid.png and sample_00000.png were already replaced,
    while the line said nothing half-written was left."""
    out = tmp_path / "samples"
    (out / "sample_00001.png").mkdir(parents=True)
    (out / "grid.png").write_bytes(b"earlier")
    assert cli.run(sample.main, ["--checkpoint", str(runs / "unconditional"), "--num", "3", "--sampler", "ddim",
                                 "--steps", "2", "--out", str(out)]) == 2
    assert f"is a directory: {out / 'sample_00001.png'}" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["grid.png", "sample_00001.png"]
    assert (out / "grid.png").read_bytes() == b"earlier"


def test_an_out_of_a_home_folder_the_shell_left_unexpanded_is_the_home_folder_s(tmp_path, monkeypatch):
    """`--out=~/grid.png`: the shell expands no ~ after `=`; a folder named ~ was made in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert sample.parse_args(["--checkpoint", "run", "--out=~/grid.png"]).out == tmp_path / "grid.png"
