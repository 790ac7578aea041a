"""Which split of a Hugging Face Hub dataset each of its files belongs to, so that a run pointed at a dataset's
folder trains on its train split and never on its test split.

A Hub dataset keeps its splits side by side (`plain_text/train-00000-of-00001.parquet`, `plain_text/test-...`);
listing the folder finds them all. The Hub names splits by where files are, in this order of precedence
(https://huggingface.co/docs/hub/datasets-file-names-and-splits, as `datasets` reads them): sharded files
`data/<split>-00000-of-00001.*`; else folders whose name holds a split's keyword; else file names that hold one.
A keyword counts when non-word characters (`-._ 0-9`) or the ends of the name delimit it (`test-file.csv` is
test, `testfile.csv` is not), and each split has its synonyms (`dev` and `val` are validation, `eval` is test).
A split whose files lie in several folders is refused: a repository's subsets (`mnist/train-*`,
`fashion/train-*`) are different datasets. This module reads names only; where a repository's card names its
configs and their files, the card comes first (`raydiff.data.hub_card`), and a glob in `data.source` picks any
files.
"""

from __future__ import annotations

import os
import re
from pathlib import PurePosixPath

from raydiff.data.errors import DataError

TRAIN = "train"
SPLIT_KEYWORDS = {TRAIN: ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SEPARATORS = r"[-._ 0-9]"
_SHARDED = re.compile(r"data/(\w+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")


def _keyword_rule(words: tuple[str, ...], *, file_name: bool = False) -> re.Pattern[str]:
    """A name (fullmatch) holding one of `words` between separators or the name's ends, the first such; in a file
    name a separator always follows it (the extension's dot at least). Group 2 is the keyword."""
    after = f"{_SEPARATORS}.*" if file_name else f"({_SEPARATORS}.*)?"
    return re.compile(rf"(.*?{_SEPARATORS})??({'|'.join(words)}){after}")


_FOLDER = {split: _keyword_rule(words) for split, words in SPLIT_KEYWORDS.items()}
_FILE = {split: _keyword_rule(words, file_name=True) for split, words in SPLIT_KEYWORDS.items()}


def splits_of(paths: list[str]) -> dict[str, list[str]]:
    """{split: its paths} of paths relative to a dataset's folder, by the first of the Hub's rules that names any
    split; {} when none does (then the whole folder is one split, as on the Hub). A path no rule places is in
    no split."""
    sharded: dict[str, list[str]] = {}
    for path in paths:
        if match := _SHARDED.fullmatch(path):
            sharded.setdefault(match.group(1), []).append(path)
    if sharded:
        return sharded
    for rules, in_folder in ((_FOLDER, True), (_FILE, False)):
        found: dict[str, list[str]] = {}
        for path in paths:
            parts = PurePosixPath(path).parent.parts if in_folder else (PurePosixPath(path).name,)
            split = next((s for s, rule in rules.items() if any(rule.fullmatch(part) for part in parts)), None)
            if split is not None:
                found.setdefault(split, []).append(path)
        if found:
            return found
    return {}


def train_split(uri: str, files: list[str], folder: str) -> tuple[list[str], str, str]:
    """(the files to train on, their split: "" for the whole folder, the folder their class subfolders are in) of
    `files`, the full paths of a Hub dataset's files listed under `folder` (`data.source = uri`): its train split,
    or its only split. Raises DataError when the folder holds several splits and none of them is train."""
    if not files:  # none of the kinds raydiff reads (a dataset of .zip or .csv files): its caller says so
        return [], "", folder
    root = folder.rstrip("/") + "/" if folder else ""
    full = {f[len(root):]: f for f in files}
    splits = splits_of(list(full))
    if not splits:  # all of it one split: its classes are the folders its images are in, as `datasets` reads them
        common = os.path.commonpath([str(PurePosixPath(p).parent.parent) for p in full])
        return files, "", root + common if common else folder
    if TRAIN not in splits and len(splits) > 1:
        named = "; ".join(f"{split}: {len(paths)} file{'s' if len(paths) > 1 else ''}, e.g. {paths[0]}"
                          for split, paths in sorted(splits.items()))
        first = min(splits)
        raise DataError(f"data.source = {uri!r} holds several splits and no train split ({named}): name the files "
                        f"of one with a glob, e.g. {uri.rstrip('/')}/{glob_of(splits[first][0], first)}")
    chosen = TRAIN if TRAIN in splits else next(iter(splits))
    paths = splits[chosen]
    # A split in several folders is several datasets (a repository's subsets, `mnist/` and `fashion/`): not one.
    subsets: dict[str, list[str]] = {}
    for path in paths:
        subsets.setdefault(_subset_of(path, chosen), []).append(path)
    if len(subsets) > 1:
        named = "; ".join(f"{subset or '.'}: {len(found)} file{'s' if len(found) > 1 else ''}"
                          for subset, found in sorted(subsets.items()))
        first = min(subsets)
        example = first or glob_of(subsets[first][0], chosen)  # a folder, or a glob for the files beside them
        raise DataError(f"data.source = {uri!r}: its {chosen} split lies in several folders, subsets of the dataset "
                        f"({named}): name one, e.g. {uri.rstrip('/')}/{example}")
    # Images in split folders keep their classes one level down (`train/cat/0.png`): the split's folder is the root.
    top = _split_folder(paths[0], chosen)
    return [full[p] for p in paths], chosen, root + top if top else folder


def _split_folder(path: str, split: str) -> str | None:
    """The folders of `path` down to the one named for `split`; None when no folder is."""
    rule, parts = _FOLDER.get(split), PurePosixPath(path).parent.parts
    named = next((i for i, part in enumerate(parts) if rule and rule.fullmatch(part)), None)
    return "/".join(parts[:named + 1]) if named is not None else None


def _subset_of(path: str, split: str) -> str:
    """The folder above the split's files: above its split folder, or the folder of a file named for it."""
    folder = _split_folder(path, split)
    parent = PurePosixPath(folder if folder is not None else path).parent
    return "" if parent == PurePosixPath(".") else str(parent)


def glob_of(path: str, split: str) -> str:
    """A glob for the files of `split` shaped like `path`, one of them: the part that names the split cut after
    its keyword (`data/test-en.parquet` -> `data/test*.parquet`), each part below it `*`."""
    rule = _FOLDER.get(split) or _keyword_rule((re.escape(split),))
    parts = PurePosixPath(path).parts
    for i, part in enumerate(parts):
        if match := rule.fullmatch(part):
            below = ["*"] * (len(parts) - i - 1)
            return "/".join([*parts[:i], part[:match.end(2)] + "*", *below]) + PurePosixPath(path).suffix
    return path
