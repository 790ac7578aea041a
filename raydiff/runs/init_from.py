"""`model.init_from`: the weights a new run starts from, read from wherever the user points.

Why: a fine-tune starts from a model trained before, most often one of the user's own runs: a raydiff run or
checkpoint folder (local, s3:// or gs://) gives its EMA weights, the weights its samples and export use (a
post-hoc average that `raydiff.ema` rebuilt is one too). A diffusers pipeline, `UNet2DModel` folder or hub id
goes through `raydiff.model.diffusers_folder`. Either way the weights are checked against the run's model before
anything starts, and only the weights are taken: the new run's own config says how it trains.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from raydiff.config import Config, ConfigError
from raydiff.config.checks import is_raydiff_run
from raydiff.model.diffusers_folder import load_diffusers_weights
from raydiff.model.diffusers_io import check_class_count, model_values
from raydiff.runs.checkpoint import checkpoint_location
from raydiff.runs.ema_snapshots import weights_of
from raydiff.runs.state import read_newest


class InitWeights(NamedTuple):
    weights: dict[str, torch.Tensor]  # raydiff's parameter names, fp32
    described: str  # which weights, for the start line ("" where the location says it all)


def load_init_weights(cfg: Config) -> InitWeights:
    """The weights `model.init_from` names, checked against the run's model (ConfigError, one line). With
    `model.num_classes = auto` a class-conditional model of any number of classes passes here: once the data has
    said how many, the driver compares them (`check_classes`)."""
    init_from = cfg.model.init_from
    assert init_from is not None  # called only for a run that sets model.init_from
    if not is_raydiff_run(init_from):
        return InitWeights(load_diffusers_weights(cfg), "")
    where = f"model.init_from = {init_from!r}"
    # A config this raydiff cannot read (a key a newer one wrote) is refused there, naming the checkpoint.
    checkpoint, state = read_newest(checkpoint_location(init_from, cfg.run.endpoint, where=where), where=where)
    check_same_model(cfg, Config.from_dict(state["config"]), where=where)
    weights = weights_of(state, checkpoint, use_ema=True)
    step = f", step {state['step']}" if "step" in state else ""
    # Each weight a tensor of its own: a GPU run's EMA is saved as views of one buffer, and the driver sends these
    # through Ray's object store, whose pickling would carry the whole buffer with every view (300 copies).
    own = {k: v.to(torch.float32, copy=True) for k, v in state["ema"].items()}
    return InitWeights(own, f"{checkpoint.name}{step}, {weights} weights")


def check_same_model(cfg: Config, theirs: Config, *, where: str) -> None:
    """ConfigError naming the first key whose value differs between the run's model and the one trained there."""
    their_classes = theirs.model.num_classes
    check_class_count(cfg.model.num_classes, their_classes, where=where,
                      there=f"the run there has {their_classes} classes" if their_classes else
                      "the run there is unconditional")
    their_values = model_values(theirs)
    for key, ours in model_values(cfg).items():
        if ours != their_values[key]:
            raise ConfigError(f"{where}: {key} = {ours!r} here, but the run there has {their_values[key]!r}")
