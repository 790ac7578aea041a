"""Hugging Face diffusers <-> raydiff: UNet2DModel and DDPMScheduler configs, and the UNet's weights, both ways.

raydiff's UNet is a diffusers `UNet2DModel` with Ho et al.'s settings, the same as `google/ddpm-cifar10-32`'s:
positional timestep embedding with `flip_sin_to_cos=False` (sin first) and `freq_shift=1` (frequencies divided
by half - 1), `downsample_padding=0` (diffusers then pads bottom/right by one like TF's "SAME", as raydiff's
`Downsample` does), one attention head per block (`attention_head_dim=None`: each block's own channels), attention
in the mid block, SiLU, GroupNorm with `model.norm_eps`. Block i of diffusers is level i of raydiff; the down and
up paths visit the same modules in the same order, so the mapping below is a renaming, plus the split of raydiff's
fused `qkv` linear into `to_q`, `to_k`, `to_v` (q, k, v order). A class-conditional model's `class_embed` (its
classes plus the null class, last) is diffusers' `class_embedding` with `num_class_embeds` = classes + 1: both add
it to the timestep embedding after the MLP. diffusers has no null class of its own; DiT's convention (the last id)
is raydiff's, and a caller passes it explicitly (UNet2DModel demands `class_labels` when it has the embedding).

The scheduler: T = `diffusion.timesteps`; linear betas with raydiff's scaled ends (1000/T x 1e-4 .. 1000/T x
0.02) or `squaredcos_cap_v2` for cosine (the same alpha_bar, betas clipped at 0.999 in both); clipped x0 (raydiff
clamps x0 to [-1, 1]); the posterior variance of raydiff's DDPM sampler (`fixed_small`); `linspace` timestep
spacing, which is raydiff's respacing (DDPMScheduler then visits the same timesteps at 2 or more steps).

diffusers and safetensors are an optional extra (`pip install "raydiff[diffusers]"`), imported where needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raydiff.config import Config, ConfigError
from raydiff.config.checks import MAX_TIMESTEPS, MIN_LINEAR_TIMESTEPS, MIN_TIMESTEPS

PREDICTION_TO_DIFFUSERS = {"eps": "epsilon", "v": "v_prediction", "x0": "sample"}
SCHEDULE_TO_DIFFUSERS = {"linear": "linear", "cosine": "squaredcos_cap_v2"}
RAYDIFF_CONFIG_FILE = "raydiff_config.yaml"  # the run's config, written beside the pipeline
EXPORT_INFO_FILE = "raydiff_export.json"  # where the weights came from: checkpoint, step, images seen, EMA or not
GUIDE_FOLDER = "guide_unet"  # export --guide: the guiding model's UNet2DModel, beside unet/
# UNet2DModel keys that raydiff's architecture fixes, with the value it needs (None: diffusers' default of None).
FIXED_UNET_KEYS = {
    "time_embedding_type": "positional", "flip_sin_to_cos": False, "freq_shift": 1, "downsample_padding": 0,
    "act_fn": "silu", "center_input_sample": False, "mid_block_type": "UNetMidBlock2D", "add_attention": True,
    "resnet_time_scale_shift": "default", "mid_block_scale_factor": 1, "downsample_type": "conv",
    "upsample_type": "conv", "class_embed_type": None, "attn_norm_num_groups": None,
}
CLASS_EMBED = ("class_embed.weight", "class_embedding.weight")  # raydiff's name, diffusers' name
_RES_RENAMES = {"temb_proj": "time_emb_proj", "skip": "conv_shortcut"}  # ResBlock -> ResnetBlock2D; others same
_ATTN_RENAMES = {"norm": "group_norm", "proj": "to_out.0"}  # AttnBlock -> Attention; qkv is split


def require_diffusers(what: str) -> None:
    """Raise ConfigError (one line) when diffusers or safetensors is not installed."""
    try:
        import diffusers  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs diffusers and safetensors: pip install \"raydiff[diffusers]\"") from None


# raydiff config -> diffusers configs.
def linear_beta_range(timesteps: int) -> tuple[float, float]:
    """raydiff's linear schedule: Ho et al.'s 1e-4 .. 0.02 at T=1000, scaled by 1000/T."""
    scale = 1000.0 / timesteps
    return scale * 1e-4, scale * 0.02


def level_resolutions(cfg: Config) -> list[int]:
    return [cfg.data.resolution // 2**i for i in range(len(cfg.model.channel_mult))]


def check_exportable(cfg: Config) -> None:
    """Refuse, naming the key, a config that UNet2DModel cannot express."""
    mult = list(cfg.model.channel_mult)
    if mult[0] != 1:
        # diffusers' conv_in and timestep embedding have block_out_channels[0] channels; raydiff's have base_channels.
        raise ConfigError(f"model.channel_mult = {mult}: diffusers' UNet2DModel needs the first multiplier to be 1 "
                          f"(its conv_in and timestep embedding are as wide as the first level)")
    if not isinstance(cfg.model.num_classes, int):
        raise ConfigError(f"model.num_classes = {cfg.model.num_classes!r}: an exported model needs the number of "
                          f"classes (a run's checkpoint records it)")
    levels = level_resolutions(cfg)
    for res in cfg.model.attention_resolutions:
        if res not in levels:
            raise ConfigError(f"model.attention_resolutions = {list(cfg.model.attention_resolutions)}: {res} is not "
                              f"one of the model's resolutions {levels}")


def unet_config(cfg: Config) -> dict[str, Any]:
    """UNet2DModel keyword arguments for the run's UNet (every key whose diffusers default differs is set)."""
    check_exportable(cfg)
    m = cfg.model
    attention = [res in m.attention_resolutions for res in level_resolutions(cfg)]
    fixed = {k: v for k, v in FIXED_UNET_KEYS.items() if v is not None}
    if m.num_classes:  # the classes plus the null class (the last id)
        fixed["num_class_embeds"] = int(m.num_classes) + 1
    return {
        "sample_size": cfg.data.resolution, "in_channels": cfg.data.channels, "out_channels": cfg.data.channels,
        "block_out_channels": [m.base_channels * x for x in m.channel_mult], "layers_per_block": m.num_res_blocks,
        "down_block_types": ["AttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        "up_block_types": ["AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention)],
        "attention_head_dim": None,  # one head: each block's own channels (an int would apply to every block)
        "norm_num_groups": m.norm_groups, "norm_eps": m.norm_eps, "dropout": m.dropout, **fixed,
    }


def scheduler_config(cfg: Config) -> dict[str, Any]:
    """DDPMScheduler keyword arguments for the run's diffusion process and raydiff's DDPM sampler."""
    d = cfg.diffusion
    beta_start, beta_end = linear_beta_range(d.timesteps)
    return {
        "num_train_timesteps": d.timesteps, "beta_schedule": SCHEDULE_TO_DIFFUSERS[d.schedule],
        "beta_start": beta_start, "beta_end": beta_end,  # used by "linear" only
        "prediction_type": PREDICTION_TO_DIFFUSERS[d.prediction],
        "clip_sample": True, "clip_sample_range": 1.0,  # raydiff clamps x0 to [-1, 1]
        "variance_type": "fixed_small",  # the posterior variance, as raydiff.sample --sampler ddpm
        "timestep_spacing": "linspace", "steps_offset": 0,  # raydiff's respacing: T-1 .. 0, evenly spaced
    }


# Weights: raydiff names <-> diffusers names.
def _module_pairs(cfg: Config) -> Iterator[tuple[str, str, str]]:
    """(raydiff prefix, diffusers prefix, kind) for every module with weights, in raydiff's construction order.
    kind: "res" (ResBlock), "attn" (AttnBlock) or "plain" (same parameter names on both sides)."""
    m = cfg.model
    levels = len(m.channel_mult)
    attention = [res in m.attention_resolutions for res in level_resolutions(cfg)]
    yield "temb.0", "time_embedding.linear_1", "plain"
    yield "temb.2", "time_embedding.linear_2", "plain"
    yield "conv_in", "conv_in", "plain"
    i = 0
    for level in range(levels):
        for j in range(m.num_res_blocks):
            yield f"down.{i}.0", f"down_blocks.{level}.resnets.{j}", "res"
            if attention[level]:
                yield f"down.{i}.1", f"down_blocks.{level}.attentions.{j}", "attn"
            i += 1
        if level != levels - 1:
            yield f"down.{i}.0", f"down_blocks.{level}.downsamplers.0", "plain"
            i += 1
    yield "mid.0", "mid_block.resnets.0", "res"
    yield "mid.1", "mid_block.attentions.0", "attn"
    yield "mid.2", "mid_block.resnets.1", "res"
    i = 0
    for k, level in enumerate(reversed(range(levels))):  # diffusers' up block k is raydiff's deepest level first
        for j in range(m.num_res_blocks + 1):
            yield f"up.{i}.0", f"up_blocks.{k}.resnets.{j}", "res"
            if attention[level]:
                yield f"up.{i}.1", f"up_blocks.{k}.attentions.{j}", "attn"
            i += 1
        if level != 0:
            yield f"up.{i}.0", f"up_blocks.{k}.upsamplers.0", "plain"
            i += 1
    yield "norm_out", "conv_norm_out", "plain"
    yield "conv_out", "conv_out", "plain"


def _take(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Remove and return the entries under `prefix.`, keyed by the rest of their name."""
    names = [k for k in state if k.startswith(prefix + ".")]
    return {k[len(prefix) + 1:]: state.pop(k) for k in names}


def _check_consumed(left: dict[str, torch.Tensor], side: str) -> None:
    if left:
        raise ValueError(f"{len(left)} {side} weights have no counterpart, e.g. {sorted(left)[:3]}")


def _class_embed(state: dict[str, torch.Tensor], cfg: Config, name: str, side: str) -> torch.Tensor | None:
    """Remove and return the class embedding (`name`) of `state`, checked against `cfg`'s model.num_classes
    (`auto`: whatever the weights have)."""
    weight = state.pop(name, None)
    classes = cfg.model.num_classes
    if classes == "auto":
        return weight
    rows = 0 if weight is None else weight.shape[0]
    if rows != (int(classes) + 1 if classes else 0):
        raise ValueError(f"{side} weights have {rows} class embeddings, but model.num_classes = {classes} needs "
                         f"{int(classes) + 1 if classes else 0}")
    return weight


def to_diffusers(state_dict: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """raydiff UNet weights -> UNet2DModel weights (modern attention names: to_q, to_k, to_v, to_out.0)."""
    state, out = dict(state_dict), {}
    classes = _class_embed(state, cfg, CLASS_EMBED[0], "raydiff")
    if classes is not None:
        out[CLASS_EMBED[1]] = classes
    for ours, theirs, kind in _module_pairs(cfg):
        params = _take(state, ours)
        if not params:
            raise ValueError(f"raydiff weights lack {ours}.*: they are not the UNet of this config")
        for name, value in params.items():
            module, _, leaf = name.rpartition(".")
            if kind == "res":
                out[f"{theirs}.{_RES_RENAMES.get(module, module)}.{leaf}"] = value
            elif kind == "attn" and module == "qkv":
                for part, chunk in zip(("to_q", "to_k", "to_v"), value.chunk(3), strict=True):
                    out[f"{theirs}.{part}.{leaf}"] = chunk.clone()
            elif kind == "attn":
                out[f"{theirs}.{_ATTN_RENAMES[module]}.{leaf}"] = value
            else:
                out[f"{theirs}.{name}"] = value
    _check_consumed(state, "raydiff")
    return out


def from_diffusers(state_dict: dict[str, torch.Tensor], cfg: Config) -> dict[str, torch.Tensor]:
    """UNet2DModel weights (modern attention names) -> raydiff UNet weights for `cfg`'s model."""
    state, out = dict(state_dict), {}
    back = {v: k for k, v in _RES_RENAMES.items()}
    classes = _class_embed(state, cfg, CLASS_EMBED[1], "diffusers")
    if classes is not None:
        out[CLASS_EMBED[0]] = classes
    for ours, theirs, kind in _module_pairs(cfg):
        params = _take(state, theirs)
        if not params:
            raise ValueError(f"diffusers weights lack {theirs}.*: they are not the UNet of this config")
        if kind == "attn":
            for leaf in ("weight", "bias"):
                for module, name in _ATTN_RENAMES.items():
                    out[f"{ours}.{module}.{leaf}"] = params.pop(f"{name}.{leaf}")
                out[f"{ours}.qkv.{leaf}"] = torch.cat([params.pop(f"{p}.{leaf}") for p in ("to_q", "to_k", "to_v")])
            _check_consumed(params, "diffusers")
            continue
        for name, value in params.items():
            module, _, leaf = name.rpartition(".")
            out[f"{ours}.{back.get(module, module)}.{leaf}" if kind == "res" else f"{ours}.{name}"] = value
    _check_consumed(state, "diffusers")
    return out


# diffusers configs -> raydiff keys.
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The UNet2DModel keys raydiff reads into its own, with the kind of value each must be to be read (the ranges of
# what they become are the config's rules, which the folder's reader checks).
_UNET_VALUES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("block_out_channels", lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(map(_count, v)),
     "a list of channel counts"),
    ("down_block_types", lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, str) for t in v),
     "a list of block names"),
    ("up_block_types", lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, str) for t in v),
     "a list of block names"),
    ("layers_per_block", _count, "one number of blocks, 1 or more"),
    ("norm_num_groups", _count, "a number of groups, 1 or more"),
    ("norm_eps", _number, "a number"),
    ("dropout", _number, "a number"),
)


def _unet_error(where: str, key: str, value: Any, needs: str) -> ConfigError:
    return ConfigError(f"{where}: the UNet there has {key} = {value!r}; {needs}")


def _with_defaults(unet: dict[str, Any]) -> dict[str, Any]:
    """A UNet2DModel config with diffusers' defaults for the keys it leaves out (a hand-written config may)."""
    import inspect

    from diffusers import UNet2DModel

    params = inspect.signature(UNet2DModel.__init__).parameters.values()
    return {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **unet}


def model_keys_from_unet(unet: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The raydiff keys (`data.resolution`, `data.channels`, `model.*`) of a UNet2DModel config; ConfigError,
    naming the diffusers key, for a UNet that raydiff's architecture cannot hold. `where` starts the message."""
    unet = _with_defaults(unet)
    for key, needed in FIXED_UNET_KEYS.items():
        if unet[key] != needed:
            raise _unet_error(where, key, unet[key], f"raydiff's UNet needs {needed!r}")
    for key, fits, needs in _UNET_VALUES:  # a hand edit gone wrong: refused here, not deep inside the model
        if not fits(unet[key]):
            raise _unet_error(where, key, unet[key], f"raydiff needs {needs}")
    size = unet["sample_size"]
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise _unet_error(where, "sample_size", size, "raydiff's UNet needs square images")
        size = size[0]
    if not _count(size):
        raise _unet_error(where, "sample_size", size, "raydiff needs the image size")
    channels = unet["in_channels"]
    if channels not in (1, 3) or unet["out_channels"] != channels:
        raise _unet_error(where, "in_channels/out_channels", [channels, unet["out_channels"]],
                          "raydiff needs 1 or 3 channels in and out")
    widths = list(unet["block_out_channels"])
    base = widths[0]
    if any(w % base for w in widths):
        raise _unet_error(where, "block_out_channels", widths, "raydiff needs multiples of the first")
    down, up = list(unet["down_block_types"]), list(unet["up_block_types"])
    if not set(down) <= {"DownBlock2D", "AttnDownBlock2D"} or len(down) != len(widths):
        raise _unet_error(where, "down_block_types", down, f"raydiff needs {len(widths)} of DownBlock2D and "
                          f"AttnDownBlock2D")
    attention = [t == "AttnDownBlock2D" for t in down]
    mirrored = ["AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention)]
    if up != mirrored:
        raise _unet_error(where, "up_block_types", up, f"raydiff's UNet needs the down path mirrored: {mirrored}")
    head_dim = unet["attention_head_dim"]
    attended = [w for w, a in zip(widths, attention, strict=True) if a] + [widths[-1]]  # the mid block always attends
    if head_dim is not None and any(w != head_dim for w in attended):
        raise _unet_error(where, "attention_head_dim", head_dim, f"raydiff's attention has one head: null, or the "
                          f"channels of every block with attention ({sorted(set(attended))})")
    embed = unet["time_embedding_dim"]
    if embed not in (None, 4 * base):
        raise _unet_error(where, "time_embedding_dim", embed, f"raydiff's UNet needs null or {4 * base}")
    class_embeds = unet["num_class_embeds"]
    if class_embeds is not None and (not isinstance(class_embeds, int) or class_embeds < 2):
        raise _unet_error(where, "num_class_embeds", class_embeds, "raydiff needs null (unconditional) or the "
                          "number of classes plus one (a null class, the last id)")
    return {
        "data.resolution": size, "data.channels": channels, "model.base_channels": base,
        "model.channel_mult": [w // base for w in widths], "model.num_res_blocks": unet["layers_per_block"],
        "model.attention_resolutions": [size // 2**i for i, a in enumerate(attention) if a],
        "model.dropout": float(unet["dropout"]), "model.norm_groups": unet["norm_num_groups"],
        "model.norm_eps": float(unet["norm_eps"]), "model.num_classes": (class_embeds or 1) - 1,
    }


def diffusion_keys_from_scheduler(scheduler: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The raydiff `diffusion.*` keys of a DDPM-style scheduler config (`where`, its file, starts the message);
    ConfigError naming the key, its value and what raydiff takes, for a value of another kind (a hand edit: "1000",
    null) or one that raydiff lacks."""

    def refuse(key: str, allowed: str) -> ConfigError:
        return ConfigError(f"{where}: {key} = {json.dumps(scheduler[key])}; raydiff takes {allowed}")

    if scheduler.get("trained_betas") is not None:
        raise ConfigError(f"{where}: trained_betas is set; raydiff has the linear and squaredcos_cap_v2 (cosine) "
                          f"schedules, not trained betas")
    if scheduler.get("rescale_betas_zero_snr"):  # a schedule raydiff would sample off
        raise refuse("rescale_betas_zero_snr", "false (its schedules keep some signal at T-1, no zero terminal SNR)")
    kind = scheduler.get("beta_schedule", "linear")
    if not isinstance(kind, str) or kind not in ("linear", "squaredcos_cap_v2"):
        raise refuse("beta_schedule", '"linear" or "squaredcos_cap_v2" (cosine)')
    predicts = scheduler.get("prediction_type", "epsilon")
    prediction = {v: k for k, v in PREDICTION_TO_DIFFUSERS.items()}.get(predicts) if isinstance(predicts, str) else None
    if prediction is None:
        raise refuse("prediction_type", '"epsilon", "v_prediction" or "sample"')
    timesteps = scheduler.get("num_train_timesteps", 1000)
    fewest = MIN_LINEAR_TIMESTEPS if kind == "linear" else MIN_TIMESTEPS
    if not _is_int(timesteps) or not fewest <= timesteps <= MAX_TIMESTEPS:
        raise refuse("num_train_timesteps", f"an int from {fewest} to {MAX_TIMESTEPS}" + (
            " (the linear schedule's largest beta, 20/T, must be < 1)" if kind == "linear" else ""))
    if kind == "squaredcos_cap_v2":
        return {"diffusion.timesteps": timesteps, "diffusion.schedule": "cosine", "diffusion.prediction": prediction}
    for key in ("beta_start", "beta_end"):
        if key in scheduler and (not isinstance(scheduler[key], int | float) or isinstance(scheduler[key], bool)):
            raise refuse(key, "a number")
    ends = scheduler.get("beta_start", 1e-4), scheduler.get("beta_end", 0.02)
    expected = linear_beta_range(timesteps)
    if any(abs(a - b) > 1e-6 * b for a, b in zip(ends, expected, strict=True)):
        raise ConfigError(f"{where}: beta_start, beta_end = {list(ends)}; raydiff's linear schedule at T = "
                          f"{timesteps} has {list(expected)}")
    return {"diffusion.timesteps": timesteps, "diffusion.schedule": "linear", "diffusion.prediction": prediction}


# How raydiff's samplers sample, as a diffusers scheduler config says it (diffusers' defaults): the DDPM posterior
# variance, x0 clipped to [-1, 1], no dynamic thresholding.
RAYDIFF_SAMPLING = {"variance_type": "fixed_small", "clip_sample": True, "clip_sample_range": 1.0,
                    "thresholding": False}


def unused_sampling_settings(scheduler: dict[str, Any]) -> list[str]:
    """The settings of a scheduler config that raydiff's samplers do not follow, as `key = value` (google's
    ddpm-cifar10-32 family has `variance_type = "fixed_large"`): the model reads right, its samples are
    raydiff's."""
    return [f"{key} = {json.dumps(scheduler[key])}" for key, ours in RAYDIFF_SAMPLING.items()
            if key in scheduler and scheduler[key] != ours]


def model_values(cfg: Config) -> dict[str, Any]:
    """The run keys that weights made for another run must share with this one: those that shape a weight, and
    the norm's epsilon (dropout may differ; the classes are compared apart)."""
    m = cfg.model
    return {"data.resolution": cfg.data.resolution, "data.channels": cfg.data.channels,
            "model.base_channels": m.base_channels, "model.channel_mult": list(m.channel_mult),
            "model.num_res_blocks": m.num_res_blocks,
            "model.attention_resolutions": sorted(set(m.attention_resolutions) & set(level_resolutions(cfg))),
            "model.norm_groups": m.norm_groups, "model.norm_eps": m.norm_eps}


_DIFFUSERS_NAME = {"data.resolution": "sample_size", "data.channels": "in_channels",
                   "model.base_channels": "block_out_channels[0]", "model.channel_mult": "block_out_channels",
                   "model.num_res_blocks": "layers_per_block", "model.attention_resolutions": "down_block_types",
                   "model.norm_groups": "norm_num_groups", "model.norm_eps": "norm_eps"}


def _classes_there(classes: int) -> str:
    if not classes:
        return "is unconditional (num_class_embeds = null)"
    return f"has num_class_embeds = {classes + 1} ({classes} classes plus the null class)"


def check_classes(weights: dict[str, torch.Tensor], num_classes: int, *, init_from: str, auto: bool = False) -> None:
    """ConfigError (one line naming model.num_classes) when raydiff UNet `weights` (what `load_init_weights`
    gives) do not have `num_classes` classes. For the driver once `model.num_classes = auto` is resolved
    (`auto`: say so in the message); an int model.num_classes is checked against the UNet's config before."""
    weight = weights.get(CLASS_EMBED[0])
    theirs = 0 if weight is None else weight.shape[0] - 1
    if theirs != num_classes:
        ours = f"auto = {num_classes} (the classes the data has)" if auto else str(num_classes)
        raise ConfigError(f"model.init_from = {init_from!r}: model.num_classes = {ours} here, but the UNet there "
                          f"{_classes_there(theirs)}")


def check_class_count(ours: int | str, theirs: int | str, *, where: str, there: str) -> None:
    """ConfigError when a run of `model.num_classes = ours` cannot start from a model of `theirs` classes (0:
    unconditional), described in the message as `there` ("the UNet there has ..."). `auto` takes any
    class-conditional model: `check_classes` compares the numbers once the data has said how many."""
    if ours == "auto" and not theirs:
        raise ConfigError(f"{where}: model.num_classes = auto here (a class-conditional run), but {there}")
    if ours != "auto" and ours != theirs:
        raise ConfigError(f"{where}: model.num_classes = {ours}{'' if ours else ' (unconditional)'} here, but "
                          f"{there}")


def check_matches(cfg: Config, unet: dict[str, Any], *, where: str) -> None:
    """ConfigError naming the first run key whose value differs from the UNet2DModel config's (dropout may
    differ: it shapes no weight; the classes as `check_class_count` says)."""
    unet = _with_defaults(unet)
    theirs = model_keys_from_unet(unet, where=where)
    their_classes = theirs["model.num_classes"]
    check_class_count(cfg.model.num_classes, their_classes, where=where,
                      there=f"the UNet there {_classes_there(their_classes)}")
    for key, ours in model_values(cfg).items():
        if key == "model.channel_mult" and ours != theirs[key]:
            widths = [cfg.model.base_channels * x for x in ours]
            raise ConfigError(f"{where}: model.base_channels x model.channel_mult = {widths} here, but the UNet there "
                              f"has block_out_channels = {unet['block_out_channels']}")
        if key == "model.attention_resolutions" and ours != theirs[key]:
            raise ConfigError(f"{where}: model.attention_resolutions = {ours} here, but the UNet there attends at "
                              f"{theirs[key]} (down_block_types = {unet['down_block_types']})")
        if ours != theirs[key]:
            raise ConfigError(f"{where}: {key} = {ours!r} here, but the UNet there has {_DIFFUSERS_NAME[key]} = "
                              f"{theirs[key]!r}")
