"""Class-conditional training end to end, through the CLI: the digits' labels, a model of auto classes, its
records, grids, validation and in-run quality; the refusals of a model too small for the data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import SMOKE_EVAL, run_cli
from PIL import Image

from raydiff.runs.checkpoint import list_checkpoints, read_state

pytestmark = pytest.mark.ray

CONDITIONAL = ["--config", "smoke", "--set", "data.labels=auto", "--set", "model.num_classes=auto",
               "--set", "data.val_images=32", "--set", "train.val_every=10", "--set", "train.sample_num=20",
               "--set", "scaling.num_workers=1"]


@pytest.fixture(scope="module")
def conditional_run(tmp_path_factory, cluster):
    """The smoke preset (on 1 worker, 20 steps) on the digits' labels: (run directory, the CLI's output)."""
    storage = tmp_path_factory.mktemp("conditional")
    proc = run_cli("raydiff.train", *CONDITIONAL, *SMOKE_EVAL, "--set", f"run.storage={storage}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return storage / "smoke", proc.stdout + proc.stderr


def test_a_conditional_run_records_its_classes_and_trains_on_them(conditional_run):
    run_dir, output = conditional_run
    assert "class-conditional on 10 classes (label dropout 0.5)" in output
    # config.yaml keeps what the user asked for; the checkpoint the resolved model and the classes.
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["num_classes"] == "auto"
    data = json.loads((run_dir / "data.json").read_text())
    assert data["classes"] == [str(d) for d in range(10)] and sum(data["class_counts"]) == 1797
    state = read_state(list_checkpoints(run_dir)[-1])
    assert state["config"]["model"]["num_classes"] == 10
    assert state["classes"]["names"] == data["classes"] and state["classes"]["counts"] == data["class_counts"]
    assert state["ema"]["class_embed.weight"].shape[0] == 11  # ten digits and the null class

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["val_loss"]) for r in rows if "val_loss" in r) and "val_loss" in rows[-1]
    # The grid: one row per class, two images each (train.sample_num = 20), 8 px images at least 512 px wide.
    grid = np.asarray(Image.open(run_dir / "samples" / "step_00000020.png"))
    columns, rows_of_images = 2, 10
    assert grid.shape[0] / grid.shape[1] == pytest.approx(rows_of_images / columns, rel=0.05)


def test_a_model_smaller_than_the_data_is_refused_in_one_line(cluster, tmp_path):
    proc = run_cli("raydiff.train", *CONDITIONAL, "--set", "model.num_classes=3", "--set", f"run.storage={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "raydiff: config error: model.num_classes = 3: smaller than the 10 classes found in "
        "data.source = 'builtin:digits'; set it to at least 10, or auto")
    assert not (tmp_path / "smoke" / "config.yaml").exists() and not list_checkpoints(tmp_path / "smoke")


def test_sample_without_class_or_guidance_reproduces_the_runs_grid(conditional_run, tmp_path):
    """raydiff.sample's defaults for a conditional model (every class, the run's eval.guidance) with the grid's
    sampler, steps, seed and count give the run's own final grid, one row per class."""
    run_dir, _ = conditional_run
    proc = run_cli("raydiff.sample", "--checkpoint", str(run_dir), "--sampler", "ddim", "--steps", "10", "--num", "20",
                   "--seed", "0", "--out", str(tmp_path / "grid.png"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "guidance 2" in proc.stdout
    assert np.array_equal(np.asarray(Image.open(tmp_path / "grid.png")),
                          np.asarray(Image.open(run_dir / "samples" / "step_00000020.png")))
