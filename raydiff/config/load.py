"""Loading a run's config: a preset or YAML file, then `key=value` overrides, then validation.

Config flows one way: preset YAML + overrides -> `Config` (validated) -> driver -> workers.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from raydiff.config.checks import look_at, validate
from raydiff.config.schema import (
    Config,
    ConfigError,
    fields_of,
    key_type,
    parse_override,
    sections_problem,
    set_key,
)
from raydiff.config.values import YAML_ERRORS, DecimalLoader, is_text, shown
from raydiff.storage.errors import permanent_reason
from raydiff.storage.fs import bucket_uri_problem

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
# A checkout (or a Ray job's working_dir) has the presets beside the package; a wheel has them inside it.
PRESETS_DIR = next((p for p in (_PACKAGE_DIR.parent / "configs", _PACKAGE_DIR / "configs") if p.is_dir()),
                   _PACKAGE_DIR.parent / "configs")


# Presets.
def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _unreadable(name: str | Path, exc: OSError) -> ConfigError:
    """A --config this user may not read, in the words every command's unreadable input uses."""
    return ConfigError(f"--config {name}: cannot read it ({permanent_reason(exc) or exc.strerror or exc})")


def resolve_config_path(name_or_path: str) -> Path:
    if not name_or_path.strip():  # Path("") is ".", the current folder: an unset shell variable, not a folder
        raise ConfigError(f"--config {name_or_path!r}: must name a preset or a YAML file; presets: "
                          f"{', '.join(preset_names())}")
    path = Path(name_or_path)
    try:
        if path.suffix in (".yaml", ".yml") or path.exists():
            if path.is_dir():
                raise ConfigError(f"--config {name_or_path}: a folder, not a YAML file; give the file, or a preset: "
                                  f"{', '.join(preset_names())}")
            if not path.is_file():
                raise ConfigError(f"--config {name_or_path}: no such file")
            return path
    except OSError as exc:  # a folder on the way this user may not enter
        raise _unreadable(name_or_path, exc) from None
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if not preset.is_file():
        raise ConfigError(f"--config {name_or_path}: not a file and not a preset; presets: {', '.join(preset_names())}")
    return preset


def load_config(name_or_path: str = "default", overrides: Sequence[str] = (), *, check_source: bool = True) -> Config:
    """Preset or YAML file, then `key=value` overrides, then validation. Raises ConfigError.

    The file is read by `ConfigLoader`: a key given twice is refused, and a string key's value that YAML 1.1 reads
    as something else is taken only where it is the text as written (`_as_written`)."""
    path = resolve_config_path(name_or_path)
    try:
        loader = ConfigLoader(path.read_text(encoding="utf-8"))
        try:
            tree = loader.get_single_data() or {}
        finally:
            loader.dispose()
    except DuplicateKey as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML{_where_and_what(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid YAML (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    except OSError as exc:  # permission denied, an I/O error
        raise _unreadable(path, exc) from None
    except YAML_ERRORS as exc:  # a tagged value PyYAML cannot build (`lr: !!float x`)
        raise ConfigError(f"{path}: not valid YAML (a tagged value it cannot build: {exc})") from None
    problem = sections_problem(tree)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    cfg = Config()
    for section, values in tree.items():
        if not isinstance(section, str) or section not in fields_of(cfg):
            raise ConfigError(f"{path}: unknown section {shown(section)}; known sections: {', '.join(fields_of(cfg))}")
        for key, value in (values or {}).items():
            name = f"{section}.{key}"
            if isinstance(value, (int, float, datetime.date)) and is_text(key_type(name)):
                value = _as_written(path, name, value, loader.written.get(name))
            set_key(cfg, name, value)
    for text in overrides:
        set_key(cfg, *parse_override(text))
    _resolve_paths(cfg)
    validate(cfg, check_source=check_source)
    return cfg.resolve()


class DuplicateKey(yaml.YAMLError):
    """A mapping of a config file that names a key twice; the message says where, in one line."""


class ConfigLoader(DecimalLoader):
    """PyYAML's safe loader (plain data only; numbers as `DecimalLoader` reads them) for config files, which
    refuses a key given twice in one mapping, at any depth (`DuplicateKey`: PyYAML keeps the last silently, so a
    second `train:` section dropped the first's keys; a merge, `<<: *base`, may still be overridden), and keeps each
    scalar value as written, by key path (`written["run.name"]`), for the messages that quote it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.written: dict[str, yaml.ScalarNode] = {}

    def construct_document(self, node: yaml.Node) -> Any:
        self._index(node, "", set())
        return super().construct_document(node)

    def _index(self, node: yaml.Node, path: str, seen: set[int]) -> None:
        """Walk the nodes as composed (before merges are flattened into them)."""
        if id(node) in seen:  # an alias met again: indexed where it was first
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, Any], yaml.Node] = {}
            for key_node, value_node in node.value:
                child = _key_path(path, key_node)
                if key_node.tag != "tag:yaml.org,2002:merge" and isinstance(key_node, yaml.ScalarNode):
                    earlier = first.setdefault((key_node.tag, key_node.value), key_node)
                    if earlier is not key_node:
                        raise DuplicateKey(f"line {key_node.start_mark.line + 1}: '{child}' is given twice (first "
                                           f"at line {earlier.start_mark.line + 1}), and YAML would keep only the "
                                           f"last: give it once")
                if isinstance(value_node, yaml.ScalarNode):
                    self.written.setdefault(child, value_node)
                self._index(value_node, child, seen)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index(item, f"{path}[{i}]", seen)


def _key_path(path: str, key_node: yaml.Node) -> str:
    name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
    return f"{path}.{name}" if path else str(name)


def _as_written(path: Path, key: str, value: Any, node: yaml.ScalarNode | None) -> str:
    """The text of a string key's value that YAML 1.1 read as a number, a boolean or a date: taken where it is that
    text exactly (`name: 2024` is "2024", `name: 1.5` is "1.5": nothing a user typed changes), else refused with
    the text to quote, since the string YAML's value makes is not what was typed (`name: 12:30` is 750 in base 60,
    `0123` is 83 in octal, `1.10` is 1.1, `yes` is true)."""
    if node is not None and not isinstance(value, bool) and str(value) == node.value:  # `True` is no text either
        return node.value
    read = (str(value).lower() if isinstance(value, bool) else f"the integer {value}" if isinstance(value, int)
            else f"the number {value}" if isinstance(value, float)
            else f"the timestamp {value}" if isinstance(value, datetime.datetime) else f"the date {value}")
    if node is None:  # merged from elsewhere (`<<: *base`): the text is not at hand
        raise ConfigError(f"{path}: {key} is {read} as YAML reads it: a string is expected; quote it in the file")
    raise ConfigError(f"{path}: line {node.start_mark.line + 1}: {key} = {node.value}, which YAML reads as {read}: "
                      f"a string is expected; quote it in the file: {json.dumps(node.value, ensure_ascii=False)}")


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
    """Workers run in another directory: make local paths absolute on the driver. A `file://` run.storage is the
    folder it names (a sweep gathers its trials' files by path)."""
    if cfg.run.storage.startswith("file://"):
        cfg.run.storage = cfg.run.storage.removeprefix("file://")
    for section, key in (("data", "source"), ("run", "storage"), ("eval", "inception_weights"), ("eval", "ref")):
        value = getattr(getattr(cfg, section), key)
        if _is_local_path(value):  # empty stays empty, for its rule to refuse (not ".")
            setattr(getattr(cfg, section), key, _absolute(f"{section}.{key}", value))
    if cfg.model.init_from and look_at("model.init_from", cfg.model.init_from, Path.exists):
        cfg.model.init_from = _absolute("model.init_from", cfg.model.init_from)  # else a hub id, kept as it is


def _is_local_path(value: str | None) -> bool:
    """A path on this machine: not empty, not a URI, not a built-in dataset's name (`builtin:digits`)."""
    return value is not None and value != "" and "://" not in value and not value.startswith("builtin:")


def _absolute(key: str, value: str) -> str:
    """The local path `value` of `key` made absolute, or one line where it cannot be looked at, or where it is a
    URI mistyped (`s3:/bucket`)."""
    mistyped = bucket_uri_problem(value)
    if mistyped is not None:
        raise ConfigError(f"{key} = {shown(value)}: {mistyped}")
    return look_at(key, value, lambda path: str(path.resolve()))
