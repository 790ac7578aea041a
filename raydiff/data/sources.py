"""What `data.source` names: its filesystem, its kind and its files, in a reproducible order.

Kinds: a folder (recursive) or a single file of images; Parquet files with an encoded-image column (bytes, or
Hugging Face's {bytes, path} struct) or a decoded uint8 tensor column; WebDataset `.tar` shards; a folder written
by `python -m raydiff.prepare` (its manifest.json says so); `builtin:digits`. Each may be a local path or a
file://, s3://, gs:// or hf:// (Hugging Face Hub) URI, and its last parts a glob (`train-*.parquet`: one split of
a Hub dataset). A Hub dataset's folder gives its train split: as its card says, at the repository's root
(`raydiff.data.hub_card`), else as its files' names say (`raydiff.data.hub_splits`). Files are sorted, so that
sample i is the same image in every run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

import pyarrow.fs as pafs

from raydiff.data.errors import DataError, reading
from raydiff.data.hub_card import CARD, card_split
from raydiff.data.hub_splits import train_split
from raydiff.data.shard_format import PREPARED_VERSION, read_manifest
from raydiff.storage.fs import HUB_SCHEME, filesystem_for, glob_match, glob_split, is_remote

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
FileKind = Literal["images", "parquet", "webdataset"]  # told from the files' extensions (or data.format)
KIND_EXTENSIONS: dict[FileKind, tuple[str, ...]] = {"images": IMAGE_EXTENSIONS, "parquet": (".parquet",),
                                                    "webdataset": (".tar",)}
KIND_LABELS: dict[FileKind, str] = {"images": "image", "parquet": "Parquet", "webdataset": "WebDataset"}

Kind = Literal["images", "parquet", "webdataset", "prepared"]


@dataclass(frozen=True)
class Source:
    """A listed data source.

    :param uri: `data.source` as the user gave it.
    :param kind: how its files are read.
    :param filesystem: pyarrow filesystem of the files; pickles, so Ray Data tasks can open them anywhere.
    :param files: paths within the filesystem, sorted (for `prepared`: the manifest's shard order).
    :param sizes: byte size of each file.
    :param manifest: the prepare manifest (only for `prepared`).
    :param root: the path `data.source` names within the filesystem (a folder's class subfolders are under it).
    :param split: the split of a Hugging Face Hub dataset its files are, where its folder holds several
        (`raydiff.data.hub_splits`); "" otherwise.
    """

    uri: str
    kind: Kind
    filesystem: pafs.FileSystem
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    manifest: dict[str, Any] = field(default_factory=dict)
    root: str = ""
    split: str = ""

    def identity(self) -> dict[str, Any]:
        """Count and fingerprint of the files (relative names and sizes): a changed source is caught on resume."""
        root = _common_root(self.files)
        digest = hashlib.sha256()
        for path, size in zip(self.files, self.sizes, strict=True):
            digest.update(f"{_relative(path, root)}\0{size}\n".encode())
        return {"source": self.uri, "kind": self.kind, "num_files": len(self.files),
                "fingerprint": digest.hexdigest()[:16]}

    def describe(self) -> str:
        what = {"images": "image files", "parquet": "Parquet files", "webdataset": "WebDataset shards",
                "prepared": "prepared shards"}[self.kind]
        split = f" (its {self.split} split)" if self.split else ""
        return f"{len(self.files)} {what if len(self.files) != 1 else what[:-1]} in {self.uri}{split}"


def _common_root(files: tuple[str, ...]) -> str:
    parents = [PurePosixPath(f).parent.parts for f in files]
    common = parents[0]
    for parts in parents[1:]:
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return str(PurePosixPath(*common)) if common else ""


def _relative(path: str, root: str) -> str:
    return path[len(root):].lstrip("/") if root and path.startswith(root) else path


def _kind_of(path: str) -> FileKind | None:
    suffix = PurePosixPath(path).suffix.lower()
    return next((kind for kind, extensions in KIND_EXTENSIONS.items() if suffix in extensions), None)


def open_source(source: str | None, *, format: FileKind | Literal["auto"] = "auto", endpoint: str | None = None,
                anonymous: bool = False) -> Source:
    """List `source`. Raises DataError when it is missing, empty or ambiguous."""
    if not source:
        raise DataError("data.source is not set: give a folder or file of images, Parquet or WebDataset shards, "
                        "as a path or an s3://, gs:// or hf:// URI")
    if source.startswith("builtin:"):
        from raydiff.data.builtin import builtin_folder

        try:
            folder = builtin_folder(source)
        except ValueError as exc:
            raise DataError(f"data.source = {source!r}: {exc}") from None
        return _list(source, str(folder), pafs.LocalFileSystem(), format)
    try:
        filesystem, path = filesystem_for(source, endpoint=endpoint, anonymous=anonymous, hub=True)
    except ValueError as exc:
        raise DataError(f"data.source = {source!r}: {exc}") from None
    except RuntimeError as exc:  # `~nosuchuser/...`, a symlink loop: Path's expanduser and resolve raise these
        raise DataError(f"data.source = {source!r}: cannot look at it ({exc})") from None
    return _list(source, path, filesystem, format)


_SEEN_BY: dict[str, set[str]] = {}  # a local file -> the ids of the nodes that answered that they see it


def check_on_every_node(source: Source, probe=None) -> None:
    """A source on this machine's disk that tasks on the cluster's nodes read (Ray Data's, the stream's node
    caches) must be on every node: on a multi-node cluster, refused up front in one line where it is not (a task
    on each node looks for one of its files). A node that said it sees the file is not asked again: a streamed
    run checks as it prepares its copy and again as Ray Data reads. `probe`: for tests
    (`raydiff.cluster.storage.nodes_without`)."""
    if not isinstance(source.filesystem, pafs.LocalFileSystem) or not source.files:
        return
    from raydiff.cluster import storage

    if not storage.several_nodes():
        return
    seen_by = _SEEN_BY.setdefault(source.files[0], set())
    if {n["NodeID"] for n in storage.alive_nodes()} <= seen_by:
        return
    missing = storage.nodes_without(source.files[0], probe, seen_by=seen_by)
    if missing:
        raise DataError(f"data.source = {source.uri!r} is not on every node: node(s) {', '.join(missing)} cannot see "
                        f"{source.files[0]}. On a multi-node cluster Ray Data reads it from every node: use "
                        f"{storage.SHARED_INSTEAD}; to copy a folder to a bucket, run `RAY_ADDRESS=local python -m "
                        f"raydiff.prepare FOLDER s3://BUCKET/PREFIX --resolution R` where the folder is")


def _hidden(path: str, folder: str) -> bool:
    """Whether `path`, or a folder it is in below `folder`, is hidden (a name that starts with a dot): what tools
    keep beside data (Jupyter's .ipynb_checkpoints/ copies of images, .git/, raydiff's own .raydiff-leases/) is
    not data, and a hidden folder would become a class of its own."""
    base = folder.rstrip("/") + "/"
    below = path[len(base):] if path.startswith(base) else PurePosixPath(path).name
    return any(part.startswith(".") for part in PurePosixPath(below).parts)


def source_of(data) -> Source:
    """The source a config's `data` section names (see `open_source`)."""
    return open_source(data.source, format=data.format, endpoint=data.endpoint, anonymous=data.anonymous)


def _list(uri: str, path: str, filesystem: pafs.FileSystem, format: FileKind | Literal["auto"]) -> Source:
    try:
        info = filesystem.get_file_info(path)
        folder, pattern = glob_split(path) if info.type == pafs.FileType.NotFound else (path, None)
        if pattern is not None:
            info = filesystem.get_file_info(folder)
        if info.type == pafs.FileType.NotFound or (pattern is not None and info.type != pafs.FileType.Directory):
            hint = (" (a private or gated dataset needs a token: HF_TOKEN, or `hf auth login`)"
                    if uri.startswith(HUB_SCHEME) else "")
            raise DataError(f"data.source = {uri!r}: no such file or folder{hint}")
        if info.type == pafs.FileType.File:
            found = [info]
        else:
            manifest = read_manifest(filesystem, path) if pattern is None else None
            if manifest is not None:
                return _prepared(uri, path, filesystem, manifest)
            found = [f for f in filesystem.get_file_info(pafs.FileSelector(folder, recursive=True))
                     if f.type == pafs.FileType.File and (pattern is None or _matched(f.path, pattern))]
    except OSError as exc:  # permissions, credentials, network: say so in one line
        raise DataError(f"data.source = {uri!r}: cannot read it ({str(exc).splitlines()[0][:200]})") from None
    if pattern is not None and not found:
        raise DataError(f"data.source = {uri!r}: no file matches it")

    by_kind: dict[FileKind, list[pafs.FileInfo]] = {}
    for f in found:
        kind = _kind_of(f.path)
        # A file named as the source itself is taken as named, hidden or not.
        if kind is not None and (info.type == pafs.FileType.File or not _hidden(f.path, folder)):
            by_kind.setdefault(kind, []).append(f)
    hub_repository = uri.startswith(HUB_SCHEME) and pattern is None and info.type == pafs.FileType.Directory
    card = _hub_card(uri, filesystem, folder, found) if hub_repository else ""
    if format != "auto":
        chosen = format
    elif len(by_kind) > 1:
        # A Hub dataset's card comes first: its train split's files decide (a preview image beside Parquet data).
        by_split = _kinds_of_card_split(uri, card, by_kind, folder) if card else []
        if len(by_split) != 1:
            counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_kind.items()))
            raise DataError(f"data.source = {uri!r} holds several kinds of files ({counts}): set data.format to one "
                            f"of {', '.join(KIND_EXTENSIONS)}")
        chosen = by_split[0]
    else:
        chosen = next(iter(by_kind), "images")
    files = sorted(by_kind.get(chosen, []), key=lambda f: f.path)
    split = ""
    if hub_repository:
        paths = [f.path for f in files]
        by_card = card_split(uri, card, paths, folder, KIND_LABELS[chosen]) if card else None
        paths, split, folder = by_card or train_split(uri, paths, folder)
        wanted = set(paths)
        files = [f for f in files if f.path in wanted]
    if not files:
        looked_for = ", ".join(KIND_EXTENSIONS[chosen])
        converted = ("; the Hub's Parquet conversion of a dataset of other files is at "
                     "hf://datasets/OWNER/NAME@refs%2Fconvert%2Fparquet/CONFIG" if hub_repository else "")
        raise DataError(f"data.source = {uri!r}: no {KIND_LABELS[chosen]} files found (looked for {looked_for}"
                        f"{'' if is_remote(uri) else ', recursively'}){converted}")
    return Source(uri=uri, kind=chosen, filesystem=filesystem, files=tuple(f.path for f in files),
                  sizes=tuple(int(f.size) for f in files), root=folder, split=split)


def _kinds_of_card_split(uri: str, card: str, by_kind: dict[FileKind, list[pafs.FileInfo]],
                         folder: str) -> list[FileKind]:
    """The kinds of file among `by_kind` that the split a Hub dataset's `card` trains on holds."""
    kinds = []
    for kind, infos in sorted(by_kind.items()):
        try:
            chosen = card_split(uri, card, [f.path for f in infos], folder, KIND_LABELS[kind])
        except DataError:  # its split matches none of this kind's files
            continue
        if chosen is not None and chosen[0]:
            kinds.append(kind)
    return kinds


def _hub_card(uri: str, filesystem: pafs.FileSystem, folder: str, listed: list[pafs.FileInfo]) -> str:
    """The card (README.md) of the Hub dataset whose repository's root `folder` is (`datasets/OWNER/NAME`), from
    the files `listed` there; "" for a folder inside a repository, or a repository without a card."""
    card = f"{folder.rstrip('/')}/{CARD}"
    if len(PurePosixPath(folder).parts) != 3 or card not in {f.path for f in listed}:
        return ""
    with reading(uri, card), filesystem.open_input_stream(card) as stream:
        return stream.read().decode("utf-8", errors="replace")


def _matched(path: str, pattern: str) -> bool:
    """Whether a glob picks the file `path`: it matches the file, or a folder the file is in (`imgs/2026-*` picks
    the files of the folders it names, as a folder given as it is would)."""
    return glob_match(path, pattern) or any(glob_match(str(folder), pattern) for folder in PurePosixPath(path).parents)


def _prepared(uri: str, folder: str, filesystem: pafs.FileSystem, manifest: dict[str, Any]) -> Source:
    if manifest.get("version", 1) > PREPARED_VERSION:
        raise DataError(f"data.source = {uri!r}: prepared data version {manifest['version']}, newer than this "
                        f"raydiff reads (up to {PREPARED_VERSION}): upgrade raydiff, or prepare it again")
    files = tuple(f"{folder.rstrip('/')}/{name}" for name in manifest["shards"])
    infos = filesystem.get_file_info(list(files))
    missing = [i.path for i in infos if i.type != pafs.FileType.File]
    if missing:
        raise DataError(f"data.source = {uri!r}: prepared data is incomplete ({len(missing)} shard(s) missing, "
                        f"e.g. {missing[0]}); run python -m raydiff.prepare again")
    return Source(uri=uri, kind="prepared", filesystem=filesystem, files=files,
                  sizes=tuple(int(i.size) for i in infos), manifest=manifest, root=folder)
