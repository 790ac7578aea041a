"""Filesystems for URIs: local paths, file://, s3:// and gs://, through pyarrow; and, for data only, hf:// (the
Hugging Face Hub, through huggingface_hub's fsspec filesystem).

Credentials come the standard way (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or
~/.aws, instance roles; GOOGLE_APPLICATION_CREDENTIALS or the metadata server; HF_TOKEN or `hf auth login`),
never from raydiff's config. An S3-compatible server (MinIO, Ceph, moto) is reached with an endpoint: the
config's key, or AWS_ENDPOINT_URL; a Hub mirror the same way (or HF_ENDPOINT).

A data source's last parts may be a glob (`train-*.parquet`): a Hub dataset keeps its splits side by side.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

import pyarrow.fs as pafs

HUB_SCHEME = "hf://"  # read-only to raydiff: a data source, never a run's storage
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "gcs://")
REMOTE_SCHEMES = (*OBJECT_STORE_SCHEMES, HUB_SCHEME)
STORAGE_SCHEMES = ("file://", *OBJECT_STORE_SCHEMES)
SCHEMES = (*STORAGE_SCHEMES, HUB_SCHEME)  # what data.source may name
GLOB_CHARACTERS = "*?["
# A scheme raydiff reads, with one slash or none after its colon: a URI mistyped, not a folder anyone names so.
MISTYPED_SCHEME = re.compile(r"(s3|gs|gcs|hf|file):/?(?!/)", re.IGNORECASE)
# google-cloud-cpp retries a failing GCS request for 15 minutes by default, so a missing credential or an
# unreachable endpoint left a run silent that long. A minute rides out transient errors (503s, rate limits), as
# S3's retries do (S3_RETRY_ATTEMPTS). Then the error surfaces: one line before training, or a failed worker that Ray
# Train restarts from the last checkpoint.
GCS_RETRY_LIMIT = datetime.timedelta(seconds=60)
# pyarrow's default S3 retries (AWS's "standard" strategy, 3 attempts) spend a budget per filesystem that pyarrow
# never refills, so after about a hundred retried 503s in a worker's life every transient error failed the worker.
# AWS's "default" strategy has no budget; 6 retries back off, doubling, for about 1.6 s in all, so that an
# endpoint where nothing answers is still a one-line error within seconds (10 retries made it 26 s).
S3_RETRY_ATTEMPTS = 6


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_SCHEMES)


def scheme_of(uri: str) -> str | None:
    return uri.split("://", 1)[0] + "://" if "://" in uri else None


def filesystem_for(uri: str, *, endpoint: str | None = None, anonymous: bool = False,
                   hub: bool = False) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) for a local path or a file://, s3:// or gs:// URI, and with `hub` an hf://
    URI. Raises ValueError for other schemes, and for an object store URI without a bucket."""
    if uri.startswith(HUB_SCHEME):
        if not hub:
            raise ValueError(f"{HUB_SCHEME} (the Hugging Face Hub) is for data.source only; raydiff writes to a "
                             f"local path, s3:// or gs://")
        problem = hub_uri_problem(uri)
        if problem:
            raise ValueError(problem)
        return _hub_filesystem(endpoint, anonymous), uri[len(HUB_SCHEME):].rstrip("/")
    problem = bucket_uri_problem(uri)
    if problem:
        raise ValueError(problem)
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
                options["region"] = bucket_region(uri[5:].split("/", 1)[0])
            except OSError:  # not known now (offline, no such bucket): the default, and the next call asks again
                pass
        return RetryingS3FileSystem(**options), uri[5:].rstrip("/")
    if uri.startswith(("gs://", "gcs://")):
        # https unless an endpoint says otherwise: pyarrow's anonymous client defaults to plain http.
        options = {"anonymous": anonymous, "retry_time_limit": GCS_RETRY_LIMIT, "scheme": "https"}
        if endpoint:
            scheme, _, host = endpoint.rpartition("://")
            options.update(endpoint_override=host or endpoint, scheme=scheme or "https")
        return pafs.GcsFileSystem(**options), uri.split("://", 1)[1].rstrip("/")
    if uri.startswith("file://"):
        return pafs.LocalFileSystem(), str(Path(uri[7:]).expanduser().resolve())
    if "://" in uri:
        schemes = SCHEMES if hub else STORAGE_SCHEMES
        raise ValueError(f"unsupported URI scheme {scheme_of(uri)!r}; supported: {', '.join(schemes)} or a local path")
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


_REGIONS: dict[str, str] = {}  # bucket -> its region, as S3 answered


def bucket_region(bucket: str) -> str:
    """The region of an S3 bucket, asked once per process (a run builds a file system per path it touches, and
    each question is a request to S3); OSError where S3 does not say, asked again the next time."""
    if bucket not in _REGIONS:
        _REGIONS[bucket] = pafs.resolve_s3_region(bucket)
    return _REGIONS[bucket]


class RetryingS3FileSystem(pafs.S3FileSystem):
    """An S3FileSystem with raydiff's retries (S3_RETRY_ATTEMPTS), also once pickled: pyarrow's own pickle drops the
    retry strategy, and Ray Train's controller and workers get the run's storage filesystem pickled."""

    def __init__(self, **options) -> None:
        super().__init__(retry_strategy=pafs.AwsDefaultS3RetryStrategy(max_attempts=S3_RETRY_ATTEMPTS), **options)
        self.options = options

    def __reduce__(self):
        return _retrying_s3, (self.options,)


def _retrying_s3(options: dict) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(**options)


def bucket_uri_problem(uri: str) -> str | None:
    """Why an s3:// or gs:// URI names no bucket (`s3://`, `gs:///data`), or a URI is mistyped (`s3:/bucket`);
    None when it names one, or is no such URI (whether the bucket exists is the store's to say). Without this check
    `s3://` or `s3:/bucket` became a local folder `s3:`."""
    scheme = scheme_of(uri)
    if scheme is None and (typo := MISTYPED_SCHEME.match(uri)):  # `s3:/bucket`: a local folder named `s3:`
        return (f"a URI is {typo.group(1).lower()}://...; as written this is a local folder named "
                f"{uri.split('/', 1)[0]!r} (write ./{uri} for that)")
    if scheme not in OBJECT_STORE_SCHEMES:
        return None
    return None if uri[len(scheme):].split("/", 1)[0] else f"an object store location is {scheme}BUCKET[/PREFIX]"


def hub_uri_problem(uri: str) -> str | None:
    """Why an hf:// URI names no dataset on the Hub; None when it names one (whether it exists is the Hub's to say)."""
    kind, owner, name = ([*uri[len(HUB_SCHEME):].split("/", 3), "", ""])[:3]
    if kind == "datasets" and owner and "@" not in owner and name.split("@", 1)[0]:  # the revision follows NAME
        return None
    return f"a Hugging Face Hub source is {HUB_SCHEME}datasets/OWNER/NAME[@REVISION][/PATH]"


def join_uri(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def glob_split(path: str) -> tuple[str, str | None]:
    """(the folder to list, the pattern) of a path whose parts hold glob characters, from the first such part;
    (path, None) for a plain path."""
    parts = PurePosixPath(path).parts
    first = next((i for i, part in enumerate(parts) if any(c in part for c in GLOB_CHARACTERS)), None)
    if first is None:
        return path, None
    return str(PurePosixPath(*parts[:first])) if first else "", path


def glob_match(path: str, pattern: str) -> bool:
    """Whether `path` matches `pattern` part for part: a `*` never crosses a `/`, a part `**` is any number of
    folders (none too)."""
    return _parts_match(PurePosixPath(path).parts, PurePosixPath(pattern).parts)


def _parts_match(parts: tuple[str, ...], wanted: tuple[str, ...]) -> bool:
    if not wanted:
        return not parts
    if wanted[0] == "**":
        return any(_parts_match(parts[i:], wanted[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], wanted[0]) and _parts_match(parts[1:], wanted[1:])


def _hub_filesystem(endpoint: str | None, anonymous: bool) -> pafs.FileSystem:
    from huggingface_hub import HfFileSystem

    # token None: each process that reads takes its own (HF_TOKEN, the login's token file); False sends none.
    hub = HfFileSystem(endpoint=endpoint or None, token=False if anonymous else None)
    return pafs.PyFileSystem(_HubHandler(hub))


@contextlib.contextmanager
def _network_errors_as_oserror() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] not in _NETWORK_LIBRARIES:
            raise
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc


_NETWORK_LIBRARIES = ("httpx", "httpx2", "requests", "urllib3")


class _HubHandler(pafs.FSSpecHandler):
    """huggingface_hub's network errors (httpx's, or requests' in older releases) as ConnectionError, an OSError:
    what every other filesystem raises when it cannot reach its server. The methods that list and open files."""

    get_file_info = _network_errors_as_oserror()(pafs.FSSpecHandler.get_file_info)
    get_file_info_selector = _network_errors_as_oserror()(pafs.FSSpecHandler.get_file_info_selector)
    open_input_file = _network_errors_as_oserror()(pafs.FSSpecHandler.open_input_file)
    open_input_stream = _network_errors_as_oserror()(pafs.FSSpecHandler.open_input_stream)
