"""Each sample's class, from the source's own labels (`data.labels: auto`).

Where a source keeps its labels: an image folder, in the first-level subfolder under `data.source` (torchvision
ImageFolder's convention); Parquet, in the column `data.label_column`; WebDataset, in each sample's `.cls` member;
prepared data, in the `label` column that `raydiff.prepare --labels auto` writes (its manifest names the classes);
`builtin:digits`, in the file name (`NNNN_digitL.png`, so that the files, and the unconditional run's sample order,
stay as they were).

Labels travel through decoding as text, one per sample ("" for none), and become class ids once every label is
known: names are numbered in sorted order (ImageFolder's rule); integer labels are ids as they are, named by
str(id), with max + 1 classes, or by the names a Hugging Face `datasets` file gives them (a `ClassLabel` feature
in its schema's metadata: CIFAR-10's "airplane" ... "truck"; a label is then its name from the start). A Parquet
column's type says which it is; a `.cls` text is read as ids when every label is an integer, else as names. Why
text: a streamed preparation writes shards before it has seen every label, so the shards keep the names and the
manifest the numbering. A sample without a usable label is reported like one that cannot be decoded
(`raydiff.data.errors.BadSample`); a source with no labels at all is one line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydiff.config.schema import MAX_CLASSES
from raydiff.data.errors import BadSample, DataError, reading, usable_indices
from raydiff.data.hub_features import class_label_names

LABEL_COLUMN = "label"  # the column of prepared shards that holds each sample's class name
UNLISTED_CLASS = "no label: its class is not one of the manifest's classes"  # a bad sample's reason
_DIGIT = re.compile(r"_digit(\d+)\.[A-Za-z]+$")
_INTEGER = re.compile(r"[+-]?\d+")

# How a source's labels become ids: `names` sorted, `ids` as they are, `text` ids if every label is an integer
# (else names), `manifest` the classes a prepared folder's manifest lists, `named` ids as they are with the names
# the data gives them (`classes`).
Rule = Literal["names", "ids", "text", "manifest", "named"]


@dataclass(frozen=True)
class LabelPlan:
    """Where the samples of one source keep their labels, and how they become ids; picklable (Ray Data tasks).

    :param where: folder (first-level subfolder under `root`), digits (the file name), column (a Parquet column),
        cls (WebDataset `.cls` members), prepared (the prepared shards' label column).
    :param rule: how labels become ids (see `Rule`).
    :param root: folder: the path `data.source` names, within its filesystem.
    :param column: the Parquet column (prepared data: `LABEL_COLUMN`).
    :param classes: prepared data: the manifest's class names; `named`: the name of each id.
    """

    where: Literal["folder", "digits", "column", "cls", "prepared"]
    rule: Rule
    root: str = ""
    column: str = ""
    classes: tuple[str, ...] = ()

    def of_path(self, path: str) -> tuple[str, str]:
        """(label, why there is none) of an image file."""
        if self.where == "digits":
            match = _DIGIT.search(PurePosixPath(path).name)
            return (str(int(match.group(1))), "") if match else ("", "no label: the file name names no digit")
        return folder_label(path, self.root), "no label: not in a class subfolder of data.source"

    def of_value(self, value: Any) -> tuple[str, str]:
        """(label, why there is none) of a Parquet cell or a `.cls` member."""
        if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
            return "", f"no label: {self._what()} is null" if self.where != "cls" else "no label: no .cls member"
        if isinstance(value, (bytes, bytearray, memoryview)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                return "", f"no label: {self._what()} is not UTF-8 text"
        if isinstance(value, str):
            # A prepared copy's names are as written, class folders' names with their spaces: as stream mode
            # reads them (`read_labels`). Other text is a user's, trimmed.
            text = value if self.rule == "manifest" else value.strip()
            if not text:
                return "", f"no label: {self._what()} is empty"
            if self.rule != "text" or not _INTEGER.fullmatch(text):
                return text, ""  # a name (prepared data: the name written)
            value = int(text)
        if isinstance(value, (bool, np.bool_)):
            value = int(value)
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            return "", f"no label: {self._what()} {value!r} is not a whole number"
        number = int(value)
        if number < 0:
            return "", f"no label: {self._what()} is {number} (negative: none)"
        if self.rule == "named":
            if number >= len(self.classes):
                return "", f"no label: {self._what()} is {number}; its dataset names {len(self.classes)} classes"
            return self.classes[number], ""
        return str(number), ""

    def _what(self) -> str:
        return ".cls" if self.where == "cls" else f"column {self.column!r}"


def folder_label(path: str, root: str) -> str:
    """The first-level subfolder of `path` under `root`, or "" for a file directly in `root`."""
    root = root.rstrip("/")
    if not path.startswith(root + "/"):
        return ""
    parts = path[len(root) + 1:].split("/")
    return parts[0] if len(parts) > 1 else ""


def plan_labels(source, label_column: str) -> LabelPlan:
    """Where `source` (a `raydiff.data.sources.Source`) keeps its labels; one line (DataError) when it has none
    that `data.labels = 'auto'` could read."""
    where = f"data.labels = 'auto': data.source = {source.uri!r}"
    if source.kind == "prepared":
        classes = source.manifest.get("classes")
        if classes is None:
            version = source.manifest.get("version", 1)
            made = "made before labels existed" if version < 3 else "prepared without --labels auto"
            raise DataError(f"{where} is prepared data without labels (version {version}, {made}): prepare it "
                            f"again with python -m raydiff.prepare --labels auto")
        return LabelPlan("prepared", "manifest", column=LABEL_COLUMN, classes=tuple(classes))
    if source.kind == "images":
        if source.uri == "builtin:digits":
            return LabelPlan("digits", "names")
        plan = LabelPlan("folder", "names", root=source.root)
        if source.files == (source.root,):  # one image file: no folder for classes
            raise DataError(f"{where} is one image file: its class would be the name of a subfolder of a folder "
                            f"source; give the folder of class subfolders")
        if not any(folder_label(f, source.root) for f in source.files):
            raise DataError(f"{where} has no class subfolders; put each class's images in "
                            f"{source.uri.rstrip('/')}/<class>/")
        return plan
    if source.kind == "webdataset":  # known only once read: `check_found` says so if no sample has a .cls
        return LabelPlan("cls", "text")
    with reading(source.uri, source.files[0]):
        schema = pq.read_schema(source.files[0], filesystem=source.filesystem)
    if label_column not in schema.names:
        raise DataError(f"{where}: data.label_column = {label_column!r} is not a column of {source.files[0]}; its "
                        f"columns: {', '.join(schema.names)}")
    kind = schema.field(label_column).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        names = class_label_names(schema, label_column)
        return LabelPlan("column", "named" if names else "ids", column=label_column, classes=names)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return LabelPlan("column", "names", column=label_column)
    raise DataError(f"{where}: data.label_column = {label_column!r} holds {kind} values in {source.files[0]}; "
                    f"expected integer class ids or class names (strings)")


def missing_labels(source) -> DataError:
    """The one line for a source none of whose samples has a label (known only once read: WebDataset)."""
    where = f"data.labels = 'auto': data.source = {source.uri!r}"
    if source.kind == "webdataset":
        return DataError(f"{where} has no .cls members; give each sample its class as <key>.cls (an integer id or "
                         f"a name)")
    return DataError(f"{where}: no sample has a label")


def resolve_classes(names: Iterable[str], plan: LabelPlan, source: str) -> tuple[str, ...]:
    """The class names, id = position, of every label seen (labels "" excluded)."""
    if plan.rule in ("manifest", "named"):
        return plan.classes
    found = {n for n in names if n}
    # _INTEGER, as `of_value` reads ids: str.isdigit takes "²" too, which int() does not.
    as_ids = plan.rule == "ids" or (plan.rule == "text" and all(_INTEGER.fullmatch(n) for n in found))
    if as_ids:
        top = max((int(n) for n in found), default=-1)
        if top >= MAX_CLASSES:
            raise DataError(f"data.labels = 'auto': data.source = {source!r} has class id {top}: ids must be below "
                            f"{MAX_CLASSES} (classes are numbered 0 to the largest id)")
        return tuple(str(i) for i in range(top + 1))
    if len(found) > MAX_CLASSES:
        raise DataError(f"data.labels = 'auto': data.source = {source!r} has {len(found)} different labels: at most "
                        f"{MAX_CLASSES} classes (is it the right label source?)")
    return tuple(sorted(found))


def class_ids(names: np.ndarray, classes: tuple[str, ...]) -> np.ndarray:
    """int32 ids of label texts (-1 for "" and for a name not in `classes`)."""
    ids = {name: i for i, name in enumerate(classes)}
    return np.fromiter((ids.get(str(n), -1) for n in names), np.int32, len(names))


def class_counts(labels: np.ndarray, usable: np.ndarray, num_classes: int) -> list[int]:
    """Usable samples per class."""
    chosen = labels[usable]
    return np.bincount(chosen[chosen >= 0], minlength=num_classes).tolist()


class LabelledSamples:
    """What a decoded dataset (`ImageStore`) and a streamed one (`ShardedImages`) share: the samples by index,
    the bad ones among them, and their classes. The dataclasses that use it declare the fields below."""

    counts: tuple[int, ...]  # samples per chunk or shard
    bad: tuple[BadSample, ...]
    labels: np.ndarray | None  # int32 class id of every sample index (-1: none, a bad sample); None without labels
    classes: tuple[str, ...]  # the class names, id = position (empty without labels)

    @property
    def num_images(self) -> int:
        """Samples by index, including the bad ones."""
        return sum(self.counts)

    @property
    def num_good(self) -> int:
        return self.num_images - len(self.bad)

    def usable_indices(self) -> np.ndarray:
        """Sample indices that hold an image, sorted."""
        return usable_indices(self.num_images, self.bad)

    def class_counts(self) -> list[int]:
        """Usable samples per class (bad ones excluded); [] without labels."""
        return [] if self.labels is None else class_counts(self.labels, self.usable_indices(), len(self.classes))

    def label_summary(self) -> dict[str, Any]:
        """For data.json: {"classes": names, "class_counts": usable samples per class}; {} without labels."""
        if self.labels is None:
            return {}
        return {"classes": list(self.classes), "class_counts": self.class_counts()}


def read_labels(filesystem, files: tuple[str, ...], classes: tuple[str, ...], uri: str) -> np.ndarray:
    """int32 ids of every row of prepared shards, in order (the label column only: cheap); a shard that cannot
    be read (cut short) is one line naming it (data.source `uri`)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path: str) -> np.ndarray:
        with reading(uri, path):
            column = pq.read_table(path, filesystem=filesystem, columns=[LABEL_COLUMN]).column(LABEL_COLUMN)
        encoded = column.combine_chunks().dictionary_encode()
        lookup = class_ids(np.asarray(encoded.dictionary.to_pylist(), dtype=object), classes)
        indices = encoded.indices.to_numpy(zero_copy_only=False)
        return lookup[indices] if len(lookup) else np.full(len(indices), -1, np.int32)

    with ThreadPoolExecutor(8) as pool:
        parts = list(pool.map(one, files))
    return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)
