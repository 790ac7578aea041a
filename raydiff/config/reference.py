"""The configuration reference page, docs/configuration.md, generated from the config schema.

Why it exists: a key's meaning is written in one place only, the attribute docstring under its field in
`raydiff.config.schema`, beside its type and default. This module turns the schema into the manual's reference
page, so the page cannot drift from the code; tests/config/test_reference.py checks that the committed page is
what this module prints. Regenerate the page after changing the schema:

    python -m raydiff.config.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

from raydiff.config.schema import Config, fields_of
from raydiff.config.values import describe_type

COMMAND = "python -m raydiff.config.reference > docs/configuration.md"
# `docs/<page>.md#<anchor>` in a docstring: a relative link on the page, which lives in docs/ itself.
_DOC_REFERENCE = re.compile(r"\bdocs/([\w.-]+\.md(?:#[\w-]+)?)")
DOCS = Path(__file__).resolve().parents[2] / "docs"  # a checkout's, where the page is generated

INTRO = f"""\
# Configuration reference

<!-- Generated from raydiff/config/schema.py by `{COMMAND}`: edit the docstrings there, not this page. -->

A run is configured by the keys below, each named `section.key`. Every key starts at the default listed here,
the schema's default (DDPM on scikit-learn's digits). These are not quite the built-in default run: its preset,
`configs/default.yaml`, also sets `train.loss_weighting: min_snr` and `eval.at_end: true`, and a file of your own
starts from the defaults here, not from that preset. Then, in this order:

- a YAML file sets keys section by section: a preset from `configs/` (`python -m raydiff.train --config digits`)
  or a file of your own (`--config FILE`, e.g. `--config my-run.yaml`). Without `--config` the `default` preset
  is used. Presets set some keys differently from the defaults; the keys a file does not name keep them.
- `--set section.key=value` overrides one key (repeatable); the value is read as YAML, e.g.
  `--set train.lr=1e-4 --set model.channel_mult=[1,2,2] --set eval.ref=null`, except for a key of type string,
  which takes the text as typed (`--set run.name=2024-01-15` is that text, not a date; `run.name=0123` is not
  123): there `null` and `~` are null only where the key admits null, and a value in quotes is the quoted text.
  An empty value is refused where the key admits null (`--set model.init_from=$CKPT` with `CKPT` unset must not
  mean "no weights"): write `null`. Numbers are read as written, in decimal: `064` is 64 (YAML 1.1, PyYAML's,
  read it in octal: 52), and `1:30` is text, which a number key refuses (YAML 1.1: 90, in base 60).

In a YAML file, quote a string that YAML would read as something else (`name: "yes"`, `name: "0123"`): a string
key refuses a number, boolean or date that is not the text as written, and a key or
section given twice is refused.

A key that does not exist, a value of the wrong type, or a value that breaks a rule between keys is reported in
one line naming the key, before anything runs. `python -m raydiff.train [--config ...] [--set ...] --dry-run`
prints the config a run would use.

This page is generated from the schema, `raydiff/config/schema.py`, where each key's meaning is the docstring
under its field: `{COMMAND}`.
"""


class MissingDocstring(ValueError):
    """A config key without an attribute docstring: the reference page would have no meaning for it."""


def class_docstrings(cls: type) -> tuple[str | None, dict[str, str]]:
    """The class's own docstring (not the signature that `dataclass` makes up when it has none) and each field's
    attribute docstring: the string literal right after the field's annotated assignment, read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return ast.get_docstring(node), docs


def yaml_value(value: Any) -> str:
    """`value` as a YAML file would write it: null, true, [1, 2, 2], 0.002."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000)
    return text.removesuffix("\n...\n").strip()


def _cell(text: str) -> str:
    """One table cell: a single line, with the `|` that would end the cell escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _links(text: str) -> str:
    """`docs/<page>.md#<anchor>` references made into links relative to docs/, where the page is, labelled with
    the heading the anchor is GitHub's for (else the anchor's or the page's words):
    `docs/training.md#post-hoc-ema` -> [Post-hoc EMA](training.md#post-hoc-ema)."""

    def link(match: re.Match) -> str:
        target = match.group(1)
        page, _, anchor = target.partition("#")
        words = (anchor or page.removesuffix(".md")).replace("-", " ")
        return f"[{_heading(page, anchor) or words[:1].upper() + words[1:]}]({target})"

    return _DOC_REFERENCE.sub(link, text)


def _heading(page: str, anchor: str) -> str | None:
    """The text of the heading of docs/`page` whose GitHub anchor is `anchor` (None where there is none)."""
    return _headings(page).get(anchor) if anchor else None


@functools.cache
def _headings(page: str) -> dict[str, str]:
    """docs/`page`'s headings by their GitHub anchors (read once per page, however many links point there)."""
    path = DOCS / page
    headings = [line.lstrip("#").strip() for line in (path.read_text(encoding="utf-8").splitlines()
                                                      if path.is_file() else ()) if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-"): h for h in reversed(headings)}


def sections(config: Config | None = None) -> list[tuple[str, Any]]:
    """(section name, section dataclass instance) in the order of `Config`'s fields."""
    config = config or Config()
    return [(name, getattr(config, name)) for name in fields_of(config)]


def render(config: Config | None = None) -> str:
    """The whole page. Raises MissingDocstring when a key has no attribute docstring."""
    config = config or Config()
    missing, parts = [], [INTRO]
    for name, section in sections(config):
        cls = type(section)
        about, docs = class_docstrings(cls)
        parts.append(f"\n## {name}\n")
        if about:
            parts.append(f"\n{_links(' '.join(about.split()))}\n")
        parts.append("\n| key | type | default | meaning |\n|---|---|---|---|\n")
        defaults = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)}
        for key, hint in fields_of(section).items():
            if key not in docs:
                missing.append(f"{name}.{key} ({cls.__name__} in {inspect.getsourcefile(cls)})")
                continue
            parts.append(f"| `{name}.{key}` | {_cell(describe_type(hint))} | `{_cell(yaml_value(defaults[key]))}` | "
                         f"{_links(_cell(docs[key]))} |\n")
    if missing:
        raise MissingDocstring(f"config keys without a docstring: {', '.join(missing)}; write one under each "
                               f"field (a string literal on the line after it), then run {COMMAND}")
    return "".join(parts)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
