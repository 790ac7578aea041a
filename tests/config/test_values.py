"""What a typed key accepts from YAML and the command line: finite numbers only, whole integers, exact literals,
a single value as a one-item list; and how a type is named in an error."""

from __future__ import annotations

from typing import Literal, get_type_hints

import pytest

from raydiff.config import Config, ConfigError, all_keys, load_config
from raydiff.config.values import coerce, describe_type


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

