"""Loading configs: the presets, YAML files and `key=value` overrides, paths made absolute, and the one-line
errors for a missing preset, bad YAML, a key given twice, a string YAML would change, an unreadable or empty
--config, or a missing data source."""

from __future__ import annotations

from pathlib import Path

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


PRESETS = "celebahq256, cifar10, cifar10-aws, cifar10-gcp, cifar10-k8s, default, digits, lsun256, smoke"


def test_unknown_preset_and_bad_yaml(tmp_path):
    presets = PRESETS
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


def _refusal(path, text: str) -> tuple:
    """(path, the ConfigError's line) of a config file holding `text`."""
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), check_source=False)
    return path, str(info.value)


@pytest.mark.parametrize("text, where", [
    ("train:\n  ema_sigma_rels: [0.05, 0.1\n  seed: 3\n", "at line 3, column 7: expected ',' or ']', but got ':' "
                                                         "(while parsing a flow sequence at line 2, column 19)"),
    ("train:\n  seed: 1\n lr: 2\n", "at line 3, column 2: expected <block end>, but found '<block mapping start>' "
                                    "(while parsing a block mapping at line 1, column 1)"),
    ("train:\n\tlr: 1\n", "at line 2, column 1: found character '\\t' that cannot start any token"),
    ("train:\n  lr: !!float x\n", "(a tagged value it cannot build: could not convert string to float: 'x')"),
])
def test_a_yaml_mistake_is_one_line_saying_where_it_is_and_what(tmp_path, text, where):
    bad, refusal = _refusal(tmp_path / "bad.yaml", text)
    assert refusal == f"{bad}: not valid YAML {where}"


@pytest.mark.parametrize("text, line", [
    ("run:\n  name: 0123\n", 'line 2: run.name = 0123, which YAML reads as the integer 123: a string is expected; '
                             'quote it in the file: "0123"'),
    ("run:\n  name: 1.10\n", 'line 2: run.name = 1.10, which YAML reads as the number 1.1: a string is expected; '
                             'quote it in the file: "1.10"'),
    ("run:\n  name: yes\n", 'line 2: run.name = yes, which YAML reads as true: a string is expected; quote it in '
                            'the file: "yes"'),
    ("run:\n  name: 2024-01-15T10:00:00Z\n", 'line 2: run.name = 2024-01-15T10:00:00Z, which YAML reads as the '
                                             'timestamp 2024-01-15 10:00:00+00:00: a string is expected; quote it in '
                                             'the file: "2024-01-15T10:00:00Z"'),
])
def test_a_string_in_a_file_that_yaml_reads_as_another_value_is_refused_with_the_text_to_quote(tmp_path, text, line):
    path, refusal = _refusal(tmp_path / "run.yaml", text)
    assert refusal == f"{path}: {line}"


def test_a_string_in_a_file_that_yaml_reads_as_the_same_text_is_taken(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  name: 2024\n  storage: 2024-01-15\nlog:\n  mlflow_experiment: 1.5\n"
                    "  wandb_project: '12:30'\ndata:\n  source: 1:30\n")
    cfg = load_config(str(path), check_source=False)
    assert cfg.run.name == "2024" and cfg.run.storage.endswith("/2024-01-15") and cfg.data.source.endswith("/1:30")
    assert (cfg.log.mlflow_experiment, cfg.log.wandb_project) == ("1.5", "12:30")


@pytest.mark.parametrize("text, line", [
    ("train: {lr: 1.0e-4}\ntrain: {total_steps: 5}\n", "line 2: 'train' is given twice (first at line 1)"),
    ("train:\n  lr: 1.0e-4\n  seed: 1\n  lr: 2.0e-4\n", "line 4: 'train.lr' is given twice (first at line 2)"),
    ("run: {name: a, name: b}\n", "line 1: 'run.name' is given twice (first at line 1)"),
    ("train:\n  ema_sigma_rels:\n    - {a: 1}\n    - {b: 1, b: 2}\n",
     "line 4: 'train.ema_sigma_rels[1].b' is given twice (first at line 4)"),
])
def test_a_key_or_section_given_twice_in_a_file_is_refused_naming_it_and_its_line(tmp_path, text, line):
    path, refusal = _refusal(tmp_path / "twice.yaml", text)
    assert refusal == f"{path}: {line}, and YAML would keep only the last: give it once"


def test_a_merged_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("train: &common {seed: 3}\neval:\n  <<: *common\n  seed: 4\n")
    cfg = load_config(str(path))
    assert (cfg.train.seed, cfg.eval.seed) == (3, 4)


@pytest.mark.parametrize("where, method", [("secret.yaml", "read_text"), ("secret/run.yaml", "stat")],
                         ids=["the file unreadable", "a folder on the way not to be entered"])
def test_an_unreadable_config_file_is_one_line_naming_it_and_why(tmp_path, monkeypatch, where, method):
    path = tmp_path / where
    if method == "read_text":
        path.write_text("train:\n  seed: 1\n")
    real = getattr(Path, method)

    def denied(self, *args, **kwargs):  # chmod 000 on the file or its folder, as a user (root reads it anyway)
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, method, denied)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == f"--config {path}: cannot read it (permission denied)"


@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_config_is_refused_as_empty_not_taken_for_the_current_folder(name):
    with pytest.raises(ConfigError) as info:
        load_config(name)
    assert str(info.value) == f"--config {name!r}: must name a preset or a YAML file; presets: {PRESETS}"


@pytest.mark.parametrize("args, line", [
    (["--config", "TWICE"], "TWICE: line 3: 'train' is given twice (first at line 1), and YAML would keep only the "
                            "last: give it once"),
    (["--config", ""], f"--config '': must name a preset or a YAML file; presets: {PRESETS}"),
    (["--set", "run.storage="], "run.storage = '': required: a folder for run directories"),
    (["--set", f"run.name={'a' * 300}"], f"run.name = '{'a' * 40}'...: 300 characters; at most 200 (it names a "
                                         f"folder, and file systems take 255 bytes a name, less what raydiff adds "
                                         f"to it)"),
])
def test_bad_config_input_is_one_config_error_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, args,
                                                                              line):
    from raydiff import cli, train

    monkeypatch.chdir(tmp_path)
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  lr: 1.0e-4\ntrain:\n  total_steps: 5\n")
    args = [a.replace("TWICE", str(twice)) for a in args]
    assert cli.run(train.main, ["--set", "run.storage=runs", *args]) == 2
    assert capsys.readouterr().err == f"raydiff: config error: {line.replace('TWICE', str(twice))}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["twice.yaml"]


@pytest.mark.parametrize("given", [["--set", "train.global_batch=064", "--set", "train.seed=0123"],
                                   ["file: train: {global_batch: 064, seed: 0123}"]])
def test_numbers_with_a_leading_zero_are_read_in_decimal_as_typed(tmp_path, given):
    """YAML 1.1 read them in octal: a global batch of 064 trained at 52, silently."""
    if given[0].startswith("file: "):
        (tmp_path / "c.yaml").write_text(given[0].removeprefix("file: ") + "\n")
        cfg = load_config(str(tmp_path / "c.yaml"), check_source=False)
    else:
        cfg = load_config("smoke", [given[1], given[3]], check_source=False)
    assert (cfg.train.global_batch, cfg.train.seed) == (64, 123)


@pytest.mark.parametrize("override, line", [
    ("train.total_steps=1:30", "train.total_steps = '1:30': expected integer"),  # YAML 1.1: 90, in base 60
    ("train.lr=1:30.5", "train.lr = '1:30.5': expected a finite number | null"),
])
def test_a_base_60_number_is_refused_not_read(override, line):
    with pytest.raises(ConfigError) as refused:
        load_config("smoke", [override], check_source=False)
    assert str(refused.value) == line


def test_a_value_nested_by_yaml_aliases_is_named_in_a_short_line(tmp_path):
    """Seven levels of ten aliases each: its full repr took 522 MB."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    (tmp_path / "c.yaml").write_text("anchors:\n" + "".join(f"  {line}\n" for line in levels)
                                     + "run: {name: *a7}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(tmp_path / "c.yaml"), check_source=False)
    assert len(str(refused.value)) < 1000 and "\n" not in str(refused.value)


@pytest.mark.parametrize("key", ["train.lr\nx", "train.lr x"])
def test_an_unknown_key_is_named_on_one_line(key):
    with pytest.raises(ConfigError) as refused:
        load_config("smoke", [f"{key}=1"], check_source=False)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"unknown key {key!r}")


@pytest.mark.parametrize("key, value, why", [
    ("model.init_from", "/tmp/" + "a" * 300, "file name too long"),
    ("data.source", "a\0b", "embedded null byte"),
    ("eval.ref", "/tmp/" + "b" * 300 + "/c", "file name too long"),
])
def test_a_path_that_cannot_be_looked_at_is_one_line_naming_its_key(key, value, why):
    """Path's checks raise for these (and for a folder on the way this user may not enter): tracebacks."""
    with pytest.raises(ConfigError) as refused:
        load_config("smoke", [f"{key}={value}"])
    assert str(refused.value).endswith(f": cannot look at it ({why})") and str(refused.value).startswith(f"{key} = ")
