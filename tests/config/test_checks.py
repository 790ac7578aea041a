"""Loading and checking configs: presets, overrides coerced by type, and every refused value in one line naming
its key (the rules of `raydiff.config.checks`)."""

from __future__ import annotations

from typing import get_type_hints

import pytest
from conftest import ROOT

from raydiff.config import Config, ConfigError, all_keys, load_config, preset_names
from raydiff.data.order import micro_batches, rank_share

INTERFACE_KEYS = [
    "data.source", "data.resolution", "data.channels", "model.base_channels", "model.channel_mult",
    "model.num_res_blocks", "model.attention_resolutions", "model.dropout", "diffusion.timesteps",
    "diffusion.schedule", "diffusion.prediction", "train.global_batch", "train.micro_batch", "train.lr",
    "train.warmup_steps", "train.total_steps", "train.grad_clip", "train.precision", "train.ema_decay",
    "train.ema_warmup_steps", "train.checkpoint_every", "train.sample_every", "train.log_every", "train.seed",
    "scaling.num_workers", "scaling.use_gpu", "run.name", "run.storage", "run.max_failures",
    "run.keep_checkpoints",
]


def test_interface_keys_exist():
    assert set(INTERFACE_KEYS) <= set(all_keys())


@pytest.mark.parametrize("name", ["default", "smoke", "digits", "cifar10"])
def test_presets_load(name):
    assert name in preset_names()
    cfg = load_config(name, check_source=name != "cifar10")
    assert cfg.run.name == name


def test_cifar10_preset_is_the_ddpm_paper_setup():
    cfg = load_config("cifar10", check_source=False)
    assert (cfg.model.base_channels, cfg.model.channel_mult, cfg.model.num_res_blocks) == (128, (1, 2, 2, 2), 2)
    assert cfg.model.attention_resolutions == (16,) and cfg.model.dropout == 0.1
    assert (cfg.diffusion.timesteps, cfg.diffusion.schedule, cfg.diffusion.prediction) == (1000, "linear", "eps")
    t = cfg.train
    assert (t.lr, t.global_batch, t.warmup_steps, t.grad_clip, t.ema_decay) == (2e-4, 128, 5000, 1.0, 0.9999)


@pytest.mark.parametrize("name", ["cifar10", "cifar10-aws", "cifar10-gcp", "cifar10-k8s"])
def test_cifar10_presets_are_ho_et_al_in_every_setting(name):
    cfg = load_config(name, check_source=False)
    m, t = cfg.model, cfg.train
    assert (cfg.data.resolution, cfg.data.channels, cfg.data.flip) == (32, 3, True)
    assert (m.base_channels, m.channel_mult, m.num_res_blocks, m.attention_resolutions) == (128, (1, 2, 2, 2), 2, (16,))
    assert (m.dropout, m.norm_groups, m.norm_eps) == (0.1, 32, 1e-6)
    assert (cfg.diffusion.timesteps, cfg.diffusion.schedule, cfg.diffusion.prediction) == (1000, "linear", "eps")
    assert (t.lr, t.global_batch, t.warmup_steps, t.total_steps) == (2e-4, 128, 5000, 800_000)
    assert (t.grad_clip, t.weight_decay, t.ema_decay, t.ema_warmup_steps) == (1.0, 0.0, 0.9999, 0)


def test_overrides_are_coerced_by_type(tmp_path):
    cfg = load_config("default", [
        "train.lr=1e-4",  # YAML 1.1 reads this as a string
        "model.channel_mult=[1,2]",
        "model.attention_resolutions=8",
        "scaling.use_gpu=false",
        "train.micro_batch=16",
        f"run.storage={tmp_path}",
    ])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.model.channel_mult == (1, 2)
    assert cfg.model.attention_resolutions == (8,)
    assert cfg.scaling.use_gpu is False
    assert cfg.micro_batch_for(2) == 16 and len(micro_batches(rank_share(64, 2, 0), 16)) == 2  # accumulation 2


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("default", ["run.storage=out"])
    assert cfg.run.storage == str(tmp_path / "out")


def test_round_trip_through_plain_dict():
    cfg = load_config("default", ["model.channel_mult=[1,2]", "model.attention_resolutions=[]"])
    tree = cfg.to_dict()
    assert tree["model"]["channel_mult"] == [1, 2]
    assert Config.from_dict(tree) == cfg


@pytest.mark.parametrize("override, fragment", [
    ("train.lrr=1", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("nosuch.key=1", "unknown key 'nosuch.key'"),
    ("train.lr=-1", "train.lr = -1.0: must be > 0"),
    ("train.lr=fast", "train.lr = 'fast': expected a finite number | null"),
    ("train.total_steps=1.5", "train.total_steps = 1.5: expected integer"),
    ("train.precision=fp8", "train.precision = 'fp8': expected auto | fp32 | bf16 | fp16"),
    ("diffusion.schedule=quadratic", "expected linear | cosine"),
    ("diffusion.prediction=score", "expected eps | v | x0"),
    ("scaling.use_gpu=maybe", "expected auto | true | false"),
    ("train.global_batch=63", "not reachable with scaling.num_workers = 2"),
    ("train.micro_batch=24", "not reachable as micro_batch x 2 workers x accumulation"),
    ("data.source=/no/such/folder", "data.source = '/no/such/folder': no such file or folder"),
    ("data.source=builtin:mnist", "builtin sources: builtin:digits"),
    ("data.resolution=10", "must be divisible by"),
    ("model.attention_resolutions=[5]", "each must be one of the model's resolutions [16, 8, 4]"),
    ("model.norm_groups=24", "must divide every channel count"),
    ("model.norm_eps=0", "model.norm_eps = 0.0: must be > 0"),
    ("model.dropout=1.0", "must be in [0, 1)"),
    ("train.compile=turbo", "train.compile = 'turbo': auto, true, false, or a torch.compile backend: "),
    ("train.channels_last=maybe", "train.channels_last"),
    ("train.ema_decay=1", "must be in [0, 1)"),
    ("run.name=a/b", "use letters, digits"),
    ("train.lr", "expected key=value"),
    ("eval.num=1", "eval.num = 1: must be >= 2"),
    ("eval.metrics=[fid,is]", "eval.metrics = ['fid', 'is']: must be a list of fid and/or kid"),
    ("eval.features=clip", "eval.features = 'clip': expected auto | inception | digits"),
    ("eval.inception_weights=/no/such.pth", "eval.inception_weights = '/no/such.pth': no such file"),
    ("eval.sampler=euler", "expected ddim | ddpm"),
    ("train.loss_weighting=huber", "train.loss_weighting = 'huber': expected uniform | min_snr"),
    ("train.min_snr_gamma=0", "train.min_snr_gamma = 0.0: must be > 0"),
])
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("default", [override])
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def _numeric_keys() -> list[str]:
    """Every key whose type admits a float (float, float | None, ...)."""
    cfg = Config()
    return [key for key in all_keys()
            if "float" in str(get_type_hints(type(getattr(cfg, key.split(".")[0])))[key.split(".")[1]])]


@pytest.mark.parametrize("key", _numeric_keys())
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", ".nan"])
def test_non_finite_numbers_are_refused_for_every_numeric_key(key, value):
    with pytest.raises(ConfigError) as info:
        load_config("default", [f"{key}={value}"])
    assert str(info.value).startswith(f"{key} = ")
    assert "expected a finite number" in str(info.value) or "expected list of finite numbers" in str(info.value)


def test_missing_source_is_an_error():
    with pytest.raises(ConfigError, match="data.source"):
        load_config("cifar10")


def test_unknown_preset_and_bad_yaml(tmp_path):
    presets = "celebahq256, cifar10, cifar10-aws, cifar10-gcp, cifar10-k8s, default, digits, lsun256, smoke"
    with pytest.raises(ConfigError, match=f"presets: {presets}"):
        load_config("nosuch")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        load_config(str(wrong))


@pytest.mark.parametrize("timesteps", [2, 20])
def test_linear_schedule_refuses_too_few_timesteps(timesteps):
    """The linear schedule's largest beta is 20/T: T <= 20 would give alpha_bar <= 0 and NaN."""
    with pytest.raises(ConfigError) as info:
        load_config("smoke", [f"diffusion.timesteps={timesteps}"])
    message = str(info.value)
    assert f"diffusion.timesteps = {timesteps}: must be >= 21 with diffusion.schedule = linear" in message
    assert "\n" not in message
    assert load_config("smoke", ["diffusion.schedule=cosine", f"diffusion.timesteps={timesteps}"])


def test_smallest_linear_schedule_gives_finite_tables():
    import torch

    from raydiff.model.diffusion import build_diffusion

    diffusion = build_diffusion(load_config("smoke", ["diffusion.timesteps=21"]))
    assert diffusion.betas.max().item() < 1 and diffusion.alpha_bar.min().item() > 0
    tables = diffusion.tables_on(torch.device("cpu"))
    assert all(torch.isfinite(table).all() for table in tables.values()) and tables["alpha_bar"].min().item() > 0


def test_digits_features_need_the_digits_and_dashboards_need_their_package(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="eval.features = 'digits': digits features apply to data.source = builtin"):
        load_config("default", ["eval.features=digits", f"data.source={tmp_path}"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    needs = r"log.wandb_project = 'p': needs the wandb package: pip install 'raydiff\[wandb\]'"
    with pytest.raises(ConfigError, match=needs):
        load_config("default", ["log.wandb_project=p"])


def test_an_optional_package_older_than_raydiff_needs_is_refused(monkeypatch):
    """wandb older than 0.19.10 has no reinit="create_new" (it would fail in the middle of a run)."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.18.7" if name == "wandb" else real(name))
    with pytest.raises(ConfigError) as info:
        load_config("default", ["log.wandb_project=p"])
    assert str(info.value) == ("log.wandb_project = 'p': needs wandb >= 0.19.10 (installed: 0.18.7): pip install -U "
                               "'raydiff[wandb]'")


def test_pyproject_declares_the_package_floors_raydiff_checks():
    import tomllib
    from packaging.requirements import Requirement

    from raydiff.config.checks import PACKAGE_FLOORS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = [Requirement(r) for group in extras.values() for r in group if not r.startswith("raydiff")]
    for package, floor in PACKAGE_FLOORS.items():
        specifiers = [str(r.specifier) for r in declared if r.name == package]
        assert specifiers and set(specifiers) == {f">={floor}"}, (package, specifiers)


def test_every_rule_names_a_key_of_the_schema():
    from raydiff.config.checks import LATER_RULES, RULES

    keys = set(all_keys())
    assert {rule.key for rule in (*RULES, *LATER_RULES)} <= keys
    assert len(RULES) + len(LATER_RULES) >= 70  # the table holds the rules (none left behind in code)


def test_cuda_graphs_need_the_step_compiled():
    with pytest.raises(ConfigError) as info:
        load_config("default", ["train.compile=false", "train.cuda_graphs=true"])
    assert str(info.value) == ("train.cuda_graphs = True: needs train.compile = true or auto (CUDA graphs are "
                               "torch.compile's reduce-overhead mode)")
