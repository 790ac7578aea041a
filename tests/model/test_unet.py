from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from raydiff.config import Config, load_config
from raydiff.model.unet import (
    AttnBlock,
    Downsample,
    ResBlock,
    UNet,
    build_model,
    count_parameters,
    timestep_embedding,
    variance_scaling_,
)


def _tiny() -> UNet:
    return UNet(resolution=8, in_channels=3, base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
                attention_resolutions=(4,), dropout=0.0, norm_groups=4).eval()


def _zero_init_layers(model: UNet) -> list[nn.Module]:
    """The layers the reference initialises with init_scale=0: each residual branch's last layer and conv_out."""
    return ([model.conv_out] + [m.conv2 for m in model.modules() if isinstance(m, ResBlock)]
            + [m.proj for m in model.modules() if isinstance(m, AttnBlock)])


def _fan_avg_limit(weight: torch.Tensor, scale: float = 1.0) -> float:
    """TF's variance_scaling(fan_avg, uniform) bound, fans from torch's (out, in, *kernel) layout."""
    receptive = math.prod(weight.shape[2:])
    fan_in, fan_out = weight.shape[1] * receptive, weight.shape[0] * receptive
    return math.sqrt(3 * scale / ((fan_in + fan_out) / 2))


def _assert_fan_avg_uniform(weight: torch.Tensor, limit: float) -> None:
    assert weight.abs().max() <= limit
    assert weight.var().item() == pytest.approx(limit**2 / 3, rel=0.1)  # the variance of uniform(-limit, limit)


def test_cifar10_preset_has_ho_et_al_parameter_count():
    assert count_parameters(build_model(load_config("cifar10", check_source=False))) == 35_746_307  # "35.7M"


def test_output_shape_matches_input_for_each_preset():
    for name, channels in (("default", 1), ("smoke", 1)):
        cfg = load_config(name)
        model = build_model(cfg).eval()
        x = torch.randn(2, channels, cfg.data.resolution, cfg.data.resolution)
        assert model(x, torch.tensor([0, 999])).shape == x.shape


@torch.no_grad()
def test_fresh_model_outputs_zero_and_the_timestep_matters_once_trained():
    torch.manual_seed(0)
    model = _tiny()
    x, t = torch.randn(4, 3, 8, 8) * 3, torch.tensor([0, 1, 500, 999])
    # Init scale 1e-10 is a variance: those weights are 1e-5 of a scale-1 layer's, and so is the output.
    assert model(x, t).abs().max() < 1e-3
    for layer in _zero_init_layers(model):  # stand-in for training: give the zero-init layers real weights
        variance_scaling_(layer.weight)
    out = model(x, t)
    assert out.abs().mean() > 0.05
    assert not torch.allclose(model(x[:1], torch.tensor([1])), model(x[:1], torch.tensor([500])), atol=1e-4)


@torch.no_grad()
def test_layers_have_the_reference_fan_avg_uniform_init():
    torch.manual_seed(0)
    model = build_model(Config())  # base 32, mult (1, 2, 2): the first level-2 block widens 32 -> 64
    block = next(m for m in model.modules() if isinstance(m, ResBlock) and m.conv1.in_channels != m.conv1.out_channels)
    layers = {"conv 3x3": block.conv1, "conv 1x1 skip": block.skip, "temb proj": block.temb_proj,
              "temb dense": model.temb[0], "downsample": next(m.conv for m in model.modules()
                                                              if isinstance(m, Downsample))}
    assert _fan_avg_limit(block.conv1.weight) == pytest.approx(math.sqrt(3 / ((32 * 9 + 64 * 9) / 2)))
    for name, layer in layers.items():
        _assert_fan_avg_uniform(layer.weight, _fan_avg_limit(layer.weight))
        assert torch.count_nonzero(layer.bias) == 0, name


@torch.no_grad()
def test_fused_qkv_is_initialised_as_three_separate_layers():
    torch.manual_seed(0)
    attn = next(m for m in build_model(Config()).modules() if isinstance(m, AttnBlock))
    ch = attn.qkv.in_features
    for third in attn.qkv.weight.chunk(3):
        assert third.shape == (ch, ch)
        _assert_fan_avg_uniform(third, math.sqrt(3 / ch))  # fan_avg of (ch, ch), not of (ch, 3 ch)
    assert torch.count_nonzero(attn.qkv.bias) == 0


@torch.no_grad()
def test_zero_init_layers_are_effectively_zero():
    torch.manual_seed(0)
    layers = _zero_init_layers(build_model(Config()))
    # conv_out; residual blocks: 3 down, 2 mid, 6 up; attention at 8x8: 1 down, 1 mid, 2 up
    assert len(layers) == 1 + 11 + 4
    for layer in layers:
        assert 0 < layer.weight.abs().max() <= _fan_avg_limit(layer.weight, scale=1e-10)
        assert torch.count_nonzero(layer.bias) == 0


def test_every_group_norm_uses_the_configured_eps():
    assert Config().model.norm_eps == 1e-6
    cfg = Config()
    cfg.model.norm_eps = 3e-5
    norms = [m for m in build_model(cfg).modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) > 10 and all(norm.eps == cfg.model.norm_eps for norm in norms)


@torch.no_grad()
def test_downsampling_pads_like_tf_same():
    down = Downsample(1)
    nn.init.ones_(down.conv.weight)
    nn.init.zeros_(down.conv.bias)
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 2, 2] = 1.0
    # TF "SAME" (pad bottom/right): output (i, j) sees rows and columns 2i..2i+2, so pixel 2 is in windows 0 and 1.
    expected = torch.zeros(1, 1, 4, 4)
    expected[0, 0, :2, :2] = 1.0
    assert torch.equal(down(x), expected)


def test_timestep_embedding_is_sinusoidal():
    emb = timestep_embedding(torch.tensor([0, 10]), 8)
    assert emb.shape == (2, 8)
    assert torch.allclose(emb[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert torch.allclose(emb[1, 0], torch.sin(torch.tensor(10.0)))


def _losses_and_grads(model: UNet, checkpointed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward and backward pass in training mode (dropout on) from a fixed RNG state; also the bytes the
    autograd graph keeps for the backward pass."""
    model.activation_checkpointing = checkpointed
    model.train()
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(0)
    x, t = torch.randn(4, 3, 16, 16, generator=generator), torch.tensor([1, 250, 500, 999])
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.manual_seed(1)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x, t)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())


def test_activation_checkpointing_gives_the_same_outputs_and_gradients_and_keeps_less():
    torch.manual_seed(0)
    model = UNet(resolution=16, in_channels=3, base_channels=16, channel_mult=(1, 2), num_res_blocks=2,
                 attention_resolutions=(8,), dropout=0.3, norm_groups=4)
    for p in model.parameters():  # away from the zero init, so every gradient is non-trivial
        p.data.add_(0.02 * torch.randn_like(p))
    out, grads, kept = _losses_and_grads(model, checkpointed=False)
    out_ckpt, grads_ckpt, kept_ckpt = _losses_and_grads(model, checkpointed=True)
    assert torch.equal(out, out_ckpt)  # the same dropout masks: the RNG state is restored for the recomputation
    for name, grad in grads.items():
        assert torch.allclose(grads_ckpt[name], grad, rtol=1e-5, atol=1e-7), name
    assert kept_ckpt < kept / 2  # only the blocks' inputs are kept
    model.eval()
    with torch.no_grad():  # evaluation and sampling never recompute
        assert torch.equal(model(torch.zeros(1, 3, 16, 16), torch.tensor([5])),
                           model(torch.zeros(1, 3, 16, 16), torch.tensor([5])))
