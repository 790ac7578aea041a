"""raydiff <-> diffusers: the UNet mapping, the scheduler, DDIM and DDPM sampling, and importing a UNet2DModel."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from diffusers import DDIMScheduler, DDPMScheduler, UNet2DModel
from torch import nn

from raydiff import cli, sample, train
from raydiff.config import ConfigError, load_config
from raydiff.model import diffusers_folder, diffusers_io
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import AttnBlock, ResBlock, UNet, build_model, variance_scaling_
from raydiff.runs.run_plan import identity_changes

# google/ddpm-cifar10-32's published UNet2DModel config (Ho et al.'s CIFAR-10 model as diffusers ships it).
GOOGLE_DDPM_CIFAR10 = {
    "sample_size": 32, "in_channels": 3, "out_channels": 3, "block_out_channels": [128, 256, 256, 256],
    "layers_per_block": 2, "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"], "attention_head_dim": None,
    "norm_num_groups": 32, "norm_eps": 1e-6, "act_fn": "silu", "time_embedding_type": "positional",
    "flip_sin_to_cos": False, "freq_shift": 1, "downsample_padding": 0,
}
# google/ddpm-church-256's (and -celebahq-256's, -bedroom-256's, -cat-256's) published UNet2DModel config: Ho et
# al.'s 256x256 model.
GOOGLE_DDPM_256 = {
    **GOOGLE_DDPM_CIFAR10, "sample_size": 256, "block_out_channels": [128, 128, 256, 256, 512, 512],
    "down_block_types": ["DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"],
}


def randomised(cfg, seed: int = 0) -> UNet:
    """The config's UNet with every weight random and non-zero: the layers initialised at ~0 (each residual
    branch's last layer, conv_out) get a real scale (0.1 for the branches, as in a trained model's small residual
    updates), biases and GroupNorm affines are drawn too, so that every mapped tensor matters."""
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ResBlock):
                variance_scaling_(module.conv2.weight, 0.1)
            elif isinstance(module, AttnBlock):
                variance_scaling_(module.proj.weight, 0.1)
            elif isinstance(module, nn.GroupNorm):
                module.weight.normal_(1.0, 0.05)
                module.bias.normal_(0.0, 0.02)
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.bias.normal_(0.0, 0.02)
        variance_scaling_(model.conv_out.weight)
    return model


def exported_unet(model: UNet, cfg) -> UNet2DModel:
    return diffusers_folder.build_pipeline(model.state_dict(), cfg).unet


@pytest.mark.parametrize("preset", ["smoke", "default", "cifar10"])
def test_exported_unet_computes_what_raydiffs_computes(preset):
    cfg = load_config(preset, check_source=False)
    model = randomised(cfg)
    unet = exported_unet(model, cfg)
    x = torch.randn(2, cfg.data.channels, cfg.data.resolution, cfg.data.resolution)
    t = torch.tensor([0, 999])
    with torch.no_grad():
        ours, theirs = model(x, t), unet(x, t).sample
    print(f"{preset}: max |raydiff - diffusers| = {(ours - theirs).abs().max().item():.2e} "
          f"(outputs up to {ours.abs().max().item():.2f})")
    assert ours.std() > 0.3  # a real output, not the ~0 of a fresh model
    # fp32 through the whole network: the error grows with the outputs and differs with the CPU's kernels (AVX2 or
    # AVX-512; docs/benchmarks.md#agreement-with-diffusers): 1e-5 of the largest output.
    torch.testing.assert_close(theirs, ours, atol=1e-5 * ours.abs().max().item(), rtol=0)
    # The mapping is a bijection: back to raydiff's names gives every tensor unchanged.
    back = diffusers_io.from_diffusers(unet.state_dict(), cfg)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_exported_scheduler_is_raydiffs_schedule(schedule):
    # diffusers' squaredcos_cap_v2 is Nichol & Dhariwal's alpha_bar with s = 0.008 and betas clipped at 0.999, as
    # raydiff's cosine; it computes in float32 where raydiff keeps float64 tables, hence the tolerances.
    cfg = load_config("default", [f"diffusion.schedule={schedule}"], check_source=False)
    diffusion = build_diffusion(cfg)
    scheduler = DDPMScheduler(**diffusers_io.scheduler_config(cfg))
    gap = (scheduler.alphas_cumprod.double() - diffusion.alpha_bar).abs().max().item()
    x0, noise = torch.rand(64, 1, 16, 16) * 2 - 1, torch.randn(64, 1, 16, 16)
    t = torch.randint(0, cfg.diffusion.timesteps, (64,))
    noised = (scheduler.add_noise(x0, noise, t) - diffusion.q_sample(x0, t, noise)).abs().max().item()
    print(f"{schedule}: max |alphas_cumprod - alpha_bar| = {gap:.2e}, max |add_noise - q_sample| = {noised:.2e}")
    assert gap < 1e-6 and noised < 1e-5


def _diffusers_ddim(unet: UNet2DModel, scheduler_config, x: torch.Tensor, steps: int) -> torch.Tensor:
    """diffusers' DDIM (eta 0) from `x`; raydiff recomputes eps from the clipped x0: use_clipped_model_output."""
    ddim = DDIMScheduler.from_config(scheduler_config)
    ddim.set_timesteps(steps)
    with torch.no_grad():
        for t in ddim.timesteps:
            x = ddim.step(unet(x, t).sample, t, x, use_clipped_model_output=True).prev_sample
    return x


def test_diffusers_samplers_reproduce_raydiffs():
    cfg = load_config("smoke", ["diffusion.timesteps=50"], check_source=False)
    T, shape = cfg.diffusion.timesteps, (4, 1, 8, 8)
    model, diffusion = randomised(cfg), build_diffusion(cfg)
    pipeline = diffusers_folder.build_pipeline(model.state_dict(), cfg)

    # DDIM over all T steps, from the same initial noise (raydiff draws it first from the generator).
    ours = diffusion.sample(model, shape, sampler="ddim", steps=T, generator=torch.Generator().manual_seed(0))
    theirs = _diffusers_ddim(pipeline.unet, pipeline.scheduler.config, torch.randn(shape, generator=torch.Generator()
                                                                                  .manual_seed(0)), T)
    print(f"DDIM, {T} steps: max |raydiff - diffusers| = {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)

    # DDPMPipeline draws its noise in raydiff's order, and linspace spacing respaces as raydiff does: the same
    # images at fewer steps too.
    for steps in (T, 10):
        ours = diffusion.sample(model, shape, sampler="ddpm", steps=steps, generator=torch.Generator().manual_seed(1))
        images = pipeline(batch_size=4, num_inference_steps=steps, generator=torch.Generator().manual_seed(1),
                          output_type="np").images
        theirs = torch.from_numpy(images).permute(0, 3, 1, 2) * 2 - 1
        print(f"DDPM, {steps} steps: max |raydiff - diffusers| = {(ours.clamp(-1, 1) - theirs).abs().max():.2e}")
        torch.testing.assert_close(theirs, ours.clamp(-1, 1), atol=1e-4, rtol=0)


def test_imports_google_ddpm_cifar10_exactly(tmp_path):
    torch.manual_seed(0)
    unet = UNet2DModel(**GOOGLE_DDPM_CIFAR10).eval()  # diffusers' own random initialisation: nothing is zero
    unet.save_pretrained(tmp_path / "unet")
    cfg = load_config("cifar10", [f"model.init_from={tmp_path}"], check_source=False)  # a pipeline-style folder
    model = build_model(cfg).eval()
    model.load_state_dict(diffusers_folder.load_diffusers_weights(cfg))
    x, t = torch.randn(2, 3, 32, 32), torch.tensor([3, 700])
    with torch.no_grad():
        ours, theirs = model(x, t), unet(x, t).sample
    print(f"google/ddpm-cifar10-32 shape: max |raydiff - diffusers| = {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)

    smoke = load_config("smoke", [f"model.init_from={tmp_path / 'unet'}"], check_source=False)  # a UNet folder
    with pytest.raises(ConfigError, match=r"data\.resolution = 8 here, but the UNet there has sample_size = 32$"):
        diffusers_folder.load_diffusers_weights(smoke)


def test_the_256_presets_fine_tune_the_published_256_models(tmp_path):
    """--config lsun256 --set model.init_from=google/ddpm-church-256: the published config (random weights here,
    nothing is downloaded) loads into the preset's model, which then computes what diffusers computes. Both 256
    presets have that model."""
    preset = "lsun256"
    assert load_config("celebahq256", check_source=False).model == load_config(preset, check_source=False).model
    torch.manual_seed(0)
    unet = UNet2DModel(**GOOGLE_DDPM_256).eval()
    assert sum(p.numel() for p in unet.parameters()) == 113_673_219
    unet.save_pretrained(tmp_path / "unet")
    cfg = load_config(preset, [f"model.init_from={tmp_path}"], check_source=False)
    model = build_model(cfg).eval()
    model.load_state_dict(diffusers_folder.load_diffusers_weights(cfg))
    x, t = torch.randn(1, 3, 256, 256), torch.tensor([500])
    with torch.no_grad():
        ours, theirs = model(x, t), unet(x, t).sample
    print(f"{preset}: max |raydiff - diffusers| = {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("override", "unet_key", "message"), [
    ("model.attention_resolutions=[8]", {}, r"model\.attention_resolutions = \[8\] here, but .* attends at \[16\]"),
    ("model.norm_eps=1e-5", {}, r"model\.norm_eps = 1e-05 here, but the UNet there has norm_eps = 1e-06"),
    ("model.channel_mult=[1,2,2]", {}, r"model\.base_channels x model\.channel_mult = \[128, 256, 256\] here"),
    (None, {"freq_shift": 0}, r"the UNet there has freq_shift = 0; raydiff's UNet needs 1"),
    (None, {"downsample_padding": 1}, r"downsample_padding = 1; raydiff's UNet needs 0"),
    (None, {"attention_head_dim": 8}, r"attention_head_dim = 8; raydiff's attention has one head"),
])
def test_a_unet_that_does_not_fit_the_run_is_refused_naming_the_key(override, unet_key, message):
    cfg = load_config("cifar10", [override] if override else [], check_source=False)
    with pytest.raises(ConfigError, match=message):
        diffusers_io.check_matches(cfg, {**GOOGLE_DDPM_CIFAR10, **unet_key}, where="model.init_from = 'x'")


def test_what_diffusers_cannot_express_is_refused():
    cfg = load_config("smoke", ["model.channel_mult=[2,2]"], check_source=False)
    with pytest.raises(ConfigError, match=r"^model\.channel_mult = \[2, 2\]: diffusers' UNet2DModel needs"):
        diffusers_io.unet_config(cfg)


def test_init_from_is_checked_cheaply_and_is_not_an_identity_key(tmp_path, capsys):
    (tmp_path / "not-a-unet").mkdir()
    with pytest.raises(ConfigError, match=r"^model\.init_from = '.*not-a-unet': must be a raydiff run or checkpoint "
                                          r"folder"):
        load_config("smoke", [f"model.init_from={tmp_path / 'not-a-unet'}"], check_source=False)
    # A missing folder is refused by a new run, which reads it, before anything is written (a continuing run
    # never reads it: tests/test_export.py).
    storage = tmp_path / "runs"
    code = cli.run(train.main, ["--config", "smoke", "--set", f"model.init_from={tmp_path / 'missing'}",
                                "--set", f"run.storage={storage}"])
    assert code == 2 and capsys.readouterr().err.strip() == (
        f"raydiff: config error: model.init_from = '{tmp_path / 'missing'}': no such folder, and not a Hugging Face "
        f"hub id such as google/ddpm-cifar10-32")
    assert not storage.exists()
    assert load_config("smoke", ["model.init_from=google/ddpm-cifar10-32"], check_source=False)  # a hub id
    old = load_config("smoke", check_source=False).to_dict()
    new = load_config("smoke", ["model.init_from=google/ddpm-cifar10-32"], check_source=False).to_dict()
    assert identity_changes(old, new) == []  # a continuing run is not refused over it


@pytest.mark.parametrize("damage", ["truncated", "missing", "a tensor short", "a tensor more"])
def test_a_diffusers_folder_whose_weights_cannot_be_read_is_refused_in_one_line(tmp_path, capsys, damage):
    """--checkpoint DIR and model.init_from=DIR (--guide DIR reads it as --checkpoint does): a weights file cut
    short by a failed copy, or not there, is named in one config error, not a traceback; so is one without a
    tensor of its config, or with one more (diffusers fills the first with fresh values and ignores the second,
    saying so only in its log)."""
    cfg = load_config("smoke", check_source=False)
    folder = tmp_path / "pipeline"
    UNet2DModel(**diffusers_io.unet_config(cfg)).save_pretrained(folder / "unet")
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "missing":
        weights.unlink()
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        if damage == "a tensor short":
            del tensors["conv_out.weight"]
        else:
            tensors["extra.weight"] = torch.zeros(1)
        save_file(tensors, weights)
    storage = tmp_path / "runs"
    for main, argv, where in (
            (train.main, ["--config", "smoke", "--set", f"model.init_from={folder}", "--set", f"run.storage={storage}"],
             f"model.init_from = '{folder}'"),
            (sample.main, ["--checkpoint", str(folder), "--out", str(tmp_path / "samples")], f"--checkpoint {folder}")):
        assert cli.run(main, argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # diffusers may log a notice before it
        assert err.startswith(f"raydiff: config error: {where}: cannot read the UNet's weights (") and err.endswith(")")
    assert not storage.exists() and not (tmp_path / "samples").exists()


# Class-conditional models.
CONDITIONAL = ["data.labels=auto", "model.num_classes=3"]


def test_a_conditional_unet_computes_what_diffusers_computes_for_given_labels():
    cfg = load_config("smoke", CONDITIONAL, check_source=False)
    model = randomised(cfg)
    unet = exported_unet(model, cfg)
    assert unet.config.num_class_embeds == 4  # the 3 classes and the null class, id 3
    assert torch.equal(unet.class_embedding.weight, model.class_embed.weight)
    x, t = torch.randn(4, 1, 8, 8), torch.tensor([0, 10, 500, 999])
    labels = torch.tensor([0, 2, 1, 3])  # 3: the null class, the unconditional branch of guidance
    with torch.no_grad():
        ours, theirs = model(x, t, labels), unet(x, t, class_labels=labels).sample
        unconditional = model(x, t)  # no labels: the null class for every image
    print(f"conditional: max |raydiff - diffusers| = {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(unconditional[3], ours[3], atol=0, rtol=0)
    assert (unconditional[:3] - ours[:3]).abs().amax(dim=(1, 2, 3)).min() > 1e-3  # the labels matter
    back = diffusers_io.from_diffusers(unet.state_dict(), cfg)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.fixture(scope="module")
def unets(tmp_path_factory):
    """Smoke-shaped UNet2DModel folders, conditional (3 classes) and unconditional."""
    root = tmp_path_factory.mktemp("unets")
    for name, overrides in (("conditional", CONDITIONAL), ("unconditional", [])):
        torch.manual_seed(0)
        cfg = load_config("smoke", overrides, check_source=False)
        UNet2DModel(**diffusers_io.unet_config(cfg)).save_pretrained(root / name)
    return root


def test_init_from_takes_a_conditional_unet2dmodel(unets):
    cfg = load_config("smoke", [*CONDITIONAL, f"model.init_from={unets / 'conditional'}"], check_source=False)
    model = build_model(cfg).eval()
    model.load_state_dict(diffusers_folder.load_diffusers_weights(cfg))
    unet = UNet2DModel.from_pretrained(unets / "conditional", low_cpu_mem_usage=False).eval()
    x, t, labels = torch.randn(2, 1, 8, 8), torch.tensor([3, 40]), torch.tensor([1, 3])
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, labels), unet(x, t, class_labels=labels).sample, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("unet", "overrides", "message"), [
    ("conditional", ["data.labels=auto", "model.num_classes=4"],
     r"model\.num_classes = 4 here, but the UNet there has num_class_embeds = 4 \(3 classes plus the null class\)$"),
    ("conditional", [], r"model\.num_classes = 0 \(unconditional\) here, but the UNet there has num_class_embeds = 4"),
    ("unconditional", CONDITIONAL,
     r"model\.num_classes = 3 here, but the UNet there is unconditional \(num_class_embeds = null\)$"),
    ("unconditional", ["data.labels=auto", "model.num_classes=auto"],
     r"model\.num_classes = auto here \(a class-conditional run\), but the UNet there is unconditional"),
])
def test_init_from_refuses_a_unet_with_other_classes_in_one_line(unets, unet, overrides, message):
    cfg = load_config("smoke", [*overrides, f"model.init_from={unets / unet}"], check_source=False)
    with pytest.raises(ConfigError, match=rf"^model\.init_from = '.*{unet}': {message}") as caught:
        diffusers_folder.load_diffusers_weights(cfg)
    assert "\n" not in str(caught.value)


def test_a_unet_whose_classes_raydiff_cannot_hold_is_refused():
    with pytest.raises(ConfigError, match=r"num_class_embeds = 1; raydiff needs null \(unconditional\) or the number "
                                          r"of classes plus one"):
        diffusers_io.model_keys_from_unet({**GOOGLE_DDPM_CIFAR10, "num_class_embeds": 1}, where="x")
    with pytest.raises(ConfigError, match=r"class_embed_type = 'timestep'; raydiff's UNet needs None"):
        diffusers_io.model_keys_from_unet({**GOOGLE_DDPM_CIFAR10, "class_embed_type": "timestep"}, where="x")


@pytest.mark.parametrize("file, text, problem", [
    ("scheduler/scheduler_config.json", "{bad",
     "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("raydiff_export.json", "[1,2", "not valid JSON (Expecting ',' delimiter: line 1 column 5 (char 4))"),
    ("raydiff_export.json", "[1,2]", "holds a list, not a mapping of keys to values"),
    ("raydiff_export.json", '{"classes": ["a", "b"]}', "its 'classes' is not a mapping of a list of names and a "
                                                       "list of image counts"),
    ("raydiff_export.json", '{"classes": {"names": ["a"], "counts": "xyz"}}',
     "its 'classes' is not a mapping of a list of names and a list of image counts"),
    ("raydiff_config.yaml", "model: {base_channels: 16", "not valid YAML (line 1, column 26: expected ',' or '}', "
                                                         "but got '<stream end>' (while parsing a flow mapping at "
                                                         "line 1, column 8))"),
    ("raydiff_config.yaml", "- 1\n- 2\n", "holds a list, not a mapping of keys to values"),
    ("raydiff_config.yaml", "model: 16\n", "expected sections of key: value pairs (data:, model:, train:, ...)"),
    ("raydiff_config.yaml", "model: {wings: 2}\n", "unknown key 'model.wings'"),
], ids=["scheduler cut short", "export info cut short", "export info a list", "classes a list",
        "class counts a string", "config cut short",
        "config a list", "config of no sections", "config of an unknown key"])
def test_a_diffusers_folder_with_a_malformed_side_file_is_refused_naming_it(tmp_path, capsys, file, text, problem):
    """raydiff.sample --checkpoint DIR (and --guide DIR) met the JSON or YAML parser's traceback, or a list's
    AttributeError."""
    cfg = load_config("smoke", check_source=False)
    folder = tmp_path / "pipeline"
    diffusers_folder.save_pipeline_folder(folder, {"config": cfg.to_dict(), "ema": build_model(cfg).state_dict(),
                                                   "step": 20, "images_seen": 320},
                                          use_ema=True, checkpoint="run", guidance=1.0)
    assert diffusers_folder.state_from_folder(folder, where="--checkpoint")["step"] == 20  # as exported, it reads
    (folder / file).write_text(text)
    with pytest.raises(ConfigError) as refused:
        diffusers_folder.state_from_folder(folder, where="--checkpoint")
    line = f"{folder / file}: {problem}"
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    assert cli.run(sample.main, ["--checkpoint", str(folder), "--out", str(tmp_path / "samples")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"raydiff: config error: {line}")
    assert not (tmp_path / "samples").exists()


LINEAR_T = "an int from 21 to 100000 (the linear schedule's largest beta, 20/T, must be < 1)"


def _exported_smoke_folder(tmp_path):
    """A smoke model exported as raydiff exports it: (the folder, its scheduler_config.json)."""
    cfg = load_config("smoke", check_source=False)
    folder = tmp_path / "pipeline"
    diffusers_folder.save_pipeline_folder(folder, {"config": cfg.to_dict(), "ema": build_model(cfg).state_dict(),
                                                   "step": 20, "images_seen": 320},
                                          use_ema=True, checkpoint="run", guidance=1.0)
    return folder, folder / "scheduler" / "scheduler_config.json"


@pytest.mark.parametrize("key, value, allowed", [
    ("num_train_timesteps", "1000", LINEAR_T),
    ("num_train_timesteps", None, LINEAR_T),
    ("num_train_timesteps", 0, LINEAR_T),
    ("num_train_timesteps", 1000.5, LINEAR_T),
    ("num_train_timesteps", True, LINEAR_T),
    ("beta_schedule", 5, '"linear" or "squaredcos_cap_v2" (cosine)'),
    ("beta_schedule", ["linear"], '"linear" or "squaredcos_cap_v2" (cosine)'),
    ("prediction_type", [], '"epsilon", "v_prediction" or "sample"'),
    ("prediction_type", None, '"epsilon", "v_prediction" or "sample"'),
    ("beta_start", "0.0001", "a number"),
    ("beta_end", None, "a number"),
    ("rescale_betas_zero_snr", True, "false (its schedules keep some signal at T-1, no zero terminal SNR)"),
], ids=["timesteps a string", "timesteps null", "timesteps 0", "timesteps a fraction", "timesteps true",
        "schedule a number", "schedule a list", "prediction a list", "prediction null", "beta_start a string",
        "beta_end null", "zero terminal SNR"])
def test_a_scheduler_value_of_another_kind_is_refused_naming_the_file_key_value_and_what_is_allowed(
        tmp_path, capsys, key, value, allowed):
    """raydiff.sample --checkpoint DIR met a TypeError's (a string or null divided, a list hashed) or a
    ZeroDivisionError's traceback; the rest named the flag, not the file. A zero-terminal-SNR rescale was taken
    silently, and sampled off the schedule the model was trained on."""
    folder, file = _exported_smoke_folder(tmp_path)
    file.write_text(json.dumps({**json.loads(file.read_text()), key: value}))
    line = f"{file}: {key} = {json.dumps(value)}; raydiff takes {allowed}"
    with pytest.raises(ConfigError) as refused:
        diffusers_folder.state_from_folder(folder, where="--checkpoint")
    assert str(refused.value) == line
    assert cli.run(sample.main, ["--checkpoint", str(folder), "--out", str(tmp_path / "samples")]) == 2
    assert capsys.readouterr().err == f"raydiff: config error: {line}\n"
    assert not (tmp_path / "samples").exists()


@pytest.mark.parametrize("key, value, problem", [
    ("block_out_channels", [0, 32], "raydiff needs a list of channel counts"),
    ("block_out_channels", 16, "raydiff needs a list of channel counts"),
    ("down_block_types", "DownBlock2D", "raydiff needs a list of block names"),
    ("layers_per_block", "1", "raydiff needs one number of blocks, 1 or more"),
    ("norm_num_groups", None, "raydiff needs a number of groups, 1 or more"),
    ("norm_eps", "x", "raydiff needs a number"),
    ("norm_eps", 0, "in raydiff's keys: model.norm_eps = 0.0: must be > 0"),
    ("sample_size", 0, "raydiff needs the image size"),
    ("sample_size", 9, "the UNet there is not one raydiff can build (in raydiff's keys: data.resolution = 9: must "
                       "be divisible by 2^(len(model.channel_mult)-1) = 2)"),
], ids=["a width of 0", "widths a number", "block names a string", "blocks a string", "groups null", "eps a string",
        "eps 0",
        "size 0", "a size its levels cannot halve"])
def test_a_unet_config_edited_wrong_is_refused_in_one_line_before_its_weights_are_read(tmp_path, capsys, key, value,
                                                                                       problem):
    """raydiff.sample --checkpoint DIR met a ZeroDivisionError's, TypeError's or ValueError's traceback from deep in
    the model, or (a size its levels cannot halve) sampled until the tensors' sizes did not match."""
    folder, _ = _exported_smoke_folder(tmp_path)
    config = folder / "unet" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), key: value}))
    with pytest.raises(ConfigError) as refused:
        diffusers_folder.state_from_folder(folder, where=f"--checkpoint {folder}")
    assert str(refused.value).startswith(f"--checkpoint {folder}: ") and problem in str(refused.value)
    assert cli.run(sample.main, ["--checkpoint", str(folder), "--out", str(tmp_path / "samples")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydiff: config error: ") and err.count("\n") == 1 and problem in err
    assert not (tmp_path / "samples").exists()


def test_a_folder_of_a_run_whose_config_today_s_rules_refuse_still_samples(tmp_path):
    """The UNet's own keys are checked against raydiff's rules, not the run's config beside them: a run of an older
    raydiff may hold values refused since (a blank eval.ref, a width below today's least), which sampling never
    reads."""
    folder, _ = _exported_smoke_folder(tmp_path)
    config = folder / "raydiff_config.yaml"
    tree = yaml.safe_load(config.read_text())
    tree["eval"]["ref"], tree["train"]["ema_sigma_rels"] = "", [1e-200]
    config.write_text(yaml.safe_dump(tree))
    assert diffusers_folder.state_from_folder(folder, where="--checkpoint")["step"] == 20


def test_a_folder_without_its_weights_file_or_read_as_a_guide_is_named_in_one_line(tmp_path, capsys):
    """diffusers printed its search for other weight files (and a notice of unsafe loading) before raydiff's line;
    a --guide folder that cannot be read was named as --checkpoint; --no-ema on a folder of one set of weights
    was passed over, and the start line said EMA."""
    folder, _ = _exported_smoke_folder(tmp_path)
    run = tmp_path / "samples"
    assert cli.run(sample.main, ["--checkpoint", str(folder), "--no-ema", "--out", str(run)]) == 2
    assert capsys.readouterr().err == (f"raydiff: error: --no-ema: {folder} is a diffusers folder and holds one set "
                                       f"of weights (EMA); leave out --no-ema, or use a checkpoint of the run\n")
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    for flags in (["--checkpoint", str(folder)], ["--checkpoint", str(_exported_smoke_folder(tmp_path / "b")[0]),
                                                  "--guide", str(folder)]):
        assert cli.run(sample.main, [*flags, "--out", str(run)]) == 2
        assert capsys.readouterr().err == (
            f"raydiff: config error: {flags[-2]} {folder}: cannot read the UNet's weights (no "
            f"diffusion_pytorch_model.safetensors or .bin in {folder / 'unet'})\n")
    assert not run.exists()


def test_a_folder_whose_scheduler_samples_otherwise_is_read_and_says_which_settings_raydiff_does_not_follow(
        tmp_path, capsys):
    """google/ddpm-cifar10-32's family publishes variance_type fixed_large: the model reads exactly, but raydiff's
    DDPM draws with the posterior variance (fixed_small). Said on one line, not silently."""
    folder, file = _exported_smoke_folder(tmp_path)
    capsys.readouterr()
    diffusers_folder.state_from_folder(folder, where="--checkpoint")
    assert "not used" not in capsys.readouterr().out  # raydiff's own export: nothing to say
    file.write_text(json.dumps({**json.loads(file.read_text()), "variance_type": "fixed_large",
                                "thresholding": True}))
    assert diffusers_folder.state_from_folder(folder, where="--checkpoint")["step"] == 20
    assert capsys.readouterr().out.splitlines()[-1] == (
        f'[raydiff] note: {file}: variance_type = "fixed_large", thresholding = true not used: raydiff samples with '
        f"its own samplers (DDPM with the posterior variance, fixed_small; x0 clipped to [-1, 1])")


def test_a_cosine_scheduler_takes_fewer_timesteps_than_a_linear_one():
    cosine = {"beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 2}
    assert diffusers_io.diffusion_keys_from_scheduler(cosine, where="x")["diffusion.timesteps"] == 2
    with pytest.raises(ConfigError, match=r'^x: num_train_timesteps = 1; raydiff takes an int from 2 to 100000$'):
        diffusers_io.diffusion_keys_from_scheduler({**cosine, "num_train_timesteps": 1}, where="x")


def test_a_unet_config_that_is_valid_json_but_no_mapping_is_refused_naming_it(tmp_path):
    """diffusers returns it as it is; dict() of it was a TypeError's traceback (model.init_from and --checkpoint)."""
    cfg = load_config("smoke", check_source=False)
    folder = tmp_path / "pipeline"
    UNet2DModel(**diffusers_io.unet_config(cfg)).save_pretrained(folder / "unet")
    (folder / "unet" / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as refused:
        diffusers_folder.read_unet_config(str(folder), where=f"--checkpoint {folder}")
    assert str(refused.value) == (f"--checkpoint {folder}: the UNet2DModel config there ({folder}/unet/config.json) "
                                  f"holds a list, not a mapping of keys to values; fix or replace it")
