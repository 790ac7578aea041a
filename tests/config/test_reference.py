"""docs/configuration.md is generated from the config schema (`raydiff.config.reference`): the committed page is
current, lists every key once, and every key has a meaning."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raydiff.config import Config, all_keys
from raydiff.config.reference import COMMAND, MissingDocstring, class_docstrings, render, yaml_value

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
TABLE_KEY = re.compile(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", re.MULTILINE)


def test_committed_page_is_current():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date: run {COMMAND}"


def test_every_key_appears_once_in_the_tables():
    keys = TABLE_KEY.findall(render())
    assert sorted(keys) == sorted(all_keys())
    assert len(keys) == len(set(keys))


def test_table_rows_show_type_default_and_meaning():
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z_.0-9]+)` \|.*$", render(), re.MULTILINE)}
    assert rows["data.cache"].startswith("| `data.cache` | auto \\| memory \\| stream | `auto` | ")
    assert "| integer | `16` |" in rows["data.resolution"]
    assert "| string \\| null | `null` |" in rows["model.init_from"]
    assert "| `[1, 2, 2]` |" in rows["model.channel_mult"]
    assert "(see [Shuffle quality](data.md#shuffle-quality))" in rows["data.stream_window_shards"]  # a docs/ ref
    assert yaml_value(()) == "[]" and yaml_value(True) == "true" and yaml_value(2e-3) == "0.002"


@dataclass
class _Documented:
    """A section."""

    kept: int = 1
    """Has a meaning."""
    # A comment between a field and the next is not a docstring.
    forgotten: str = "x"


@dataclass
class _Throwaway:
    part: _Documented = field(default_factory=_Documented)


def test_a_key_without_a_docstring_makes_the_generator_raise():
    about, docs = class_docstrings(_Documented)
    assert about == "A section." and docs == {"kept": "Has a meaning."}
    with pytest.raises(MissingDocstring, match=r"part\.forgotten") as raised:
        render(_Throwaway())
    assert "part.kept" not in str(raised.value)


def test_the_real_schema_has_a_docstring_for_every_key():
    documented = {f"{name}.{key}" for name in ("data", "model", "diffusion", "train", "scaling", "run", "eval", "log",
                                               "debug")
                  for key in class_docstrings(type(getattr(Config(), name)))[1]}
    assert documented == set(all_keys())

