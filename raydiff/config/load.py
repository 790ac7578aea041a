"""Loading a run's config: a preset or YAML file, then `key=value` overrides, then validation.

Config flows one way: preset YAML + overrides -> `Config` (validated) -> driver -> workers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from raydiff.config.checks import validate
from raydiff.config.schema import Config, ConfigError, fields_of, parse_override, sections_problem, set_key
from raydiff.config.values import YAML_ERRORS

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
# A checkout (or a Ray job's working_dir) has the presets beside the package; a wheel has them inside it.
PRESETS_DIR = next((p for p in (_PACKAGE_DIR.parent / "configs", _PACKAGE_DIR / "configs") if p.is_dir()),
                   _PACKAGE_DIR.parent / "configs")


# Presets.
def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if path.is_dir():
            raise ConfigError(f"--config {name_or_path}: a folder, not a YAML file; give the file, or a preset: "
                              f"{', '.join(preset_names())}")
        if not path.is_file():
            raise ConfigError(f"--config {name_or_path}: no such file")
        return path
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if not preset.is_file():
        raise ConfigError(f"--config {name_or_path}: not a file and not a preset; presets: {', '.join(preset_names())}")
    return preset


def load_config(name_or_path: str = "default", overrides: Sequence[str] = (), *, check_source: bool = True) -> Config:
    """Preset or YAML file, then `key=value` overrides, then validation. Raises ConfigError."""
    path = resolve_config_path(name_or_path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML{_where_and_what(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid YAML (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    except YAML_ERRORS as exc:  # a tagged value PyYAML cannot build (`lr: !!float x`)
        raise ConfigError(f"{path}: not valid YAML (a tagged value it cannot build: {exc})") from None
    problem = sections_problem(tree)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    cfg = Config()
    for section, values in tree.items():
        if not isinstance(section, str) or section not in fields_of(cfg):
            raise ConfigError(f"{path}: unknown section '{section}'; known sections: {', '.join(fields_of(cfg))}")
        for key, value in (values or {}).items():
            set_key(cfg, f"{section}.{key}", value)
    for text in overrides:
        set_key(cfg, *parse_override(text))
    _resolve_paths(cfg)
    validate(cfg, check_source=check_source)
    return cfg.resolve()


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line (PyYAML's takes several): `line L, column C: <problem>` of a syntax error (where
    the user fixes it; for an unclosed bracket or quote, where it opened too), else its first line."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if mark is None or not problem:
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and opened is not None and context != problem:
        where += f" ({context} at line {opened.line + 1}, column {opened.column + 1})"
    return where


def read_record(read: Callable[[], str], kind: str) -> tuple[Any, str | None]:
    """(what the JSON or YAML text that `read` returns holds, None), or (None, why it cannot be read, in one line:
    cut short, not UTF-8, a syntax error where it is): for the files raydiff writes beside what it makes (a run's
    records, a diffusers folder's side files), which a copy cut short or a hand edit may damage."""
    try:
        text = read()
        return (json.loads(text) if kind == "JSON" else yaml.safe_load(text)), None
    except yaml.YAMLError as exc:
        return None, f"not valid YAML ({yaml_problem(exc)})"
    except YAML_ERRORS as exc:  # JSONDecodeError, not UTF-8 (ValueErrors); a YAML tag it cannot build (`!!float x`)
        return None, f"not valid {kind} ({(str(exc).splitlines() or [''])[0]})"


def _where_and_what(exc: yaml.YAMLError) -> str:
    located = getattr(exc, "problem_mark", None) is not None and (getattr(exc, "problem", None)
                                                                   or getattr(exc, "context", None))
    return f" at {yaml_problem(exc)}" if located else f" ({yaml_problem(exc)})"


def _resolve_paths(cfg: Config) -> None:
    """Workers run in another directory: make local paths absolute on the driver."""
    if cfg.data.source and "://" not in cfg.data.source and not cfg.data.source.startswith("builtin:"):
        cfg.data.source = str(Path(cfg.data.source).expanduser().resolve())
    if "://" not in cfg.run.storage:
        cfg.run.storage = str(Path(cfg.run.storage).expanduser().resolve())
    if cfg.model.init_from and Path(cfg.model.init_from).expanduser().exists():  # else a hub id, kept as it is
        cfg.model.init_from = str(Path(cfg.model.init_from).expanduser().resolve())
    for key in ("inception_weights", "ref"):
        value = getattr(cfg.eval, key)
        if value and "://" not in value:
            setattr(cfg.eval, key, str(Path(value).expanduser().resolve()))
