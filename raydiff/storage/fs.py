"""Filesystems for URIs: local paths, file://, s3:// and gs://, through pyarrow.

Credentials come the standard way (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or
~/.aws, instance roles; GOOGLE_APPLICATION_CREDENTIALS or the metadata server), never from raydiff's config.
An S3-compatible server (MinIO, Ceph, moto) is reached with an endpoint: the config's key, or AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://")
SCHEMES = ("file://", *REMOTE_SCHEMES)
# google-cloud-cpp retries a failing GCS request for 15 minutes by default, so a missing credential or an
# unreachable endpoint left a run silent that long. A minute rides out transient errors (503s, rate limits), as
# pyarrow's 3 attempts do on S3. Then the error surfaces: one line before training, or a failed worker that Ray
# Train restarts from the last checkpoint.
GCS_RETRY_LIMIT = datetime.timedelta(seconds=60)


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_SCHEMES)


def scheme_of(uri: str) -> str | None:
    return uri.split("://", 1)[0] + "://" if "://" in uri else None


def filesystem_for(uri: str, *, endpoint: str | None = None, anonymous: bool = False) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) for a local path or a file://, s3:// or gs:// URI. Raises ValueError for
    other schemes."""
    if uri.startswith("s3://"):
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        options: dict = {"anonymous": anonymous}
        if endpoint:
            scheme, _, host = endpoint.rpartition("://")
            options.update(endpoint_override=host or endpoint, scheme=scheme or "https")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            options["region"] = region
        elif not endpoint:
            try:  # a bucket outside the default region answers only in its own region
                options["region"] = pafs.resolve_s3_region(uri[5:].split("/", 1)[0])
            except OSError:
                pass
        return pafs.S3FileSystem(**options), uri[5:].rstrip("/")
    if uri.startswith(("gs://", "gcs://")):
        options = {"anonymous": anonymous, "retry_time_limit": GCS_RETRY_LIMIT}
        if endpoint:
            scheme, _, host = endpoint.rpartition("://")
            options.update(endpoint_override=host or endpoint, scheme=scheme or "https")
        return pafs.GcsFileSystem(**options), uri.split("://", 1)[1].rstrip("/")
    if uri.startswith("file://"):
        return pafs.LocalFileSystem(), str(Path(uri[7:]).expanduser().resolve())
    if "://" in uri:
        raise ValueError(f"unsupported URI scheme {scheme_of(uri)!r}; supported: {', '.join(SCHEMES)} or a local path")
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


def join_uri(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])
