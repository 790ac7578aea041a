"""diffusers folders on disk (or hub ids): reading a UNet for `model.init_from` and `raydiff.sample`, and writing
an exported pipeline folder with its model card. The mapping itself is in `raydiff.model.diffusers_io`.

A class-conditional model's class names travel in `raydiff_export.json` (and its model card), so that
`raydiff.sample --class NAME` works on the exported folder without the run; a class-conditional UNet2DModel from
elsewhere gets its ids as names. `DDPMPipeline` takes no labels: the card shows the few lines of guided sampling
with diffusers' own scheduler instead."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import torch

from raydiff.config import Config, ConfigError
from raydiff.config.checks import validate
from raydiff.config.load import read_record
from raydiff.model.diffusers_io import (
    EXPORT_INFO_FILE,
    GUIDE_FOLDER,
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
    unused_sampling_settings,
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


def _config_file(source: str, subfolder: str | None) -> str:
    return "/".join([source.rstrip("/"), *([subfolder] if subfolder else []), "config.json"])


def read_unet_config(location: str, *, where: str) -> tuple[dict[str, Any], str, str | None]:
    """The UNet2DModel config of `location`, with where the UNet is (path or hub id, subfolder)."""
    from diffusers import UNet2DModel

    try:
        source, subfolder = _unet_location(location)
        loaded = UNet2DModel.load_config(source, subfolder=subfolder)
    except OSError as exc:
        raise ConfigError(f"{where}: no UNet2DModel config there ({str(exc).splitlines()[0]})") from None
    if not isinstance(loaded, dict):  # valid JSON of another kind: diffusers returns it as it is
        raise ConfigError(f"{where}: the UNet2DModel config there ({_config_file(source, subfolder)}) holds a "
                          f"{type(loaded).__name__}, not a mapping of keys to values; fix or replace it")
    config = dict(loaded)
    if config.get("_class_name", "UNet2DModel") != "UNet2DModel":
        raise ConfigError(f"{where}: the model there is a {config['_class_name']}; raydiff reads a UNet2DModel")
    return config, source, subfolder


def read_unet_weights(source: str, subfolder: str | None, *, where: str) -> dict[str, torch.Tensor]:
    """A UNet2DModel's weights in modern names (diffusers converts old checkpoints' attention names on load); a
    weights file that is missing, truncated, of other shapes than its config, or without some of its tensors (which
    diffusers would fill with fresh values, saying so only in its log) is a ConfigError naming `where`."""
    from diffusers import UNet2DModel
    from safetensors import SafetensorError

    folder = Path(source, subfolder or "")
    if folder.is_dir() and not any((folder / f"diffusion_pytorch_model.{kind}{index}").is_file()  # or shards'
                                   for kind in ("safetensors", "bin") for index in ("", ".index.json")):  # index
        # refused before diffusers' warnings of its search for other names
        raise ConfigError(f"{where}: cannot read the UNet's weights (no diffusion_pytorch_model.safetensors or .bin "
                          f"in {folder})")
    try:
        # low_cpu_mem_usage=False: the default asks for `accelerate` (a notice on every load) and saves nothing here.
        unet, loading = UNet2DModel.from_pretrained(source, subfolder=subfolder, low_cpu_mem_usage=False,
                                                    output_loading_info=True)
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        # RuntimeError: torch's "Error(s) in loading state_dict", whose second line names the tensor.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        raise ConfigError(f"{where}: cannot read the UNet's weights ({' '.join(lines[:2])})") from None
    for kind, says in (("missing_keys", "lacks"), ("unexpected_keys", "holds tensors its config has no place for:")):
        names = sorted(loading.get(kind) or ())
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ConfigError(f"{where}: cannot read the UNet's weights (the weights file {says} {names[0]}{more})")
    return {k: v.detach().float().clone() for k, v in unet.state_dict().items()}


def load_diffusers_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """raydiff UNet weights for a `model.init_from` that names a diffusers folder or hub id (a raydiff run's:
    `raydiff.runs.init_from`), checked against the run's model first (ConfigError). With
    `model.num_classes = auto` any class-conditional UNet passes here: once the data has said how many classes
    there are, the driver calls `check_classes(weights, num_classes, init_from=..., auto=True)`."""
    init_from = cfg.model.init_from
    assert init_from is not None  # called only for a run that sets model.init_from
    where = f"model.init_from = {init_from!r}"
    from raydiff.config.checks import HUB_ID

    if not Path(init_from).expanduser().exists() and not HUB_ID.fullmatch(init_from):
        raise ConfigError(f"{where}: no such folder, and not a Hugging Face hub id such as google/ddpm-cifar10-32")
    require_diffusers("model.init_from")
    config, source, subfolder = read_unet_config(init_from, where=where)
    check_matches(cfg, config, where=where)
    return from_diffusers(read_unet_weights(source, subfolder, where=where), cfg)


def state_from_folder(location: str | Path, *, where: str) -> dict[str, Any]:
    """A diffusers pipeline folder as the parts of a training state that `raydiff.sample` uses: config, weights
    (as both `model` and `ema`: the folder holds one set), step (when raydiff exported it) and, for a
    class-conditional UNet, `classes` ({"names"}, and "counts" when raydiff recorded them; names default to the
    ids). `where` (the flag that named it) starts a ConfigError's line."""
    path = Path(location).expanduser()
    require_diffusers("a diffusers folder")
    unet, source, subfolder = read_unet_config(str(path), where=where)
    config_file = path / RAYDIFF_CONFIG_FILE
    tree = read_side_file(config_file) if config_file.is_file() else {}
    try:
        cfg = Config.from_dict(tree)
    except ConfigError as exc:  # not sections, a key this raydiff does not know, or a value of the wrong kind
        raise ConfigError(f"{config_file}: {exc}; fix or replace it") from None
    keys = model_keys_from_unet(unet, where=where)
    for scheduler_file in (path / "scheduler" / "scheduler_config.json", path / "scheduler_config.json"):
        if scheduler_file.is_file():  # else the diffusion keys of raydiff_config.yaml, or raydiff's defaults
            scheduler = read_side_file(scheduler_file)
            keys.update(diffusion_keys_from_scheduler(scheduler, where=str(scheduler_file)))
            unused = unused_sampling_settings(scheduler)
            if unused:
                print(f"[raydiff] note: {scheduler_file}: {', '.join(unused)} not used: raydiff samples with its own "
                      f"samplers (DDPM with the posterior variance, fixed_small; x0 clipped to [-1, 1])")
            break
    # The folder's keys on raydiff's defaults alone too, for its rules: the rest of its config is its run's, checked
    # when that ran (an older raydiff's may break today's rules, and sampling does not read them).
    alone = Config()
    for key, value in {**keys, **({"data.labels": "auto"} if keys["model.num_classes"] else {})}.items():
        section, name = key.split(".")  # data.labels: what a class-conditional config has (a foreign folder has none)
        for target in (cfg, alone):
            setattr(getattr(target, section), name, tuple(value) if isinstance(value, list) else value)
    try:  # a UNet raydiff's rules refuse (an image size its levels cannot halve), before its weights are read
        validate(alone, check_source=False)
    except ConfigError as exc:
        raise ConfigError(f"{where}: the UNet there is not one raydiff can build (in raydiff's keys: {exc})") from None
    unet_weights = read_unet_weights(source, subfolder, where=where)
    try:
        weights = from_diffusers(unet_weights, cfg)
    except ValueError as exc:  # names or shapes its config does not describe
        raise ConfigError(f"{where}: cannot read the UNet's weights ({exc})") from None
    info_file = path / EXPORT_INFO_FILE
    info = read_side_file(info_file) if info_file.is_file() else {}
    classes_info = info.get("classes") or {}
    if not (isinstance(classes_info, dict) and all(
            isinstance(classes_info.get(k) or [], list) for k in ("names", "counts")) and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in classes_info.get("counts") or [])):
        raise ConfigError(f"{info_file}: its 'classes' is not a mapping of a list of names and a list of image "
                          f"counts; fix or replace it")
    exported = {"ema": "EMA", "online": "online", "posthoc": "post-hoc EMA"}.get(info.get("weights", ""), "exported")
    if exported == "post-hoc EMA" and isinstance(info.get("sigma_rel"), (int, float)):
        exported += f" sigma_rel {info['sigma_rel']:g}"
    state: dict[str, Any] = {"model": weights, "ema": weights, "step": info.get("step"),
                             "images_seen": info.get("images_seen"), "weights": exported, "config": cfg.to_dict()}
    classes = recorded_classes({"classes": info.get("classes")}, cfg)  # None for an unconditional UNet
    if classes:
        state["classes"] = classes
    return state


def read_side_file(file: Path) -> dict[str, Any]:
    """A JSON or YAML (.yaml) file of a diffusers folder, as the mapping it holds ({} for an empty YAML file); a
    ConfigError (one line) naming it where it cannot be read or holds something else, rather than the parser's
    traceback: a copy cut short, an edit gone wrong."""
    kind = "YAML" if file.suffix == ".yaml" else "JSON"
    value, problem = read_record(lambda: file.read_text(encoding="utf-8"), kind)
    if problem:
        raise ConfigError(f"{file}: {problem}; fix or replace it")
    if value is None and kind == "YAML":
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{file}: holds a {type(value).__name__}, not a mapping of keys to values; fix or replace "
                          f"it")
    return value


# Writing a pipeline folder.
def build_pipeline(weights: dict[str, torch.Tensor], cfg: Config):
    """A diffusers DDPMPipeline holding raydiff UNet `weights` (fp32) and the run's scheduler."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    # Any: mypy reads diffusers' top-level names as its torch-less dummy classes, which lack nn.Module's methods.
    unet: Any = UNet2DModel(**unet_config(cfg))
    unet.load_state_dict(to_diffusers({k: v.float() for k, v in weights.items()}, cfg), strict=True)
    return DDPMPipeline(unet=unet.eval(), scheduler=DDPMScheduler(**scheduler_config(cfg)))


def recorded_classes(state: dict[str, Any], cfg: Config) -> dict[str, Any] | None:
    """The classes of a checkpoint of a class-conditional run ({"names", "counts"}, as the run recorded them; names
    default to the ids), None for an unconditional one."""
    num_classes = int(cfg.model.num_classes or 0)
    if not num_classes:
        return None
    recorded = state.get("classes") or {}
    names = [str(n) for n in recorded.get("names") or []]
    if len(names) != num_classes:
        return {"names": [str(i) for i in range(num_classes)]}
    counts = list(recorded.get("counts") or [])
    return {"names": names, **({"counts": [int(c) for c in counts]} if len(counts) == num_classes else {})}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def conditional_snippet(cfg: Config, *, label: int, guidance: float, name: str) -> str:
    """The model card's example: class `label` at `guidance` through diffusers' own scheduler, both branches in one
    batched forward (DDPMPipeline's __call__ takes no labels). tests/test_export.py runs it."""
    d, T, null = cfg.data, cfg.diffusion.timesteps, int(cfg.model.num_classes)
    return f"""```python
import torch
from diffusers import DDPMPipeline

pipe = DDPMPipeline.from_pretrained("path/to/this/folder")  # or its hub id
unet, scheduler = pipe.unet, pipe.scheduler
K, W, n = {label}, {guidance}, 16  # class {label} ({name!r}), guidance, images
labels, null = torch.full((n,), K), torch.full((n,), {null})  # id {null} is the null class (unconditional)
generator = torch.Generator().manual_seed(0)
x = torch.randn(n, {d.channels}, {d.resolution}, {d.resolution}, generator=generator)
scheduler.set_timesteps({T})
with torch.no_grad():
    for t in scheduler.timesteps:
        cond, uncond = unet(torch.cat([x, x]), t, class_labels=torch.cat([labels, null])).sample.chunk(2)
        x = scheduler.step(uncond + W * (cond - uncond), t, x, generator=generator).prev_sample
pipe.numpy_to_pil((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy())[0].save("sample.png")
```"""


def autoguided_snippet(cfg: Config, *, guidance: float, label: int | None) -> str:
    """The model card's example of autoguidance: the model and the guide (guide_unet/) at weight `guidance`,
    through diffusers' own scheduler; a class-conditional model and its guide both get class `label`.
    tests/test_export.py runs it."""
    d, T = cfg.data, cfg.diffusion.timesteps
    labels = "" if label is None else ", class_labels=labels"
    label_line = "" if label is None else f"\nlabels = torch.full((n,), {label})  # class {label}, for both networks"
    return f"""```python
import torch
from diffusers import DDPMPipeline, UNet2DModel

pipe = DDPMPipeline.from_pretrained("path/to/this/folder")  # or its hub id
guide = UNet2DModel.from_pretrained("path/to/this/folder", subfolder="{GUIDE_FOLDER}")
unet, scheduler = pipe.unet, pipe.scheduler
W, n = {guidance}, 16  # the autoguidance weight (1 = the model alone), images{label_line}
generator = torch.Generator().manual_seed(0)
x = torch.randn(n, {d.channels}, {d.resolution}, {d.resolution}, generator=generator)
scheduler.set_timesteps({T})
with torch.no_grad():
    for t in scheduler.timesteps:
        good, weak = unet(x, t{labels}).sample, guide(x, t{labels}).sample
        x = scheduler.step(weak + W * (good - weak), t, x, generator=generator).prev_sample
pipe.numpy_to_pil((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy())[0].save("sample.png")
```"""


def _autoguidance_section(cfg: Config, guide: dict[str, Any] | None, conditional: bool) -> str:
    if guide is None:
        return ""
    unconditional = "" if conditional else "; it helps unconditional models too, where classifier-free guidance cannot"
    return f"""
## Autoguidance

`{GUIDE_FOLDER}/` is a weaker model of the same data (`{guide['checkpoint']}`, step {guide['step']:,}) that guides
this one (Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of Itself"): eps = eps_guide +
W (eps_model - eps_guide), W = 1 the model alone{unconditional}. This example samples at W = {guide['guidance']:g};
`raydiff.evaluate --guide` measures several weights.

{autoguided_snippet(cfg, guidance=guide['guidance'], label=0 if conditional else None)}
"""


def model_card(cfg: Config, *, step: int, images_seen: int, use_ema: bool, checkpoint: str,
               guidance: float, classes: dict[str, Any] | None = None, posthoc: dict[str, Any] | None = None,
               guide: dict[str, Any] | None = None) -> str:
    """README.md of an exported folder: what the model is and a short example (for a class-conditional model,
    `classes` as `recorded_classes` gives them: its classes, and guided sampling at `guidance`); with `guide`
    ({"checkpoint", "step", "guidance"}: the guide_unet/ beside it), sampling with autoguidance too."""
    d, T = cfg.data, cfg.diffusion.timesteps
    weights = f"EMA (decay {cfg.train.ema_decay})" if use_ema else "online (not the EMA)"
    if posthoc:
        snapshots = posthoc["snapshots"]
        weights = (f"post-hoc EMA (EDM2), sigma_rel {posthoc['sigma_rel']:g}, rebuilt from {snapshots} "
                   f"snapshot{'' if snapshots == 1 else 's'}")
    if classes:
        names, counts = classes["names"], classes.get("counts")
        front = "tags: [ddpm, raydiff, class-conditional, classifier-free-guidance]"
        what = (f"A class-conditional DDPM (Ho et al. 2020) with classifier-free guidance (Ho & Salimans 2022), "
                f"{len(names)} classes, trained with raydiff and exported to diffusers.")
        rows = "\n".join(f"| {i} | `{_cell(n)}` |" + (f" {counts[i]:,} |" if counts else "")
                         for i, n in enumerate(names))
        head = "| id | name |" + (" training images |" if counts else "")
        rule = "|---|---|" + ("---|" if counts else "")
        example = f"""## Classes

{head}
{rule}
{rows}

The UNet's `num_class_embeds` is {len(names) + 1}: the {len(names)} classes and a null class, id {len(names)} (the
last), the unconditional branch of classifier-free guidance. `raydiff_export.json` lists the class names too.

## Sample a class

`DDPMPipeline` takes no labels, so sample with its UNet and scheduler in a plain loop. The guidance W follows
diffusers' convention: eps = eps_uncond + W (eps_cond - eps_uncond); W = 1 is conditional sampling without
guidance, W = 0 unconditional (any label), larger W follows the class more closely at the cost of diversity.

{conditional_snippet(cfg, label=0, guidance=guidance, name=names[0])}

`raydiff.sample --checkpoint path/to/this/folder --class {shlex.quote(names[0])} --guidance {guidance}` samples the
same way (its images differ: raydiff draws each image's noise from a generator of its own). Fewer than {T} steps in
`set_timesteps` respace the chain as `raydiff.sample --sampler ddpm --steps` does."""
    else:
        front = "pipeline_tag: unconditional-image-generation\ntags: [ddpm, raydiff, unconditional-image-generation]"
        what = "An unconditional DDPM (Ho et al. 2020) trained with raydiff and exported to diffusers."
        example = f"""```python
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

In 20 network evaluations, DPM-Solver++ (2M) on the diffusion SDE is `raydiff.sample --sampler dpmpp_2m_sde`
(which also clamps each predicted x0 to [-1, 1]; `algorithm_type="dpmsolver++"` is its deterministic `dpmpp_2m`):

```python
from diffusers import DPMSolverMultistepScheduler
pipe.scheduler = DPMSolverMultistepScheduler.from_config(
    pipe.scheduler.config, algorithm_type="sde-dpmsolver++", final_sigmas_type="zero", timestep_spacing="linspace")
images = pipe(batch_size=16, num_inference_steps=20, generator=torch.Generator().manual_seed(0)).images
```"""
    return f"""---
library_name: diffusers
{front}
---

# DDPM `{cfg.run.name}`, trained with raydiff

{what}

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

{example}
{_autoguidance_section(cfg, guide, bool(classes))}"""


def save_pipeline_folder(folder: Path, state: dict[str, Any], *, use_ema: bool, checkpoint: str,
                         guidance: float, guide: dict[str, Any] | None = None) -> None:
    """Write a complete pipeline folder into `folder` (empty, local): model_index.json, unet/, scheduler/, the
    run's config, where it came from (and a class-conditional model's classes), and a README model card (whose
    example of a class-conditional model samples at `guidance`). `guide` ({"state", "checkpoint", "guidance"}: a
    guiding model's training state, checked with `check_guide`) adds its EMA UNet as guide_unet/, and sampling
    with autoguidance at that weight to the card."""
    import yaml

    cfg = Config.from_dict(state["config"])
    check_exportable(cfg)
    pipeline = build_pipeline(state["ema" if use_ema else "model"], cfg)
    pipeline.save_pretrained(folder, safe_serialization=True)
    folder = Path(folder)
    # safetensors writes its files readable by their owner alone; the folder's other files are as any new file.
    file_mode = (folder / "model_index.json").stat().st_mode & 0o777
    (folder / RAYDIFF_CONFIG_FILE).write_text(yaml.safe_dump(state["config"], sort_keys=False))
    classes = recorded_classes(state, cfg)
    info: dict[str, Any] = {"checkpoint": checkpoint, "step": state["step"], "images_seen": state["images_seen"],
                            "weights": "posthoc" if state.get("posthoc") else "ema" if use_ema else "online"}
    if state.get("posthoc"):
        info["sigma_rel"] = state["posthoc"]["sigma_rel"]
    if classes:
        info["classes"] = classes
    card_guide = None
    if guide is not None:
        guide_state = guide["state"]
        guide_unet = build_pipeline(guide_state["ema"], Config.from_dict(guide_state["config"])).unet
        guide_unet.save_pretrained(folder / GUIDE_FOLDER, safe_serialization=True)
        card_guide = info["guide"] = {"checkpoint": guide["checkpoint"], "step": guide_state["step"],
                                      "guidance": guide["guidance"]}
    for weights_file in folder.rglob("*.safetensors"):
        weights_file.chmod(file_mode)
    (folder / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (folder / "README.md").write_text(model_card(cfg, step=state["step"], images_seen=state["images_seen"],
                                                 use_ema=use_ema, checkpoint=checkpoint, classes=classes,
                                                 guidance=guidance, posthoc=state.get("posthoc"), guide=card_guide))
