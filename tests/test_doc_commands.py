"""Every command the manual shows is one the commands accept, and every error it shows is the error they give.

The commands are the `python -m raydiff.<command> ...` lines of the code blocks of README.md and docs/*.md (also
after `$ ` or `ray job submit ... -- `); synopsis lines, which show optional parts in brackets, are left out. Each
line's arguments must pass its command's own parser, and a `--config` / `--set` must load as a config. Where the
next line of the block shows `raydiff: config error: ...`, loading must fail with exactly that line (unless the
error is about a model folder the example names). Nothing runs: the tests read arguments, not data or checkpoints.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from raydiff.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^ {0,3}(```|~~~)")
COMMAND = re.compile(r"(?:^|[\s/])python3? -m (raydiff(?:\.\w+)+)(?=\s|$)(.*)$")
CONFIG_ERROR = "raydiff: config error: "
# Commands whose --config / --set make a run's config.
CONFIGURED = {"raydiff.train", "raydiff.tune", "raydiff.lr_find", "raydiff.bench"}
# Its arguments are the files it checks: tests/test_cluster_check.py runs it on every shipped one.
NOT_PARSED = {"raydiff.cluster_check"}
# Errors that need what the manual's example names to exist (a model folder): only the arguments are checked.
NEEDS_FILES = ("model.init_from = ",)


@dataclass
class Shown:
    where: str  # file:line
    module: str
    argv: list[str]
    error: str | None  # the config error the manual shows on the next line, if any


def shown_commands() -> list[Shown]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines, fence, number = path.read_text().splitlines(), None, -1
        while number + 1 < len(lines):
            number += 1
            line, start = lines[number], number
            opened = FENCE.match(line)
            if opened:
                fence = None if fence else opened.group(1)
                continue
            while fence and line.endswith("\\") and number + 1 < len(lines):  # a command continued on the next line
                number += 1
                line = line[:-1] + " " + lines[number].strip()
            match = COMMAND.search(line) if fence else None
            arguments = match.group(2).split(" #")[0] if match else ""
            if match is None or match.group(1) in NOT_PARSED or " [" in arguments:
                continue
            following = lines[number + 1] if number + 1 < len(lines) else ""
            error = following[len(CONFIG_ERROR):] if following.startswith(CONFIG_ERROR) else None
            found.append(Shown(f"{path.relative_to(ROOT)}:{start + 1}", match.group(1), shlex.split(arguments),
                               error))
    return found


SHOWN = shown_commands()


def test_the_manual_shows_commands_of_every_kind():
    # The collection itself: a change of the pattern that found none would pass every test below.
    modules = {shown.module for shown in SHOWN}
    assert {"raydiff.train", "raydiff.tune", "raydiff.sample", "raydiff.evaluate", "raydiff.export",
            "raydiff.ema"} <= modules
    assert any(shown.error for shown in SHOWN)


@pytest.mark.parametrize("shown", SHOWN, ids=[shown.where for shown in SHOWN])
def test_a_command_the_manual_shows_is_accepted(shown, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a parser checks that a relative --out can be written
    module = importlib.import_module(f"{shown.module}.__main__" if shown.module == "raydiff.bench" else shown.module)
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            args = module.parse_args(shown.argv)
    except SystemExit:
        pytest.fail(f"{shown.where}: {usage.getvalue().strip().splitlines()[-1]}")
    if shown.module not in CONFIGURED:
        assert shown.error is None, f"{shown.where}: shows a config error for a command without a config"
        return
    if shown.error is None or shown.error.startswith(NEEDS_FILES):
        load_config(args.config, args.set, check_source=False)
        return
    with pytest.raises(ConfigError) as refused:
        load_config(args.config, args.set, check_source=False)
    assert str(refused.value) == shown.error, shown.where


def test_the_readme_names_every_command_and_every_benchmark():
    # The table of commands is where a user first looks; a command or benchmark added without a row is not found.
    readme = (ROOT / "README.md").read_text()
    table = {re.match(r"\| `python -m (raydiff[\w.]*)`", line).group(1): line
             for line in readme.splitlines() if re.match(r"\| `python -m raydiff", line)}
    commands = {f"raydiff.{path.stem}" for path in (ROOT / "raydiff").glob("*.py")
                if re.search(r"^def main\(", path.read_text(), re.M)}
    assert commands | {"raydiff.bench", "raydiff.quality.digits_classifier"} <= set(table)
    usage = io.StringIO()
    with contextlib.redirect_stdout(usage), pytest.raises(SystemExit):
        importlib.import_module("raydiff.bench.__main__").parse_args(["--help"])
    benchmarks = re.search(r"\{([a-z,]+)\}", usage.getvalue()).group(1).split(",")
    assert len(benchmarks) >= 6
    missing = [name for name in benchmarks if name not in table["raydiff.bench"]]
    assert not missing, f"README's row of raydiff.bench does not name {missing}"
