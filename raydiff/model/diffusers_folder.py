"""diffusers folders on disk (or hub ids): reading a UNet for `model.init_from` and `raydiff.sample`, and writing
an exported pipeline folder with its model card. The mapping itself is in `raydiff.model.diffusers_io`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from raydiff.config import Config, ConfigError
from raydiff.model.diffusers_io import (
    EXPORT_INFO_FILE,
    RAYDIFF_CONFIG_FILE,
    check_exportable,
    check_matches,
    diffusion_keys_from_scheduler,
    from_diffusers,
    model_keys_from_unet,
    require_diffusers,
    scheduler_config,
    to_diffusers,
    unet_config,
)


# Reading diffusers folders (or hub ids).
def is_diffusers_folder(location: str | Path) -> bool:
    """A local diffusers pipeline folder (model_index.json, or unet/config.json)."""
    path = Path(location).expanduser()
    return (path / "model_index.json").is_file() or (path / "unet" / "config.json").is_file()


def _unet_location(location: str) -> tuple[str, str | None]:
    """(path or hub id, subfolder) of the UNet in a pipeline folder, a UNet2DModel folder or a hub id."""
    path = Path(location).expanduser()
    if path.is_dir():
        return str(path), ("unet" if (path / "unet" / "config.json").is_file() else None)
    from diffusers import UNet2DModel

    try:  # a hub id: a pipeline repository (unet/ inside), else a UNet2DModel repository
        UNet2DModel.load_config(location, subfolder="unet")
        return location, "unet"
    except OSError:
        return location, None


def read_unet_config(location: str, *, where: str) -> tuple[dict[str, Any], str, str | None]:
    """The UNet2DModel config of `location`, with where the UNet is (path or hub id, subfolder)."""
    from diffusers import UNet2DModel

    try:
        source, subfolder = _unet_location(location)
        config = dict(UNet2DModel.load_config(source, subfolder=subfolder))
    except OSError as exc:
        raise ConfigError(f"{where}: no UNet2DModel config there ({str(exc).splitlines()[0]})") from None
    if config.get("_class_name", "UNet2DModel") != "UNet2DModel":
        raise ConfigError(f"{where}: the model there is a {config['_class_name']}; raydiff reads a UNet2DModel")
    return config, source, subfolder


def read_unet_weights(source: str, subfolder: str | None) -> dict[str, torch.Tensor]:
    """A UNet2DModel's weights in modern names (diffusers converts old checkpoints' attention names on load)."""
    from diffusers import UNet2DModel

    # low_cpu_mem_usage=False: the default asks for `accelerate` (a notice on every load) and saves nothing here.
    unet = UNet2DModel.from_pretrained(source, subfolder=subfolder, low_cpu_mem_usage=False)
    return {k: v.detach().float().clone() for k, v in unet.state_dict().items()}


def load_init_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """raydiff UNet weights for `model.init_from`, checked against the run's model first (ConfigError)."""
    init_from = cfg.model.init_from
    assert init_from is not None  # called only for a run that sets model.init_from
    where = f"model.init_from = {init_from!r}"
    from raydiff.config.checks import HUB_ID

    if not Path(init_from).expanduser().exists() and not HUB_ID.fullmatch(init_from):
        raise ConfigError(f"{where}: no such folder, and not a Hugging Face hub id such as google/ddpm-cifar10-32")
    require_diffusers("model.init_from")
    config, source, subfolder = read_unet_config(init_from, where=where)
    check_matches(cfg, config, where=where)
    return from_diffusers(read_unet_weights(source, subfolder), cfg)


def state_from_folder(location: str | Path) -> dict[str, Any]:
    """A diffusers pipeline folder as the parts of a training state that `raydiff.sample` uses: config, weights
    (as both `model` and `ema`: the folder holds one set) and step (when raydiff exported it)."""
    import yaml

    path = Path(location).expanduser()
    where = f"--checkpoint {location}"
    require_diffusers("a diffusers folder")
    unet, source, subfolder = read_unet_config(str(path), where=where)
    tree = yaml.safe_load((path / RAYDIFF_CONFIG_FILE).read_text()) if (path / RAYDIFF_CONFIG_FILE).is_file() else {}
    cfg = Config.from_dict(tree or {})
    keys = model_keys_from_unet(unet, where=where)
    for scheduler_file in (path / "scheduler" / "scheduler_config.json", path / "scheduler_config.json"):
        if scheduler_file.is_file():  # else the diffusion keys of raydiff_config.yaml, or raydiff's defaults
            keys.update(diffusion_keys_from_scheduler(json.loads(scheduler_file.read_text()), where=where))
            break
    for key, value in keys.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, tuple(value) if isinstance(value, list) else value)
    weights = from_diffusers(read_unet_weights(source, subfolder), cfg)
    info_file = path / EXPORT_INFO_FILE
    info: dict[str, Any] = json.loads(info_file.read_text()) if info_file.is_file() else {}
    exported = {"ema": "EMA", "online": "online"}.get(info.get("weights", ""), "exported")
    return {"model": weights, "ema": weights, "step": info.get("step"), "images_seen": info.get("images_seen"),
            "weights": exported, "config": cfg.to_dict()}


# Writing a pipeline folder.
def build_pipeline(weights: dict[str, torch.Tensor], cfg: Config):
    """A diffusers DDPMPipeline holding raydiff UNet `weights` (fp32) and the run's scheduler."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    # Any: mypy reads diffusers' top-level names as its torch-less dummy classes, which lack nn.Module's methods.
    unet: Any = UNet2DModel(**unet_config(cfg))
    unet.load_state_dict(to_diffusers({k: v.float() for k, v in weights.items()}, cfg), strict=True)
    return DDPMPipeline(unet=unet.eval(), scheduler=DDPMScheduler(**scheduler_config(cfg)))


def model_card(cfg: Config, *, step: int, images_seen: int, use_ema: bool, checkpoint: str) -> str:
    """README.md of an exported folder: what the model is and a 5-line example."""
    d, T = cfg.data, cfg.diffusion.timesteps
    weights = f"EMA (decay {cfg.train.ema_decay})" if use_ema else "online (not the EMA)"
    return f"""---
library_name: diffusers
pipeline_tag: unconditional-image-generation
tags: [ddpm, raydiff, unconditional-image-generation]
---

# DDPM `{cfg.run.name}`, trained with raydiff

An unconditional DDPM (Ho et al. 2020) trained with raydiff and exported to diffusers.

| | |
|---|---|
| dataset | `{d.source}` |
| resolution | {d.resolution} x {d.resolution}, {d.channels} channel(s) |
| training steps | {step:,} |
| images seen | {images_seen:,} |
| weights | {weights} |
| diffusion | T = {T}, {cfg.diffusion.schedule} schedule, predicts {cfg.diffusion.prediction} |
| exported from | `{checkpoint}` |

`{RAYDIFF_CONFIG_FILE}` is the run's full config.

```python
import torch
from diffusers import DDPMPipeline
pipe = DDPMPipeline.from_pretrained("path/to/this/folder")  # or its hub id
images = pipe(batch_size=16, num_inference_steps={T}, generator=torch.Generator().manual_seed(0)).images
images[0].save("sample.png")
```

`num_inference_steps` below {T} respaces the chain as `raydiff.sample --sampler ddpm --steps` does. For DDIM use
`DDIMPipeline(unet=pipe.unet, scheduler=pipe.scheduler)` with `use_clipped_model_output=True` (raydiff recomputes
eps from the clipped x0): at {T} steps it is raydiff's DDIM. Below {T} steps diffusers' DDIM strides by T // steps
where raydiff spaces the steps evenly from T-1 to 0: use `DDIMScheduler.from_config(pipe.scheduler.config,
timestep_spacing="trailing")`, which starts at T-1 as raydiff does but ends at T // steps - 1 instead of 0.
"""


def save_pipeline_folder(folder: Path, state: dict[str, Any], *, use_ema: bool, checkpoint: str) -> None:
    """Write a complete pipeline folder into `folder` (empty, local): model_index.json, unet/, scheduler/, the
    run's config, where it came from, and a README model card."""
    import yaml

    cfg = Config.from_dict(state["config"])
    check_exportable(cfg)
    pipeline = build_pipeline(state["ema" if use_ema else "model"], cfg)
    pipeline.save_pretrained(folder, safe_serialization=True)
    folder = Path(folder)
    (folder / RAYDIFF_CONFIG_FILE).write_text(yaml.safe_dump(state["config"], sort_keys=False))
    info = {"checkpoint": checkpoint, "step": state["step"], "images_seen": state["images_seen"],
            "weights": "ema" if use_ema else "online"}
    (folder / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (folder / "README.md").write_text(model_card(cfg, step=state["step"], images_seen=state["images_seen"],
                                                 use_ema=use_ema, checkpoint=checkpoint))
