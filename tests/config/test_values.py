"""What a typed key accepts from YAML and the command line: finite numbers only, whole integers, exact literals,
a single value as a one-item list, a string key's `--set` text as typed; and how a type and a value are named in
an error."""

from __future__ import annotations

from typing import Literal, get_type_hints

import pytest

from raydiff.config import Config, ConfigError, all_keys, load_config, set_key
from raydiff.config.values import coerce, describe_type, is_text, read_override


def test_command_line_strings_become_the_keys_types():
    assert coerce("1e-4", float) == 1e-4  # YAML 1.1 reads this as a string
    assert coerce(3.0, int) == 3 and coerce("-2", int) == -2
    assert coerce("[1, 2]", tuple[int, ...]) == (1, 2) and coerce(8, tuple[int, ...]) == (8,)
    assert coerce(None, int | None) is None and coerce("auto", Literal["auto"] | int) == "auto"


@pytest.mark.parametrize("value, hint", [
    (1.5, int), (True, int), ("1", bool), (1, Literal[True, False]), ("x", float), (float("nan"), float),
    ([1], str), ("fast", Literal["slow"]),
])
def test_values_of_another_type_are_refused(value, hint):
    with pytest.raises(ValueError):
        coerce(value, hint)


def test_types_are_named_as_a_user_writes_the_values():
    assert describe_type(Literal["auto", True, False]) == "auto | true | false"
    assert describe_type(int | None) == "integer | null"
    assert describe_type(tuple[float, ...]) == "list of finite numbers"


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


@pytest.mark.parametrize("override, line", [
    # A list item that is not YAML: a scanner error, a quote or a bracket left open (were YAML tracebacks).
    ("debug.nan_at_steps=5,*", "debug.nan_at_steps = '5,*': expected list of integer"),
    ("model.attention_resolutions=8,'4", "model.attention_resolutions = \"8,'4\": expected list of integer"),
    ("model.channel_mult=1,2,[3]", "model.channel_mult = '1,2,[3]': expected list of integer"),
    ("debug.nan_at_steps=1,!!int x", "debug.nan_at_steps = '1,!!int x': expected list of integer"),
    # A YAML tag PyYAML cannot build (were ValueError's and KeyError's tracebacks).
    ("train.lr=!!float x", "train.lr = '!!float x': expected a finite number | null"),
    ("train.seed=!!bool x", "train.seed = '!!bool x': expected integer"),
])
def test_an_override_that_is_not_yaml_is_refused_in_one_line_naming_the_key_and_value(override, line):
    with pytest.raises(ConfigError) as info:
        load_config("default", [override])
    assert str(info.value) == line


@pytest.mark.parametrize("override, key, value", [
    # YAML 1.1 would read these as a date, a boolean, octal, a float, base 60 and null (or refuse them as such).
    ("run.name=2024-01-15", "run.name", "2024-01-15"),
    ("run.name=yes", "run.name", "yes"),
    ("run.name=0123", "run.name", "0123"),
    ("run.name=1.10", "run.name", "1.10"),
    ("log.mlflow_experiment=12:30", "log.mlflow_experiment", "12:30"),
    ("run.name='null'", "run.name", "null"),  # quoted: the text (bare, YAML's null, refused below)
    ("log.wandb_project='null'", "log.wandb_project", "null"),  # quoted: the text, where bare null is off
    ("data.image_column=\"0x1F\"", "data.image_column", "0x1F"),
])
def test_a_string_key_takes_the_set_text_as_typed(tmp_path, override, key, value):
    cfg = load_config("default", [override, f"run.storage={tmp_path}"], check_source=False)
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value


def test_a_set_path_keeps_its_colons(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "1:30").mkdir()  # was /.../90: YAML 1.1 reads 1:30 as 90 in base 60
    cfg = load_config("default", ["data.source=1:30", "run.storage=out"])
    assert cfg.data.source == str(tmp_path / "1:30")


@pytest.mark.parametrize("text", ["~", "null", "NULL"])
def test_null_and_tilde_are_null_where_a_string_key_admits_null(tmp_path, text):
    cfg = load_config("default", [f"eval.ref={text}", f"log.wandb_project={text}", f"run.storage={tmp_path}"])
    assert cfg.eval.ref is None and cfg.log.wandb_project is None


@pytest.mark.parametrize("key", ["model.init_from", "eval.ref", "log.wandb_project", "data.source"])
@pytest.mark.parametrize("text", ["", " "])
def test_an_empty_value_is_refused_where_the_key_admits_null_not_taken_for_none(tmp_path, key, text):
    """`--set model.init_from=$CKPT` with CKPT unset trained from random weights, silently."""
    with pytest.raises(ConfigError) as info:
        load_config("default", [f"run.storage={tmp_path}", f"{key}={text}"])
    assert str(info.value) == f"{key} = '': empty (an unset shell variable?): give a value, or null where you mean none"


@pytest.mark.parametrize("section, key", [("eval", "ref"), ("log", "wandb_project")])
def test_an_empty_text_in_a_file_is_refused_where_null_means_none(tmp_path, section, key):
    """`ref: ""` measured against data.source and `wandb_project: ""` turned W&B off, as null does, silently."""
    (tmp_path / "run.yaml").write_text(f"{section}:\n  {key}: ''\nrun:\n  storage: {tmp_path}\n")
    with pytest.raises(ConfigError, match=rf"^{section}.{key} = '': must name .*, or be null"):
        load_config(str(tmp_path / "run.yaml"))


@pytest.mark.parametrize("override, line", [
    ("run.storage=s3:/bucket/runs", "run.storage = 's3:/bucket/runs': a URI is s3://...; as written this is a local "
                                    "folder named 's3:' (write ./s3:/bucket/runs for that)"),
    ("model.init_from=GS:bucket/run", "model.init_from = 'GS:bucket/run': a URI is gs://...; as written this is a "
                                      "local folder named 'GS:bucket' (write ./GS:bucket/run for that)"),
    ("data.source=hf:/datasets/a/b", "data.source = 'hf:/datasets/a/b': a URI is hf://...; as written this is a "
                                     "local folder named 'hf:' (write ./hf:/datasets/a/b for that)"),
])
def test_a_uri_with_a_slash_missing_is_refused_not_made_a_local_folder(tmp_path, monkeypatch, override, line):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config("default", [override])
    assert str(info.value) == line
    assert load_config("default", ["run.storage=./s3:/runs"]).run.storage == str(tmp_path / "s3:" / "runs")


@pytest.mark.parametrize("override, line", [
    ("train.base_lr=1" + "0" * 400, "train.base_lr = 1" + "0" * 17 + "..." + "0" * 19 + ": expected a finite number"),
    ("train.base_lr=1e308", "train.base_lr = 1e+308: scaled to train.global_batch = 64 (train.lr_scaling = linear) "
                            "it is no finite number"),
    ("model.channel_mult=[1,2", "model.channel_mult = '[1,2': expected list of integer"),
    ("scaling.num_workers=(1,2", "scaling.num_workers = '(1,2': expected auto | integer | list of integer"),
])
def test_numbers_too_large_and_lists_cut_short_are_one_line(tmp_path, override, line):
    with pytest.raises(ConfigError) as info:
        load_config("default", [f"run.storage={tmp_path}", override])
    assert str(info.value) == line


@pytest.mark.parametrize("override, line", [
    # Where the key admits no null, the empty value is the empty string, refused by the key's own rule (was
    # `run.storage = None: expected string`); data.source's null is refused as required.
    ("run.storage=", "run.storage = '': required: a folder for run directories"),
    ("data.image_column=", "data.image_column = '': must name a column"),
    # YAML's null where the key takes none: refused, as in a file (taken as text, `run.storage=null` would have
    # written into ./null, `run.storage=~` into the home folder).
    ("run.name=~", "run.name = null: expected string"),
    ("run.storage=null", "run.storage = null: expected string"),
    ("run.storage=~", "run.storage = null: expected string"),
    ("run.name=12:30", "run.name = '12:30': use letters, digits, '.', '_' and '-' (it names a folder)"),
    ("data.source=null", "data.source = null: required: a folder or file of images, Parquet or WebDataset shards "
                         "(local, s3://, gs://), a dataset on the Hugging Face Hub (hf://datasets/uoft-cs/cifar10), "
                         "or builtin:digits"),
])
def test_an_empty_or_refused_string_is_named_as_typed(tmp_path, override, line):
    with pytest.raises(ConfigError) as info:
        load_config("default", [f"run.storage={tmp_path}", override])
    assert str(info.value) == line


def test_a_refused_null_is_named_null_not_none():
    with pytest.raises(ConfigError) as info:
        set_key(Config(), "run.name", None)
    assert str(info.value) == "run.name = null: expected string"


def test_only_keys_of_text_alone_take_the_set_text_as_typed():
    assert is_text(str) and is_text(str | None)
    assert not is_text(Literal["auto"] | bool | str) and not is_text(tuple[str, ...]) and not is_text(int | None)
    assert read_override("true", Literal["auto"] | bool | str) is True  # train.compile: YAML, as before
    assert read_override("'a' 'b'", str) == "'a' 'b'"  # not one quoted string: the text
    assert read_override(" /tmp/x ", str) == "/tmp/x"  # a stray space is no folder name
