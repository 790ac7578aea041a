"""What makes a data source unusable: the user-facing `DataError`, the record of one sample that cannot be used,
and the rule that stops a run before training when too much of a source is unusable.

Why a module of its own: sources, ingest, prepared shards and streaming all report bad samples the same way,
and none of them should import another just for that.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa


class DataError(ValueError):
    """The data source cannot be used (missing, empty, too many bad images); one line for the user."""


@contextmanager
def reading(uri: str, path: str) -> Iterator[None]:
    """Read `path`, a file of data.source `uri`: a file that cannot be read (permissions, network) or is not what its
    name says (a Parquet file without its footer, a .tar that is no archive) is one line naming it."""
    try:
        yield
    except (OSError, pa.ArrowException, tarfile.TarError) as exc:
        reason = str(exc).splitlines()[0][:200]
        if isinstance(exc, tarfile.TarError) and reason.endswith(":"):  # tarfile lists what it tried, line by line
            reason = "not a tar archive"
        raise DataError(f"data.source = {uri!r}: cannot read {path} ({reason})") from None


@dataclass(frozen=True)
class BadSample:
    index: int  # sample index (blank row in the store, never trained on)
    where: str  # file (and row or key) it came from
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "where": self.where, "reason": self.reason}


class HasBadSamples(Protocol):
    """What `check_bad_fraction` reads: an `ImageStore`, or the count a prepared-shard writer keeps."""

    @property
    def source(self) -> str: ...

    @property
    def num_images(self) -> int: ...

    @property
    def bad(self) -> tuple[BadSample, ...]: ...


def check_bad_fraction(store: HasBadSamples, max_bad_fraction: float,
                       setting: str = "data.max_bad_fraction") -> None:
    """Stop before training when too much of the source is unusable (the first few reasons say why); `setting`
    names where the limit was set (a command's flag, or the config key)."""
    if not store.bad:
        return
    fraction = len(store.bad) / store.num_images
    if len(store.bad) == store.num_images:  # even where data.max_bad_fraction = 1 allows it: nothing to train on
        examples = "; ".join(f"{b.where}: {b.reason}" for b in store.bad[:3])
        raise DataError(f"none of the {store.num_images} samples in {store.source} can be used, e.g. {examples}")
    if fraction > max_bad_fraction:
        examples = "; ".join(f"{b.where}: {b.reason}" for b in store.bad[:3])
        raise DataError(f"{len(store.bad)} of {store.num_images} samples in {store.source} cannot be used "
                        f"({fraction:.1%} > {setting} = {max_bad_fraction:g}), e.g. {examples}")


def usable_indices(num_images: int, bad: tuple[BadSample, ...]) -> np.ndarray:
    """The sample indices of a decoded source that can be trained on (all but the bad ones), sorted."""
    keep = np.ones(num_images, bool)
    keep[[b.index for b in bad]] = False
    return np.flatnonzero(keep)
