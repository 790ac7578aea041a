"""Held-out split and the fixed-noise validation loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydiff.config import Config
from raydiff.data.loader import ImageTable
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model, variance_scaling_
from raydiff.training.validation import TIMESTEPS_PER_IMAGE, Validation, holdout_split, validation_timesteps


def test_holdout_split_is_disjoint_complete_and_seeded():
    train, val = holdout_split(100, 10, seed=0)
    assert len(val) == 10 and len(train) == 90 and not set(train) & set(val)
    assert sorted([*train, *val]) == list(range(100))
    again, other = holdout_split(100, 10, seed=0)[1], holdout_split(100, 10, seed=1)[1]
    assert np.array_equal(val, again) and not np.array_equal(val, other)
    assert len(holdout_split(100, 0, seed=0)[1]) == 0
    with pytest.raises(ValueError):
        holdout_split(10, 10, seed=0)


def test_holdout_split_draws_from_the_usable_samples_only():
    usable = np.array([0, 2, 3, 5, 8, 9, 11])  # bad samples 1, 4, 6, 7, 10 left out
    train, val = holdout_split(usable, 3, seed=0)
    assert len(val) == 3 and sorted([*train, *val]) == usable.tolist()


def test_timesteps_cover_every_quarter_for_every_image():
    t = validation_timesteps(8, 1000)
    assert t.shape == (8, TIMESTEPS_PER_IMAGE)
    for k in range(TIMESTEPS_PER_IMAGE):
        assert ((t[:, k] >= k * 250) & (t[:, k] < (k + 1) * 250)).all()
    assert len(np.unique(t)) == t.size  # stratified: no two items share a timestep


def _validation(rank=0, world_size=1):
    images = np.random.default_rng(0).integers(0, 256, (30, 1, 8, 8), dtype=np.uint8)
    _, val = holdout_split(30, 6, seed=0)
    return Validation(table=ImageTable([images]), val_indices=val, seed=0, timesteps=100, rank=rank,
                      world_size=world_size)


def _model(cfg: Config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(cfg)
    # A fresh model outputs ~0 whatever its other weights (zero-init conv_out, as in DDPM): give it real ones.
    variance_scaling_(model.conv_out.weight)
    return model


def test_loss_depends_only_on_the_weights():
    cfg = Config()
    cfg.data.resolution, cfg.model.channel_mult, cfg.model.attention_resolutions = 8, (1, 2), (4,)
    cfg.model.base_channels, cfg.model.norm_groups, cfg.diffusion.timesteps = 16, 8, 100
    diffusion = build_diffusion(cfg)
    model = _model(cfg, 0)
    validation = _validation()
    first, second = validation.loss(model, diffusion, torch.device("cpu"), batch=5), \
        validation.loss(model, diffusion, torch.device("cpu"), batch=7)
    assert first == pytest.approx(second, rel=1e-6) and np.isfinite(first)
    assert validation.loss(_model(cfg, 1), diffusion, torch.device("cpu")) != pytest.approx(first, rel=1e-3)


def test_the_loss_is_computed_in_fp32_while_training_runs_with_tf32():
    """A GPU trains with TF32 (`train.tf32`); the validation loss, like sampling, turns it off for its passes."""
    from raydiff.training.speed import set_tf32

    seen = []

    class Recording(torch.nn.Module):
        def forward(self, x, t, *labels):
            seen.append((torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()))
            return 0.1 * x

    diffusion = build_diffusion(Config())
    try:
        set_tf32(True)
        assert np.isfinite(_validation().loss(Recording(), diffusion, torch.device("cpu"), batch=7))
    finally:
        set_tf32(False)
    assert seen and set(seen) == {(False, "highest")}


def test_workers_split_the_items_without_overlap():
    parts = [_validation(rank, 4)._items for rank in range(4)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(6 * TIMESTEPS_PER_IMAGE))


def test_validation_grids_and_in_run_quality_pass_as_few_images_as_sampling_commands_do():
    """Under CUDA graphs a training step's activations stay in the graphs' memory pool: the run's other forward
    passes take at most the micro-batch and at most the images per pass the commands sample with (4 at 256x256;
    256 at once, validation's old pass, was over 100 GB there)."""
    from types import SimpleNamespace

    from raydiff.training.worker import Worker

    def per_pass(micro_batch: int, resolution: int) -> int:
        data = SimpleNamespace(resolution=resolution)
        worker = SimpleNamespace(micro_batch=micro_batch, cfg=SimpleNamespace(data=data))
        return Worker.images_per_pass.fget(worker)  # type: ignore[attr-defined]

    assert per_pass(64, 256) == 4 and per_pass(128, 32) == 64 and per_pass(8, 32) == 8 and per_pass(2, 256) == 2
