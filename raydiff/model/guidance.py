"""Autoguidance (Karras et al. 2024): a model guided by a weaker version of itself, an earlier checkpoint of the same
run or a smaller or shorter-trained model of the same data, out = guide + W (model - guide).

Why it helps where classifier-free guidance cannot (an unconditional model): the guide makes the same kinds of
errors as the model, only more of them, so moving away from it removes errors rather than diversity. W = 1 is the
model alone. The network output is linear in eps for every prediction target at a given x_t and t, so guiding the
output guides eps. A class-conditional model is guided with both networks conditioned on the same classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

AUTOGUIDANCE = 2.0  # the weight without --guidance


class AutoGuided(nn.Module):
    """`model` guided by `guide` at `weight` (one pass of each per step; the model alone at weight 1)."""

    def __init__(self, model: nn.Module, guide: nn.Module, weight: float) -> None:
        super().__init__()
        self.model, self.guide, self.weight = model, guide, weight
        self.num_classes = int(getattr(model, "num_classes", 0) or 0)  # what sampling asks of a conditional model

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        inputs = (x, t) if labels is None else (x, t, labels)
        out = self.model(*inputs)
        if self.weight == 1:
            return out
        guide = self.guide(*inputs)
        return guide + self.weight * (out - guide)


# The keys a guide must share with the model: what its output means.
GUIDE_KEYS = (("data", "resolution"), ("data", "channels"), ("diffusion", "prediction"), ("diffusion", "timesteps"),
              ("diffusion", "schedule"), ("model", "num_classes"))


WEAKER = ("a guide must be a weaker model of the same data and process (an earlier checkpoint of the run, or a "
          "smaller or shorter-trained model)")


def check_guide(model_config: dict[str, Any], guide_config: dict[str, Any], guide: str, *,
                class_names: tuple[list[str] | None, list[str] | None] = (None, None)) -> None:
    """ValueError, one line naming the first key that differs, unless `guide`'s network predicts what the model's
    does for the same images (resolution, channels, prediction target, schedule, classes). `class_names`: the
    model's and the guide's, where their checkpoints record them (`state_class_names`): class k must be one class
    in both."""
    for section, key in GUIDE_KEYS:
        ours = model_config.get(section, {}).get(key)
        theirs = guide_config.get(section, {}).get(key)
        if ours != theirs:
            raise ValueError(f"--guide {guide}: its {section}.{key} is {theirs!r}, the model's {ours!r}; {WEAKER}")
    ours, theirs = class_names
    if ours is not None and theirs is not None:
        for k, (name, guide_name) in enumerate(zip(ours, theirs, strict=True)):  # as many: model.num_classes
            if name != guide_name:
                raise ValueError(f"--guide {guide}: its class {k} is {guide_name!r}, the model's {name!r}; {WEAKER}")


def state_class_names(state: dict[str, Any]) -> list[str] | None:
    """The class names a checkpoint's state records (a class-conditional run's), or None."""
    names = (state.get("classes") or {}).get("names")
    return None if names is None else [str(name) for name in names]
