"""Sample quality during training: over several workers, the same numbers as one process (and as
`raydiff.evaluate`, tests/test_evaluate.py), KID's included, whose subsets are drawn by position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_groups import end_process_group

from raydiff.config import load_config
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.quality.features import DigitsFeatures
from raydiff.quality.reference_stats import Reference
from raydiff.training.in_run_quality import InRunQuality, evaluate_in_run


def _measure_in_two(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        quality, model, cfg = _kid_setup()
        result = evaluate_in_run(quality, model, build_diffusion(cfg), cfg, rank, world_size, torch.device("cpu"))
    finally:
        end_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _kid_setup():
    """More images than KID's subsets hold (1,000): which images each subset draws depends on their order."""
    cfg = load_config("smoke", ["eval.num=1100", "eval.steps=1", "eval.metrics=[fid,kid]"], check_source=False)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    features = DigitsFeatures()
    rng = np.random.default_rng(0)
    kept = rng.standard_normal((1200, 128)).astype(np.float32)
    reference = Reference(mu=kept.mean(0).astype(np.float64), sigma=np.cov(kept, rowvar=False), count=len(kept),
                          features=kept, description="random features")
    return InRunQuality(features, reference), model, cfg


def test_in_run_kid_over_two_workers_is_the_one_of_a_single_process(tmp_path):
    """Each worker generates every other chunk; gathered rank by rank, the features reached KID out of the order
    `raydiff.evaluate` keeps (chunk order), so its subsets drew other images: another KID."""
    mp.spawn(_measure_in_two, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    two = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    quality, model, cfg = _kid_setup()
    alone = evaluate_in_run(quality, model, build_diffusion(cfg), cfg, 0, 1, torch.device("cpu"))
    assert two[0] == two[1]
    assert two[0]["digits_kid"] == pytest.approx(alone["digits_kid"], rel=1e-6)
    assert two[0]["digits_fd"] == pytest.approx(alone["digits_fd"], rel=1e-9)
