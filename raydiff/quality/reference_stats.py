"""The reference statistics that samples are compared with.

By default they are computed once from the run's `data.source`, read through raydiff's own ingest at the run's
resolution, and cached in `<run.storage>/.raydiff-reference/` keyed by the data's identity, the resolution and
the feature network with a digest of its weights (`Features.key`), so later runs, evaluations and every trial of
a sweep reuse them, and statistics measured with other weights are never used. `eval.ref` may instead name a
precomputed `.npz` with `mu` and `sigma` (the format of EDM and pytorch-fid), or another image folder.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import sys
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.npyio import NpzFile

from raydiff.data.errors import DataError
from raydiff.quality.errors import QualityError
from raydiff.quality.features import Features
from raydiff.quality.measure import parallel_stats, total
from raydiff.storage.errors import permanent_reason
from raydiff.storage.rundir import RunDir

CACHE_FOLDER = ".raydiff-reference"


@dataclass
class Reference:
    mu: np.ndarray
    sigma: np.ndarray
    count: int
    features: np.ndarray | None  # kept for KID
    description: str

    def features_for_kid(self) -> np.ndarray:
        if self.features is None:
            raise QualityError(f"KID needs the reference's features, and {self.description} has only mu/sigma; "
                               f"use eval.metrics=[fid], or a folder or the run's data as the reference")
        return self.features

    def to_npz(self) -> bytes:
        buffer = io.BytesIO()
        # Any: a **dict of arrays would also be checked against savez's allow_pickle: bool
        extra: dict[str, Any] = {"features": self.features} if self.features is not None else {}
        np.savez(buffer, mu=self.mu, sigma=self.sigma, count=self.count, **extra)
        return buffer.getvalue()


def read_npz(data: bytes, description: str) -> Reference:
    """Reference statistics from an .npz's bytes; QualityError (one line) for a file that is not one (empty, cut
    short, another kind of file) or holds no mu and sigma."""
    try:
        loaded = np.load(io.BytesIO(data))  # no pickles: a file of data, never code
    except (EOFError, zipfile.BadZipFile, ValueError, OSError):
        # numpy's own words would be "No data left in file", or advice to allow pickles
        raise QualityError(f"{description}: not a readable .npz (empty, cut short, or another kind of "
                           f"file)") from None
    if not isinstance(loaded, NpzFile):
        raise QualityError(f"{description}: a single array (.npy), not an .npz with mu and sigma")
    try:
        with loaded as npz:
            mu, sigma = np.asarray(npz["mu"], np.float64), np.asarray(npz["sigma"], np.float64)
            features = npz.get("features")
            count = int(npz["count"]) if "count" in npz else 0
    # A member that does not decompress or check (CRC) is a file cut or damaged inside: BadZipFile, zlib.error.
    except (KeyError, ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise QualityError(f"{description}: not an .npz with mu and sigma "
                           f"({(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
    if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
        raise QualityError(f"{description}: mu {mu.shape} and sigma {sigma.shape} do not match")
    return Reference(mu, sigma, count, features, description)


@contextmanager
def told_as_ref(ref: str | None, named: str) -> Iterator[None]:
    """A reference folder is read as a source is (its errors name data.source): told as the reference it is,
    by the setting that `named` it."""
    try:
        yield
    except DataError as exc:
        if not ref or not str(exc).startswith("data.source"):
            raise
        raise DataError(named + str(exc).removeprefix("data.source")) from None


def _npz_file(uri: str) -> tuple[RunDir, str]:
    folder, _, name = uri.rstrip("/").rpartition("/")
    return RunDir(folder or "."), name


def reference_for(cfg, features: Features, *, keep_features: bool, images=None,
                  named: str = "eval.ref") -> Reference:
    """The reference of `cfg.eval.ref` (see the module docstring). `images`: the run's data already decoded.
    `named`: the setting its errors name it by (`--ref` where a command's flag gave it)."""
    from raydiff.data.run_images import open_images
    from raydiff.data.sharded import ShardedImages
    from raydiff.data.sources import source_of

    ref = cfg.eval.ref
    if ref and ref.lower().endswith(".npz"):
        folder, name = _npz_file(ref)
        if not folder.is_file(name):
            raise QualityError(f"{named} = {ref!r}: no such file")
        reference = read_npz(folder.read_bytes(name), f"{named} {ref}")
        if features.dim is not None and len(reference.mu) != features.dim:  # found now, not after the sampling
            raise QualityError(f"{named} = {ref!r}: statistics of {len(reference.mu)}-d features, and this run "
                               f"measures with {features.name}, whose features are {features.dim}-d: give a "
                               f"reference of that network's features")
        return reference
    data = copy.deepcopy(cfg.data)
    if ref:
        data.source, data.format, images = ref, "auto", None
    with told_as_ref(ref, named):
        source = source_of(data)
    # With labels the images without one are left out (the run trains on the others): another set of images.
    labels = [data.labels, data.label_column] if data.labels == "auto" else []
    key = hashlib.sha256(json.dumps([source.identity(), data.resolution, data.channels, features.key,
                                     keep_features, *labels]).encode()).hexdigest()[:24]
    cache = RunDir(cfg.run.storage, endpoint=cfg.run.endpoint) / CACHE_FOLDER
    description = f"the reference statistics of {source.uri} at {data.resolution}px"
    if cache.is_file(f"{key}.npz"):
        try:
            return read_npz(cache.read_bytes(f"{key}.npz"), description)
        except QualityError as exc:  # a cache: one that does not read (cut short, emptied) is computed again
            why = str(exc).removeprefix(f"{description}: ")
            print(f"[raydiff] note: {cache / f'{key}.npz'}, where {description} were cached, cannot be read "
                  f"({why}); computing them again", file=sys.stderr)
    if images is None:
        with told_as_ref(ref, named):
            images, _ = open_images(data, source, storage=cfg.run.storage, endpoint=cfg.run.endpoint)
    host_memory = cfg.train.keep_host_memory
    if isinstance(images, ShardedImages):  # streamed: a few shards at a time, the usable images as in memory
        usable = np.zeros(images.num_images, bool)
        usable[images.usable_indices()] = True
        parts, start = [], 0
        for a in images.iter_arrays():
            kept, start = a[usable[start:start + len(a)]], start + len(a)
            if len(kept):
                parts.append(parallel_stats("arrays", kept, features, len(kept), host_memory=host_memory,
                                            keep_features=keep_features))
        stats = total(parts)
    else:
        arrays = np.concatenate(images.arrays())[images.usable_indices()]
        stats = parallel_stats("arrays", arrays, features, len(arrays), host_memory=host_memory,
                               keep_features=keep_features)
    if stats.count < 2:  # a covariance needs two
        setting = f"{named} = {ref!r}" if ref else f"data.source = {data.source!r} (the reference: eval.ref unset)"
        raise QualityError(f"{setting}: {stats.count} usable image(s); the reference statistics need at least 2")
    mu, sigma = stats.mu_sigma()
    reference = Reference(mu, sigma, stats.count, stats.all_features() if keep_features else None, description)
    try:
        cache.write_bytes(f"{key}.npz", reference.to_npz())
    except Exception as exc:  # a cache: a full disk costs the next measurement this one's time, nothing more
        reason = permanent_reason(exc)
        if reason is None:
            raise
        print(f"[raydiff] note: {description} were not kept in {cache} ({reason}); they are computed again next "
              f"time", file=sys.stderr)
    return reference
