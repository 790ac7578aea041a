"""python -m raydiff.export, raydiff.sample on an exported folder, and training from model.init_from; the same for
a class-conditional model (its classes, and the model card's guided sampling loop)."""

from __future__ import annotations

import csv
import json
import logging
import warnings

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli, write_checkpoint
from diffusers import DDIMScheduler, DDPMPipeline
from PIL import Image

from raydiff import cli, export, sample, train
from raydiff.config import ConfigError, load_config
from raydiff.model import diffusers_folder, diffusers_io
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.runs.checkpoint import list_checkpoints, read_state
from raydiff.runs.images import image_labels
from raydiff.seeds import GRID_NOISE, image_generators

T = 50  # a short chain, so that sampling every step stays fast
CLASSES = {"names": ["zero", "one", "two"], "counts": [30, 31, 32]}
CONDITIONAL = [f"diffusion.timesteps={T}", "data.labels=auto", f"model.num_classes={len(CLASSES['names'])}"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A smoke-shaped run with T = 50, exported through the CLI."""
    root = tmp_path_factory.mktemp("export")
    cfg = load_config("smoke", [f"diffusion.timesteps={T}"], check_source=False)
    checkpoint = write_checkpoint(root / "run", cfg)
    proc = run_cli("raydiff.export", "--checkpoint", str(root / "run"), "--out", str(root / "pipeline"))
    assert proc.returncode == 0, proc.stderr
    return checkpoint, root / "pipeline"


def test_export_writes_a_pipeline_that_diffusers_loads_without_warnings(exported):
    checkpoint, folder = exported
    names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert names == {"model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
                     "scheduler/scheduler_config.json", "raydiff_config.yaml", "raydiff_export.json", "README.md"}
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".pipeline")]  # no temp folder left

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("diffusers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipeline = DDPMPipeline.from_pretrained(folder)
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    # No warning (missing or unexpected keys, config keys), except diffusers' advice to install `accelerate`,
    # which it logs for every model it loads without it.
    notes = [str(w.message) for w in caught] + [r.getMessage() for r in records if r.levelno >= logging.WARNING
                                                and "`accelerate` was not found" not in r.getMessage()]
    assert not notes, notes

    state = read_state(checkpoint)
    expected = diffusers_io.to_diffusers(state["ema"], load_config("smoke", [f"diffusion.timesteps={T}"],
                                                                   check_source=False))
    assert all(torch.equal(pipeline.unet.state_dict()[k], v) for k, v in expected.items())  # the EMA by default
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert {k: scheduler[k] for k in ("num_train_timesteps", "beta_schedule", "prediction_type", "clip_sample",
                                      "variance_type")} == {"num_train_timesteps": T, "beta_schedule": "linear",
                                                            "prediction_type": "epsilon", "clip_sample": True,
                                                            "variance_type": "fixed_small"}
    assert scheduler["beta_start"] == pytest.approx(1000 / T * 1e-4) and scheduler["beta_end"] == pytest.approx(0.4)
    assert yaml.safe_load((folder / "raydiff_config.yaml").read_text()) == state["config"]
    card = (folder / "README.md").read_text()
    assert "builtin:digits" in card and "| training steps | 20 |" in card and "| images seen | 320 |" in card
    assert "DDPMPipeline.from_pretrained" in card


def test_the_model_cards_fast_sampler_is_raydiffs_dpmpp_2m_sde(exported):
    """The card's DPM-Solver++ SDE snippet, run as it stands on the pipeline (4 steps here), gives raydiff's
    dpmpp_2m_sde images from the same generator (raydiff's x0 clamp off, as diffusers has none)."""
    checkpoint, folder = exported
    snippet = (folder / "README.md").read_text().split("```python\n")[2].split("```")[0]
    assert "num_inference_steps=20" in snippet
    pipe = DDPMPipeline.from_pretrained(folder, low_cpu_mem_usage=False)
    namespace = {"pipe": pipe, "torch": torch}
    exec(snippet.replace("batch_size=16, num_inference_steps=20", "batch_size=3, num_inference_steps=4")
         .replace(".manual_seed(0))", ".manual_seed(0), output_type='np')"), namespace)  # floats, not PNGs

    cfg = load_config("smoke", [f"diffusion.timesteps={T}"], check_source=False)
    model = build_model(cfg).eval()
    model.load_state_dict(read_state(checkpoint)["ema"])
    ours = build_diffusion(cfg).sample(model, (3, 1, 8, 8), sampler="dpmpp_2m_sde", steps=4, clip=False,
                                       generator=torch.Generator().manual_seed(0))
    ours = ((ours + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(namespace["images"], ours, atol=1e-4, rtol=0)


def test_sample_cli_on_the_exported_folder_matches_diffusers_ddim(exported, tmp_path):
    _, folder = exported
    proc = run_cli("raydiff.sample", "--checkpoint", str(folder), "--sampler", "ddim", "--steps", str(T),
                   "--num", "4", "--seed", "3", "--out", str(tmp_path / "samples"))
    assert proc.returncode == 0, proc.stderr
    assert "step 20, EMA weights" in proc.stdout

    pipeline = DDPMPipeline.from_pretrained(folder, low_cpu_mem_usage=False)
    ddim = DDIMScheduler.from_config(pipeline.scheduler.config)
    ddim.set_timesteps(T)
    # raydiff's first draws: image i's x_T from its own generator, seeded by (--seed, i).
    x = torch.stack([torch.randn((1, 8, 8), generator=g) for g in image_generators(3, range(4), "cpu", GRID_NOISE)])
    with torch.no_grad():
        for t in ddim.timesteps:
            x = ddim.step(pipeline.unet(x, t).sample, t, x, use_clipped_model_output=True).prev_sample
    # PNGs hold 8 bits: values within 1e-4 of each other round to the same level or, rarely, a neighbour.
    theirs = ((x.clamp(-1, 1) + 1) / 2 * 255 + 0.5).clamp(0, 255).floor().numpy()[:, 0]
    ours = np.stack([np.asarray(Image.open(tmp_path / "samples" / f"sample_{i:05d}.png").convert("L"))
                     for i in range(4)])
    assert np.abs(ours.astype(float) - theirs).max() <= 1 and (ours == theirs).mean() > 0.99


@pytest.mark.parametrize("sampler,steps", [("dpmpp_2m", 4), ("dpmpp_2m_sde", 4), ("heun", 3)])
def test_sample_cli_samples_with_the_fast_samplers(exported, tmp_path, sampler, steps):
    """--sampler dpmpp_2m / dpmpp_2m_sde / heun through the CLI: the images the library makes from the same EMA
    weights and seeds (8-bit PNGs)."""

    checkpoint, _ = exported
    proc = run_cli("raydiff.sample", "--checkpoint", str(checkpoint), "--sampler", sampler, "--steps", str(steps),
                   "--num", "3", "--seed", "5", "--out", str(tmp_path / "samples"))
    assert proc.returncode == 0, proc.stderr
    assert f"with {sampler}, {steps} steps" in proc.stdout
    state = read_state(checkpoint)
    cfg = load_config("smoke", [f"diffusion.timesteps={T}"], check_source=False)
    model = build_model(cfg)
    model.load_state_dict(state["ema"])
    images = build_diffusion(cfg).sample(model.eval(), (3, 1, 8, 8), sampler=sampler, steps=steps,
                                         generator=image_generators(5, range(3), "cpu", GRID_NOISE))
    theirs = ((images.clamp(-1, 1) + 1) / 2 * 255 + 0.5).clamp(0, 255).floor().numpy()[:, 0]
    ours = np.stack([np.asarray(Image.open(tmp_path / "samples" / f"sample_{i:05d}.png").convert("L"))
                     for i in range(3)])
    assert np.abs(ours.astype(float) - theirs).max() <= 1 and (ours == theirs).mean() > 0.99

    refused = run_cli("raydiff.sample", "--checkpoint", str(checkpoint), "--sampler", sampler, "--eta", "0.5",
                      "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2 and "--eta applies to --sampler ddim only" in refused.stderr


def test_sample_cli_autoguides_with_a_weaker_model(exported, tmp_path):
    """--guide: an unconditional model guided by another checkpoint of its data, out = guide + W (model - guide),
    as the library computes it; a guide of other images is refused in one line and nothing is written."""
    from raydiff.model.guidance import AutoGuided

    checkpoint, _ = exported
    cfg = load_config("smoke", [f"diffusion.timesteps={T}"], check_source=False)
    guide = write_checkpoint(tmp_path / "guide-run", cfg, step=10, seed=1)
    out = tmp_path / "guided"
    proc = run_cli("raydiff.sample", "--checkpoint", str(checkpoint), "--guide", str(tmp_path / "guide-run"),
                   "--guidance", "2.5", "--sampler", "ddim", "--steps", "5", "--num", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"autoguidance 2.5 by {guide} (step 10)" in proc.stdout

    def network(state):
        model = build_model(cfg)
        model.load_state_dict(state["ema"])
        return model.eval()

    guided = AutoGuided(network(read_state(checkpoint)), network(read_state(guide)), 2.5)
    images = build_diffusion(cfg).sample(guided, (3, 1, 8, 8), sampler="ddim", steps=5,
                                         generator=image_generators(0, range(3), "cpu", GRID_NOISE))
    theirs = ((images.clamp(-1, 1) + 1) / 2 * 255 + 0.5).clamp(0, 255).floor().numpy()[:, 0]
    ours = np.stack([np.asarray(Image.open(out / f"sample_{i:05d}.png").convert("L")) for i in range(3)])
    assert np.abs(ours.astype(float) - theirs).max() <= 1 and (ours == theirs).mean() > 0.99

    other = load_config("smoke", [f"diffusion.timesteps={T}", "diffusion.prediction=v"], check_source=False)
    write_checkpoint(tmp_path / "other-run", other, step=10)
    refused = run_cli("raydiff.sample", "--checkpoint", str(checkpoint), "--guide", str(tmp_path / "other-run"),
                      "--num", "3", "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2 and not (tmp_path / "refused").exists()
    assert refused.stderr.strip() == (f"raydiff: error: --guide {tmp_path / 'other-run'}: its diffusion.prediction is "
                                      f"'v', the model's 'eps'; a guide must be a weaker model of the same data and "
                                      f"process (an earlier checkpoint of the run, or a smaller or shorter-trained "
                                      f"model)")


def test_export_with_a_guide_writes_it_and_a_model_card_that_autoguides_as_raydiff_does(exported, tmp_path,
                                                                                          monkeypatch, capsys):
    """--guide: the guide's EMA UNet as guide_unet/, and the card's autoguided loop, run as it stands through
    diffusers' DDPMScheduler, gives raydiff's autoguided DDPM samples from the same noise."""
    from diffusers import UNet2DModel

    from raydiff.model.guidance import AutoGuided

    checkpoint, _ = exported
    cfg = load_config("smoke", [f"diffusion.timesteps={T}"], check_source=False)
    guide = write_checkpoint(tmp_path / "guide-run", cfg, step=10, seed=1)
    folder = tmp_path / "pipeline"
    assert cli.run(export.main, ["--checkpoint", str(checkpoint), "--out", str(folder), "--guide",
                                 str(tmp_path / "guide-run"), "--guidance", "1.5"]) == 0
    assert f"guided by {guide} (step 10) in guide_unet/" in capsys.readouterr().out
    assert json.loads((folder / "raydiff_export.json").read_text())["guide"] == {
        "checkpoint": str(guide), "step": 10, "guidance": 1.5}
    assert isinstance(UNet2DModel.from_pretrained(folder, subfolder="guide_unet"), UNet2DModel)
    card = (folder / "README.md").read_text()
    assert "## Autoguidance" in card and f"(`{guide}`, step 10)" in card
    code = [block.split("```")[0] for block in card.split("```python\n")[1:]]
    snippet = next(block for block in code if "guide_unet" in block)
    monkeypatch.chdir(tmp_path)  # it writes sample.png
    namespace: dict = {}
    exec(snippet.replace("path/to/this/folder", str(folder)), namespace)
    assert (tmp_path / "sample.png").is_file()

    def network(state):
        model = build_model(cfg)
        model.load_state_dict(state["ema"])
        return model.eval()

    guided = AutoGuided(network(read_state(checkpoint)), network(read_state(guide)), 1.5)
    generator = torch.Generator().manual_seed(0)
    ours = build_diffusion(cfg).sample(guided, (16, 1, 8, 8), sampler="ddpm", generator=generator)
    torch.testing.assert_close(namespace["x"], ours, atol=1e-4, rtol=0)

    other = load_config("smoke", [f"diffusion.timesteps={T}", "diffusion.prediction=v"], check_source=False)
    write_checkpoint(tmp_path / "other-run", other, step=10)
    refused = run_cli("raydiff.export", "--checkpoint", str(checkpoint), "--guide", str(tmp_path / "other-run"),
                      "--out", str(tmp_path / "refused"))
    assert refused.returncode == 2 and "its diffusion.prediction is 'v', the model's 'eps'" in refused.stderr
    assert not (tmp_path / "refused").exists() and refused.stderr.count("\n") == 1
    # A guide that is not there is named as the guide (the path alone read as the model's own).
    missing = run_cli("raydiff.export", "--checkpoint", str(checkpoint), "--guide", str(tmp_path / "no-run"),
                      "--out", str(tmp_path / "refused"))
    assert missing.returncode == 2 and missing.stderr == (
        f"raydiff: error: --guide {tmp_path / 'no-run'}: {tmp_path / 'no-run'}: no such run or checkpoint folder\n")
    alone = run_cli("raydiff.export", "--checkpoint", str(checkpoint), "--guidance", "2", "--out", str(tmp_path / "w"))
    assert alone.returncode == 2 and "--guidance 2: a number >= 0, and only with --guide" in alone.stderr
    assert not (tmp_path / "w").exists()


def test_export_refuses_a_non_empty_folder_and_changes_nothing(exported, tmp_path):
    checkpoint, _ = exported
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli("raydiff.export", "--checkpoint", str(checkpoint), "--out", str(out))
    assert proc.returncode == 2
    # In the words of raydiff.prepare and raydiff.datasets (`refuse_occupied`).
    assert proc.stderr == (f"raydiff: error: --out '{out}' already exists and is not an empty folder: choose a new "
                           f"folder\n")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
    (tmp_path / "a-file").write_text("")  # even an empty file is no folder
    proc = run_cli("raydiff.export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "a-file"))
    assert proc.returncode == 2 and proc.stderr == (f"raydiff: error: --out '{tmp_path / 'a-file'}' already exists and "
                                                    f"is not an empty folder: choose a new folder\n")
    assert (tmp_path / "a-file").read_text() == ""


def test_an_exported_folder_given_where_a_run_is_read_says_what_it_is_in_one_line(exported, tmp_path, capsys):
    """Exported again, as a guide, or evaluated: "no checkpoint_* folder with state.pt in it" said nothing of what
    the folder is."""
    from raydiff.evaluate import main as evaluate_main

    checkpoint, folder = exported
    for command, args in ((export.main, ["--checkpoint", str(folder), "--out", str(tmp_path / "again")]),
                          (export.main, ["--checkpoint", str(checkpoint), "--guide", str(folder),
                                         "--out", str(tmp_path / "again")]),
                          (evaluate_main, ["--checkpoint", str(folder)])):
        assert cli.run(command, args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith(
            f"{folder}: a diffusers pipeline folder, not a raydiff run or checkpoint folder (raydiff.sample and "
            f"model.init_from read it)\n"), err
    assert list(tmp_path.iterdir()) == []


def test_no_ema_exports_the_online_weights(exported, tmp_path, capsys):
    checkpoint, _ = exported
    assert cli.run(export.main, ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "online"), "--no-ema"]) == 0
    assert "online weights" in capsys.readouterr().out
    state = diffusers_folder.state_from_folder(tmp_path / "online", where="--checkpoint")
    assert state["weights"] == "online" and state["step"] == 20
    assert all(torch.equal(state["model"][k], v) for k, v in read_state(checkpoint)["model"].items())


def test_train_refuses_a_mismatched_init_from_before_writing_anything(exported, tmp_path, capsys):
    _, folder = exported  # an 8x8 model, T = 50; the default preset is 16x16
    # In this process (the check comes before Ray starts): what `python -m raydiff.train` runs.
    code = cli.run(train.main, ["--set", f"model.init_from={folder}", "--set", f"run.storage={tmp_path}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"raydiff: config error: model.init_from = '{folder}': "
                                               f"data.resolution = 16 here, but the UNet there has sample_size = 8")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.ray
@pytest.mark.slow
def test_a_new_run_starts_from_init_from(exported, tmp_path):
    checkpoint, folder = exported
    # lr 1e-12: two steps move no weight measurably, so the run's final weights show where it started.
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"model.init_from={folder}",
                   "--set", f"diffusion.timesteps={T}", "--set", "train.total_steps=2", "--set", "train.lr=1e-12",
                   "--set", "scaling.num_workers=1", "--set", "train.sample_num=1", "--set", "train.sample_steps=1",
                   "--set", f"run.storage={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "smoke"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["init_from"] == str(folder)
    trained = read_state(list_checkpoints(run_dir)[-1])["model"]
    exported_ema = read_state(checkpoint)["ema"]
    assert all(torch.allclose(trained[k], v, atol=1e-8) for k, v in exported_ema.items())

    # Continuing the run never reads model.init_from: a folder moved away since does not refuse it.
    gone = tmp_path / "moved-away"
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"model.init_from={gone}",
                   "--set", f"diffusion.timesteps={T}", "--set", "train.total_steps=4", "--set", "train.lr=1e-12",
                   "--set", "scaling.num_workers=1", "--set", "train.sample_num=1", "--set", "train.sample_steps=1",
                   "--set", f"run.storage={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"model.init_from: continuing at step 2, not read ({gone})" in proc.stdout
    assert read_state(list_checkpoints(run_dir)[-1])["step"] == 4


@pytest.mark.ray
def test_lr_find_starts_from_init_from_as_the_fine_tune_will(exported, tmp_path):
    _, folder = exported

    def first_loss(*init_from: str) -> tuple[float, str]:
        out = tmp_path / f"lr_find-{len(init_from)}.png"
        proc = run_cli("raydiff.lr_find", "--config", "smoke", "--set", f"diffusion.timesteps={T}", *init_from,
                       "--steps", "10", "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return float(next(csv.DictReader(out.with_suffix(".csv").open()))["loss"]), proc.stdout

    # The same seed, data and noise: the first step's loss differs only by the weights it starts from.
    scratch, _ = first_loss()
    fine_tune, out = first_loss("--set", f"model.init_from={folder}")
    assert fine_tune != scratch and f"from model.init_from = {folder}" in out


def test_lr_find_refuses_an_init_from_that_does_not_fit_before_starting_ray(exported, tmp_path, capsys):
    from raydiff import lr_find

    _, folder = exported  # an 8x8 model; the default preset is 16x16
    code = cli.run(lr_find.main, ["--set", f"model.init_from={folder}", "--out", str(tmp_path / "lr.png")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"raydiff: config error: model.init_from = '{folder}': "
                                               f"data.resolution = 16 here, but the UNet there has sample_size = 8")
    assert list(tmp_path.iterdir()) == []


# Class-conditional models.
@pytest.fixture(scope="module")
def exported_conditional(tmp_path_factory):
    """A smoke-shaped class-conditional run (3 classes, T = 50), exported in this process."""
    root = tmp_path_factory.mktemp("export-conditional")
    cfg = load_config("smoke", CONDITIONAL, check_source=False)
    checkpoint = write_checkpoint(root / "run", cfg, classes=CLASSES)
    assert cli.run(export.main, ["--checkpoint", str(root / "run"), "--out", str(root / "pipeline")]) == 0
    return checkpoint, root / "pipeline"


def test_a_conditional_export_holds_the_classes_and_reads_back(exported_conditional, capsys):
    checkpoint, folder = exported_conditional
    unet = json.loads((folder / "unet" / "config.json").read_text())
    assert unet["num_class_embeds"] == 4 and unet["class_embed_type"] is None  # 3 classes and the null class
    assert json.loads((folder / "raydiff_export.json").read_text())["classes"] == CLASSES
    card = (folder / "README.md").read_text()
    assert "| 2 | `two` | 32 |" in card and "class_labels=torch.cat([labels, null])" in card
    assert "pipeline_tag: unconditional" not in card

    state = diffusers_folder.state_from_folder(folder, where="--checkpoint")  # what sample --checkpoint FOLDER reads
    assert state["classes"] == CLASSES
    assert state["config"]["model"]["num_classes"] == 3 and state["config"]["data"]["labels"] == "auto"
    ema = read_state(checkpoint)["ema"]
    assert ema.keys() == state["ema"].keys() and all(torch.equal(state["ema"][k], v) for k, v in ema.items())
    # A UNet2DModel from elsewhere (no raydiff_export.json): its ids are its class names.
    (folder / "raydiff_export.json").rename(folder / "moved.json")
    try:
        assert diffusers_folder.state_from_folder(folder, where="--checkpoint")["classes"] == {"names": ["0", "1", "2"]}
    finally:
        (folder / "moved.json").rename(folder / "raydiff_export.json")


def test_the_model_cards_guided_loop_is_raydiffs_guided_sampling(exported_conditional, tmp_path, monkeypatch):
    """The card's snippet, run as it stands (diffusers' DDPMScheduler, both branches in one batched forward), gives
    raydiff's guided DDPM samples from the same noise."""
    checkpoint, folder = exported_conditional
    card = (folder / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    assert "K, W, n = 0, 2.0, 16" in snippet
    monkeypatch.chdir(tmp_path)  # it writes sample.png
    namespace: dict = {}
    exec(snippet.replace("path/to/this/folder", str(folder)), namespace)
    assert (tmp_path / "sample.png").is_file()

    cfg = load_config("smoke", CONDITIONAL, check_source=False)
    model = build_model(cfg).eval()
    model.load_state_dict(read_state(checkpoint)["ema"])
    ours = build_diffusion(cfg).sample(model, (16, 1, 8, 8), sampler="ddpm", generator=torch.Generator().manual_seed(0),
                                       labels=torch.zeros(16, dtype=torch.long), guidance=2.0)
    print(f"guided DDPM, {T} steps: max |raydiff - diffusers| = {(ours - namespace['x']).abs().max().item():.2e}")
    torch.testing.assert_close(namespace["x"], ours, atol=1e-4, rtol=0)


def test_sample_cli_asks_an_exported_folder_for_classes_by_name_and_id(exported_conditional, tmp_path, capsys):
    checkpoint, folder = exported_conditional
    common = ["--num", "6", "--sampler", "ddim", "--steps", "4"]
    by_name, by_id = tmp_path / "by-name", tmp_path / "by-id"
    assert cli.run(sample.main, ["--checkpoint", str(folder), "--class", "two,zero,one", "--out", str(by_name),
                                 *common]) == 0
    out = capsys.readouterr().out
    assert "class 2 (two), 0 (zero), 1 (one), guidance 2" in out
    assert cli.run(sample.main, ["--checkpoint", str(checkpoint), "--class", "2,0,1", "--out", str(by_id),
                                 *common]) == 0
    for i in range(6):  # the folder holds the checkpoint's EMA weights: the same images
        name = f"sample_{i:05d}.png"
        assert (by_name / name).read_bytes() == (by_id / name).read_bytes()
    # Image i gets class i * 3 // 6, and the grid has one row per class: 3 rows of 2 images.
    assert image_labels([2, 0, 1], 6) == [2, 2, 0, 0, 1, 1]
    width, height = Image.open(by_name / "grid.png").size
    assert (width - 2) / 2 == (height - 2) / 3  # 2 columns, 3 rows of equal cells (2 px padding)
    pixels = np.asarray(Image.open(by_id / "sample_00000.png"))
    assert not (pixels == np.asarray(Image.open(by_id / "sample_00002.png"))).all()


def test_init_from_a_conditional_export(exported_conditional, tmp_path, capsys):
    checkpoint, folder = exported_conditional
    cfg = load_config("smoke", [*CONDITIONAL, f"model.init_from={folder}"], check_source=False)
    model = build_model(cfg).eval()
    model.load_state_dict(diffusers_folder.load_diffusers_weights(cfg))
    assert torch.equal(model.class_embed.weight, read_state(checkpoint)["ema"]["class_embed.weight"])
    # model.num_classes = auto takes it; the driver checks the number once the data has said it.
    auto = load_config("smoke", [f"diffusion.timesteps={T}", "data.labels=auto", "model.num_classes=auto",
                                 f"model.init_from={folder}"], check_source=False)
    weights = diffusers_folder.load_diffusers_weights(auto)
    diffusers_io.check_classes(weights, 3, init_from=str(folder), auto=True)
    with pytest.raises(ConfigError, match=r"^model\.init_from = .*: model\.num_classes = auto = 5 \(the classes the "
                                          r"data has\) here, but the UNet there has num_class_embeds = 4 \(3 classes "
                                          r"plus the null class\)$"):
        diffusers_io.check_classes(weights, 5, init_from=str(folder), auto=True)
    # A conditional UNet into an unconditional run: refused by a new run in one line, before anything is written.
    code = cli.run(train.main, ["--config", "smoke", "--set", f"diffusion.timesteps={T}",
                                "--set", f"model.init_from={folder}", "--set", f"run.storage={tmp_path}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"raydiff: config error: model.init_from = '{folder}': model.num_classes = 0 (unconditional) here, but the "
        f"UNet there has num_class_embeds = 4 (3 classes plus the null class)")
    assert list(tmp_path.iterdir()) == []
