"""Images from a trained network: a training state read from a run, a checkpoint or a diffusers folder, its
network loaded in fp32, and images generated so that image i is a pure function of (seed, i).

Why a module apart from `raydiff.sample`: the command reads its arguments and refuses a mistake before torch is
imported; the reading, loading and sampling it then does live here, where tests and other commands can call them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from raydiff.config import Config
from raydiff.config.schema import Sampler
from raydiff.model import diffusers_folder
from raydiff.model.diffusion import build_diffusion
from raydiff.model.guidance import AutoGuided
from raydiff.model.unet import build_model
from raydiff.runs.checkpoint import checkpoint_location, input_errors
from raydiff.runs.state import not_found_named, read_newest
from raydiff.seeds import GRID_NOISE


def generate(state: dict, *, num: int, sampler: Sampler, steps: int | None, eta: float, seed: int,
             use_ema: bool, batch: int, device: torch.device, labels: Sequence[int] | None = None,
             guidance: float = 1.0, guide: dict | None = None) -> torch.Tensor:
    """Images in [-1, 1] from a training state; image i is a pure function of (seed, i) (and `labels[i]`, its class,
    at `guidance`, for a class-conditional model), whatever `batch`. `guide`: the training state of a guiding
    model: autoguidance at `guidance` (both networks conditioned on the same classes)."""
    cfg = Config.from_dict(state["config"])
    model: torch.nn.Module = load_network(state, "ema" if use_ema else "model", device)
    if guide is not None:
        model, guidance = AutoGuided(model, load_network(guide, "ema", device), guidance), 1.0
    diffusion = build_diffusion(cfg)
    shape = (cfg.data.channels, cfg.data.resolution, cfg.data.resolution)
    chunks = diffusion.sample_in_chunks(model, range(num), shape, batch=batch, seed=seed, tag=GRID_NOISE,
                                        device=device, sampler=sampler, steps=steps, eta=eta, labels=labels,
                                        guidance=guidance)
    return torch.cat([images.cpu() for images in chunks])


def load_network(state: dict, weights: str, device: torch.device) -> torch.nn.Module:
    """A training state's network (`weights`: "ema" or "model"), in fp32 and eval mode, on `device`."""
    model = build_model(Config.from_dict(state["config"]))
    model.load_state_dict(state[weights] if weights in state else state["ema"])  # a diffusers folder: one set
    return model.float().eval().to(device)


def read_any(location: str, endpoint: str | None, *, flag: str = "--checkpoint") -> tuple[str, dict]:
    """(where, state) of a run or checkpoint folder (its newest checkpoint that reads) or a diffusers folder. A
    folder or file of it that cannot be read (a refused permission) is one line naming it (StorageFailure)."""
    where = f"{flag} {location}"
    folder = checkpoint_location(location, endpoint, where=where)  # first: a folder this user may not read
    with input_errors(where):
        exported = "://" not in location and diffusers_folder.is_diffusers_folder(location)
    if exported:
        # An exported pipeline: one set of weights, converted back to raydiff's names.
        return location, diffusers_folder.state_from_folder(location, where=where)
    with contextlib.nullcontext() if flag == "--checkpoint" else not_found_named(where):
        found, state = read_newest(folder, where=where)
    return str(found), state
