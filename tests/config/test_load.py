"""Loading configs: the presets, YAML files and `key=value` overrides, paths made absolute, and the one-line
errors for a missing preset, bad YAML or a missing data source."""

from __future__ import annotations

import pytest

from raydiff.config import ConfigError, load_config, preset_names
from raydiff.data.order import micro_batches, rank_share


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
    binary = tmp_path / "grid.png"  # a file that is no text at all (was UnicodeDecodeError's traceback)
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
    with pytest.raises(ConfigError, match=r"grid.png: not valid YAML \(not UTF-8 text: invalid start byte at byte "
                                          r"0\)$"):
        load_config(str(binary))
    with pytest.raises(ConfigError, match=f"^--config {tmp_path}: a folder, not a YAML file; give the file, or a "
                                          f"preset: {presets}$"):  # was: "no such file"
        load_config(str(tmp_path))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("trian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown section 'trian'"):
        load_config(str(wrong))


@pytest.mark.parametrize("text, where", [
    ("train:\n  ema_sigma_rels: [0.05, 0.1\n  seed: 3\n", "at line 3, column 7: expected ',' or ']', but got ':' "
                                                         "(while parsing a flow sequence at line 2, column 19)"),
    ("train:\n  seed: 1\n lr: 2\n", "at line 3, column 2: expected <block end>, but found '<block mapping start>' "
                                    "(while parsing a block mapping at line 1, column 1)"),
    ("train:\n\tlr: 1\n", "at line 2, column 1: found character '\\t' that cannot start any token"),
    ("train:\n  lr: !!float x\n", "(a tagged value it cannot build: could not convert string to float: 'x')"),
])
def test_a_yaml_mistake_is_one_line_saying_where_it_is_and_what(tmp_path, text, where):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    assert str(info.value) == f"{bad}: not valid YAML {where}"
