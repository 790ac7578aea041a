from __future__ import annotations

import torch

from raydiff.config import load_config
from raydiff.model.unet import UNet, build_model, count_parameters, timestep_embedding


def test_cifar10_preset_has_ho_et_al_parameter_count():
    assert count_parameters(build_model(load_config("cifar10", check_source=False))) == 35_746_307  # "35.7M"


def test_output_shape_matches_input_for_each_preset():
    for name, channels in (("default", 1), ("smoke", 1)):
        cfg = load_config(name)
        model = build_model(cfg).eval()
        x = torch.randn(2, channels, cfg.data.resolution, cfg.data.resolution)
        assert model(x, torch.tensor([0, 999])).shape == x.shape


def test_timestep_changes_the_output():
    model = UNet(resolution=8, in_channels=3, base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
                 attention_resolutions=(4,), dropout=0.0, norm_groups=4).eval()
    x = torch.randn(1, 3, 8, 8)
    assert not torch.allclose(model(x, torch.tensor([1])), model(x, torch.tensor([500])))


def test_timestep_embedding_is_sinusoidal():
    emb = timestep_embedding(torch.tensor([0, 10]), 8)
    assert emb.shape == (2, 8)
    assert torch.allclose(emb[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert torch.allclose(emb[1, 0], torch.sin(torch.tensor(10.0)))
