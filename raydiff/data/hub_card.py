"""What a Hugging Face Hub dataset's card says its files are: the YAML `configs:` at the top of its README.md.

Why: a card may name a dataset's files and splits outright, where file names alone would say nothing or mislead
(`images/*.parquet` is the train split, a folder called `test` holds something else), and it names a
repository's subsets (its configs) and which of them is the default. `datasets.load_dataset(name)` follows the
card before the names, and so does a run pointed at a repository's root; without a card, or without `configs:`,
the names' rules apply (`raydiff.data.hub_splits`). The card's forms, as the Hub documents them
(https://huggingface.co/docs/hub/datasets-manual-configuration): `data_files` a pattern, a list of patterns
(the train split), or a list of `{split, path}` with `path` a pattern or a list; or `data_dir`, a folder whose
files the names' rules split (with `data_files`, the folder their patterns are in). Patterns are relative to the
repository, `*` within a folder, `**` across them.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import yaml

from raydiff.data.errors import DataError
from raydiff.data.hub_splits import TRAIN, train_split
from raydiff.storage.fs import glob_match

CARD = "README.md"


@dataclass(frozen=True)
class CardConfig:
    name: str
    splits: dict[str, list[str]]  # split -> its patterns, relative to the repository; {} with data_dir only
    data_dir: str  # "" for the repository's root
    default: bool  # marked `default: true`


def card_configs(uri: str, card: str) -> list[CardConfig]:
    """The configs of a card's YAML header (`---` lines around it); [] when it has none. DataError (one line)
    for a header that does not parse, or configs in no form the Hub documents."""
    lines = card.lstrip("\ufeff").splitlines()
    rules = [i for i, line in enumerate(lines) if line.strip() == "---"]
    if len(rules) < 2 or rules[0] != 0:
        return []
    try:
        header = yaml.safe_load("\n".join(lines[1:rules[1]])) or {}
    except yaml.YAMLError as exc:
        raise DataError(f"data.source = {uri!r}: its card ({CARD}) has a YAML header that does not parse "
                        f"({str(exc).splitlines()[0]})") from None
    configs = header.get("configs") if isinstance(header, dict) else None
    if not configs:
        return []
    try:
        return [_config(entry) for entry in configs]
    except (TypeError, KeyError, AttributeError, ValueError):
        raise DataError(f"data.source = {uri!r}: its card's configs are not what the Hub documents (each a "
                        f"config_name with data_files or data_dir); name the files with a glob") from None


def _config(entry: dict[str, Any]) -> CardConfig:
    files, data_dir = entry.get("data_files"), str(entry.get("data_dir") or "").strip("/")
    if files is None and not data_dir:
        raise ValueError("neither data_files nor data_dir")
    splits: dict[str, list[str]] = {}
    if isinstance(files, dict):  # {split: patterns}, as `datasets` also takes
        files = [{"split": split, "path": path} for split, path in files.items()]
    for item in [files] if isinstance(files, str) else files or []:
        split, paths = (TRAIN, item) if isinstance(item, str) else (str(item["split"]), item["path"])
        for path in [paths] if isinstance(paths, str) else paths:
            if not isinstance(path, str):
                raise TypeError(path)
            path = path.removeprefix("./")
            splits.setdefault(split, []).append(f"{data_dir}/{path}" if data_dir else path)  # within data_dir
    return CardConfig(str(entry.get("config_name", "default")), splits, data_dir, entry.get("default") is True)


def default_config(uri: str, configs: list[CardConfig]) -> CardConfig:
    """The config `datasets` loads without a name: the one marked default, else the one named `default`, else the
    only one; DataError (one line) when the card leaves it open."""
    marked = [config for config in configs if config.default]
    named = [config for config in configs if config.name == "default"]
    chosen = marked or named or (configs if len(configs) == 1 else [])
    if chosen:
        return chosen[0]
    example = next(iter(configs[0].splits.values()), [configs[0].data_dir])[0]
    raise DataError(f"data.source = {uri!r}: its card names several configs ({', '.join(c.name for c in configs)}) "
                    f"and none is the default: name the files of one, e.g. {uri.rstrip('/')}/{example}")


def card_split(uri: str, card: str, files: list[str], root: str, kind: str) -> tuple[list[str], str, str] | None:
    """(the files to train on, their split, the folder of their class subfolders: the one that holds them all) of
    `files` (full paths: the repository's files of the run's `kind`, e.g. "Parquet", listed under its `root`) as its
    card says; None when the card names no configs. DataError (one line) when it does not say one train split."""
    configs = card_configs(uri, card)
    if not configs:
        return None
    config = default_config(uri, configs)
    relative = {f[len(root.rstrip("/")) + 1:]: f for f in files}
    if not config.splits:  # a folder: its files split by their names
        folder = f"{root.rstrip('/')}/{config.data_dir}"
        return train_split(uri, [f for rel, f in relative.items() if rel.startswith(f"{config.data_dir}/")], folder)
    if TRAIN not in config.splits and len(config.splits) > 1:
        first = min(config.splits)
        raise DataError(f"data.source = {uri!r}: its card's config {config.name!r} has the splits "
                        f"{', '.join(sorted(config.splits))} and no train split: name the files of one, e.g. "
                        f"{uri.rstrip('/')}/{config.splits[first][0]}")
    split = TRAIN if TRAIN in config.splits else next(iter(config.splits))
    patterns = config.splits[split]
    chosen = {rel: f for rel, f in relative.items() if any(glob_match(rel, pattern) for pattern in patterns)}
    if not chosen:
        raise DataError(f"data.source = {uri!r}: its card's {split} split ({', '.join(patterns)}) matches none of "
                        f"its {kind} files")
    # Their class subfolders are in the folder that holds them all (`train/cat/0.png`, `train/dog/1.png`: `train`),
    # as `datasets` labels images by their parent folders; the repository's root would label them all `train`.
    folder = posixpath.commonpath([posixpath.dirname(rel) for rel in chosen])
    return list(chosen.values()), split, f"{root.rstrip('/')}/{folder}" if folder else root
