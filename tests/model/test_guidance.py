"""Autoguidance: a model guided by a weaker one of the same data, out = guide + W (model - guide), and the guides
that are refused."""

from __future__ import annotations

import pytest
import torch

from raydiff.config import load_config
from raydiff.model.guidance import AutoGuided, check_guide
from raydiff.model.unet import build_model


def _pair(*overrides: str):
    cfg = load_config("smoke", list(overrides), check_source=False)
    torch.manual_seed(0)
    model, guide = build_model(cfg), build_model(cfg)
    for p in (*model.parameters(), *guide.parameters()):
        torch.nn.init.normal_(p, std=0.05)
    return model.eval(), guide.eval(), cfg


@pytest.mark.parametrize("conditional", [False, True])
def test_autoguidance_moves_away_from_the_guide(conditional):
    extra = ["data.labels=auto", "model.num_classes=3"] if conditional else []
    model, guide, _ = _pair(*extra)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([10, 900])
    labels = torch.tensor([0, 3]) if conditional else None  # 3: the null class
    args = (x, t) if labels is None else (x, t, labels)
    with torch.no_grad():
        out, weak = model(*args), guide(*args)
        assert torch.allclose(AutoGuided(model, guide, 2.5)(*args), weak + 2.5 * (out - weak), atol=1e-6)
        assert torch.equal(AutoGuided(model, guide, 1.0)(*args), out)  # W = 1: the model alone, one pass
    assert AutoGuided(model, guide, 2.0).num_classes == (3 if conditional else 0)


@pytest.mark.parametrize("override,message", [
    ("data.resolution=16,model.attention_resolutions=[8]",
     "--guide g: its data.resolution is 16, the model's 8; a guide must be a weaker model"),
    ("diffusion.prediction=v", "--guide g: its diffusion.prediction is 'v', the model's 'eps'"),
    ("diffusion.timesteps=500", "--guide g: its diffusion.timesteps is 500, the model's 1000"),
])
def test_a_guide_of_other_images_or_another_process_is_refused_in_one_line(override, message):
    model = load_config("smoke", check_source=False).to_dict()
    other = load_config("smoke", override.split(","), check_source=False).to_dict()
    with pytest.raises(ValueError) as info:
        check_guide(model, other, "g")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    smaller = load_config("smoke", ["model.base_channels=8", "model.norm_groups=4"], check_source=False).to_dict()
    check_guide(model, smaller, "g")  # a smaller network of the same data and process guides


def test_a_guide_of_other_classes_as_many_is_refused_in_one_line():
    """Its class k would guide the model's class k: both checkpoints name their classes, and they must agree."""
    from raydiff.model.guidance import state_class_names

    config = load_config("smoke", ["model.num_classes=3", "data.labels=auto"], check_source=False).to_dict()
    model = {"config": config, "classes": {"names": ["zero", "one", "two"], "counts": [5, 5, 5]}}
    other = {"config": config, "classes": {"names": ["zero", "one", "car"], "counts": [5, 5, 5]}}
    with pytest.raises(ValueError) as info:
        check_guide(config, config, "g", class_names=(state_class_names(model), state_class_names(other)))
    assert str(info.value).startswith("--guide g: its class 2 is 'car', the model's 'two'; a guide must be a weaker")
    check_guide(config, config, "g", class_names=(state_class_names(model), state_class_names(dict(model))))
    check_guide(config, config, "g", class_names=(state_class_names(model), state_class_names({"config": config})))
