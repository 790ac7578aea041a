"""The DDPM UNet of Ho et al. (2020), in PyTorch.

Matches the reference TensorFlow model (`diffusion_tf/models/unet.py`, `diffusion_tf/nn.py`) layer for layer:
sinusoidal timestep embedding -> 2-layer MLP, residual blocks (GroupNorm, SiLU, 3x3 conv, timestep projection,
dropout, 3x3 conv; a 1x1 conv skip where the width changes), single-head self-attention at chosen resolutions,
stride-2 3x3 downsampling padded like TF's "SAME" (bottom and right only), nearest + 3x3 conv upsampling, and
skip connections from every down block. Also the reference's initialisation (variance scaling, fan_avg, uniform,
zero biases; scale ~0 for each block's last layer and the output conv, so a fresh model outputs ~0) and its
GroupNorm epsilon 1e-6 (`model.norm_eps`). With ch=128, mult (1,2,2,2), 2 res blocks and attention at 16x16 on
32x32 RGB it has Ho et al.'s 35.7M parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

ZERO_SCALE = 1e-10  # the reference's init_scale=0 ("1e-10 if scale == 0": TF's variance_scaling rejects 0)
Layer = TypeVar("Layer", nn.Conv2d, nn.Linear)


@torch.no_grad()
def variance_scaling_(weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """In place: TF's variance_scaling(scale, mode="fan_avg", distribution="uniform"), the reference's init of
    every conv and dense weight: uniform(-limit, limit), limit = sqrt(3 * scale / ((fan_in + fan_out) / 2)).
    `weight` is (out, in) or (out, in, kh, kw), as in torch; torch.nn.init has no fan_avg mode."""
    receptive = math.prod(weight.shape[2:])
    fan_in, fan_out = weight.shape[1] * receptive, weight.shape[0] * receptive
    limit = math.sqrt(3.0 * scale / ((fan_in + fan_out) / 2))
    return weight.uniform_(-limit, limit)


def _init(layer: Layer, scale: float = 1.0) -> Layer:
    """`layer` with the reference's init: variance-scaled weight, zero bias."""
    variance_scaling_(layer.weight, scale)
    assert layer.bias is not None  # every layer here is made with a bias
    nn.init.zeros_(layer.bias)
    return layer


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps, as in the DDPM reference code."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / (half - 1))
    angles = t.float()[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, temb_ch: int, dropout: float, groups: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=eps)
        self.conv1 = _init(nn.Conv2d(in_ch, out_ch, 3, padding=1))
        self.temb_proj = _init(nn.Linear(temb_ch, out_ch))
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = _init(nn.Conv2d(out_ch, out_ch, 3, padding=1), ZERO_SCALE)  # the block starts as its skip path
        # The reference's "nin_shortcut": a per-position dense layer, i.e. a 1x1 conv with the same fans.
        self.skip = _init(nn.Conv2d(in_ch, out_ch, 1)) if in_ch != out_ch else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, with a residual connection."""

    def __init__(self, ch: int, groups: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, ch, eps=eps)
        # The reference's q, k and v "NIN" layers (per-position dense layers), fused into one linear; each
        # third is initialised as the separate ch x ch layer it stands for, so its fans are (ch, ch).
        self.qkv = nn.Linear(ch, 3 * ch)
        for weight in self.qkv.weight.chunk(3):
            variance_scaling_(weight)
        nn.init.zeros_(self.qkv.bias)
        self.proj = _init(nn.Linear(ch, ch), ZERO_SCALE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (b, h*w, c)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        out = self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class Downsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = _init(nn.Conv2d(ch, ch, 3, stride=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TF's "SAME" padding for a stride-2 3x3 conv on an even size pads one row/column at the bottom/right
        # only; padding=1 on both sides would shift every output pixel's window by one.
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = _init(nn.Conv2d(ch, ch, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference's align_corners=True nearest resize equals plain nearest at exactly 2x.
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class UNet(nn.Module):
    """Predicts eps, v or x0 (the diffusion module decides which) from a noisy image and its timestep.

    :param resolution: input height and width (square images).
    :param in_channels: image channels (1 grayscale, 3 RGB); the output has the same number.
    :param base_channels: channels at the first level (Ho et al.: 128).
    :param channel_mult: per-level channel multipliers; each level after the first halves the resolution.
    :param num_res_blocks: residual blocks per level on the way down (one more on the way up).
    :param attention_resolutions: resolutions at which a self-attention block follows each res block.
    :param dropout: dropout inside residual blocks.
    :param norm_groups: GroupNorm groups (32 in the paper); every channel count must divide by it.
    :param norm_eps: GroupNorm epsilon (the reference's, tf.contrib's group_norm default: 1e-6).
    :param num_classes: classes of a class-conditional model (0: unconditional). A learned embedding of each
        class, plus one null class (id `num_classes`, the last) for the unconditional prediction of classifier-free
        guidance, is added to the timestep embedding (as ADM and diffusers' `num_class_embeds` do).
    """

    def __init__(
        self,
        *,
        resolution: int,
        in_channels: int,
        base_channels: int,
        channel_mult: tuple[int, ...],
        num_res_blocks: int,
        attention_resolutions: tuple[int, ...],
        dropout: float,
        norm_groups: int,
        norm_eps: float = 1e-6,
        num_classes: int = 0,
    ) -> None:
        super().__init__()
        self.base_channels = base_channels
        self.num_classes = num_classes
        temb_ch = 4 * base_channels
        self.temb = nn.Sequential(_init(nn.Linear(base_channels, temb_ch)), nn.SiLU(),
                                  _init(nn.Linear(temb_ch, temb_ch)))
        self.class_embed = nn.Embedding(num_classes + 1, temb_ch) if num_classes else None
        self.conv_in = _init(nn.Conv2d(in_channels, base_channels, 3, padding=1))

        def block(cin: int, cout: int) -> ResBlock:
            return ResBlock(cin, cout, temb_ch, dropout, norm_groups, norm_eps)

        def attn(ch: int) -> AttnBlock:
            return AttnBlock(ch, norm_groups, norm_eps)

        # Down path: remember the channels of every output that feeds a skip connection.
        self.down = nn.ModuleList()
        skip_channels = [base_channels]
        ch, res = base_channels, resolution
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers: list[nn.Module] = [block(ch, base_channels * mult)]
                ch = base_channels * mult
                if res in attention_resolutions:
                    layers.append(attn(ch))
                self.down.append(nn.ModuleList(layers))
                skip_channels.append(ch)
            if level != len(channel_mult) - 1:
                self.down.append(nn.ModuleList([Downsample(ch)]))
                skip_channels.append(ch)
                res //= 2

        self.mid = nn.ModuleList([block(ch, ch), attn(ch), block(ch, ch)])

        # Up path: each block consumes one skip connection.
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            for _ in range(num_res_blocks + 1):
                layers = [block(ch + skip_channels.pop(), base_channels * mult)]
                ch = base_channels * mult
                if res in attention_resolutions:
                    layers.append(attn(ch))
                self.up.append(nn.ModuleList(layers))
            if level != 0:
                self.up.append(nn.ModuleList([Upsample(ch)]))
                res *= 2

        self.norm_out = nn.GroupNorm(norm_groups, ch, eps=norm_eps)
        self.conv_out = _init(nn.Conv2d(ch, in_channels, 3, padding=1), ZERO_SCALE)  # a fresh model outputs ~0
        # train.activation_checkpointing: each residual and attention block keeps only its input for the backward
        # pass and computes its activations again there (more compute, much less memory at high resolutions).
        self.activation_checkpointing = False

    def _run_layers(self, layers: nn.ModuleList, h: torch.Tensor, temb: torch.Tensor,
                    skip: torch.Tensor | None = None) -> torch.Tensor:
        """The layers of one entry; `skip`: the down path's output that the entry's first res block concatenates
        to its input (on the way up)."""
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        fn: Callable[..., torch.Tensor]
        args: tuple[Any, ...]
        for layer in layers:
            if isinstance(layer, ResBlock):
                fn, args, skip = _concat_res, (layer, h, temb, skip), None
            else:
                fn, args = layer, (h,)
            if recompute and isinstance(layer, (ResBlock, AttnBlock)):
                # Non-reentrant: works under DDP's no_sync and torch.compile; the RNG state is restored for the
                # recomputation, so dropout draws the same masks twice. The concatenation is recomputed too:
                # kept, it would double what an up block keeps.
                h = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
            else:
                h = fn(*args)
        return h

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The prediction for noisy images `x` at timesteps `t`; `labels`: class ids of a class-conditional model
        (`num_classes`, the null class, asks for the unconditional prediction; None: every image unconditional)."""
        temb = self.temb(timestep_embedding(t, self.base_channels))
        if self.class_embed is not None:
            if labels is None:
                labels = torch.full((len(x),), self.num_classes, dtype=torch.long, device=x.device)
            temb = temb + self.class_embed(labels)
        elif labels is not None:
            raise ValueError("class labels given to an unconditional model (num_classes = 0)")
        hs = [self.conv_in(x)]
        for layers in self.down:
            assert isinstance(layers, nn.ModuleList)  # for the type checker: each entry is one
            hs.append(self._run_layers(layers, hs[-1], temb))
        h = self._run_layers(self.mid, hs[-1], temb)
        for layers in self.up:
            assert isinstance(layers, nn.ModuleList)
            h = self._run_layers(layers, h, temb, skip=hs.pop() if isinstance(layers[0], ResBlock) else None)
        return self.conv_out(F.silu(self.norm_out(h)))


def _concat_res(block: ResBlock, h: torch.Tensor, temb: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
    return block(h if skip is None else torch.cat([h, skip], dim=1), temb)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(cfg) -> UNet:
    """The UNet described by a `raydiff.config.Config` (activation checkpointing off: the training worker decides;
    `model.num_classes` resolved: the driver turns `auto` into the number of classes found)."""
    m = cfg.model
    if m.num_classes == "auto":
        raise ValueError("model.num_classes = auto is resolved from the data's labels first")
    return UNet(
        resolution=cfg.data.resolution, in_channels=cfg.data.channels, base_channels=m.base_channels,
        channel_mult=tuple(m.channel_mult), num_res_blocks=m.num_res_blocks,
        attention_resolutions=tuple(m.attention_resolutions), dropout=m.dropout, norm_groups=m.norm_groups,
        norm_eps=m.norm_eps, num_classes=m.num_classes,
    )
