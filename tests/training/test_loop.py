"""The training loop in Ray Train's local mode (no actors): accumulation arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray.train
from ray.train.torch import TorchTrainer

from raydiff.config import load_config
from raydiff.data.ingest import ImageStore
from raydiff.model.ema import ema_decay_at
from raydiff.runs.rundir import RunDir
from raydiff.training.loop import train_worker
from raydiff.training.lr import lr_at

pytestmark = pytest.mark.ray


def run_local(ray_session, storage, name, *overrides):
    images = np.random.default_rng(0).integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    store = ImageStore(chunks=(ray_session.put(images),), counts=(20,), shape=(1, 8, 8), source="test")
    cfg = load_config("smoke", [f"run.storage={storage}", f"run.name={name}", "train.total_steps=4",
                                "train.global_batch=8", "scaling.num_workers=1", "train.sample_every=0",
                                "train.log_every=1", *overrides])
    result = TorchTrainer(
        train_worker,
        train_loop_config={"config": cfg.to_dict(), "images": store, "run_dir": RunDir(storage / name),
                           "torch_threads": 1,
                           "invocation": "test"},
        scaling_config=ray.train.ScalingConfig(num_workers=0),
        run_config=ray.train.RunConfig(name=name, storage_path=str(storage)),
    ).fit()
    rows = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    return result.return_value, rows


def test_accumulation_computes_the_same_steps(ray_session, tmp_path):
    plain, plain_rows = run_local(ray_session, tmp_path, "plain")
    accumulated, acc_rows = run_local(ray_session, tmp_path, "accumulated", "train.micro_batch=2")
    assert plain["steps"] == accumulated["steps"] == 4 and plain["images_seen"] == 32
    assert [r["loss"] for r in acc_rows] == pytest.approx([r["loss"] for r in plain_rows], rel=1e-5)
    assert [r["grad_norm"] for r in acc_rows] == pytest.approx([r["grad_norm"] for r in plain_rows], rel=1e-5)
    # smoke: base_lr 1e-3 at batch 16, scaled linearly to the global batch of 8.
    assert [r["lr"] for r in plain_rows] == pytest.approx([lr_at(s, 5e-4, 5) for s in range(4)])
    assert [r["ema_decay"] for r in plain_rows] == [ema_decay_at(s, 0.99, 5) for s in range(1, 5)]
