"""The lease object of `raydiff.storage.lease` on S3 and GCS: created only if absent, replaced only over the
version its holder wrote, read with the store's clock where it has one, deleted only where it is still that
version. One class per store, each on the store's own client (boto3, google-cloud-storage), whose conditional
requests pyarrow's filesystems do not offer.

Why a module of its own: these are the two stores' protocols, request by request; `raydiff.storage.lease` is
what a holder and a claimant do with them.
"""

from __future__ import annotations

import email.utils
import json
import os
from datetime import datetime, timezone
from typing import Any

from raydiff.storage.rundir import RunDir


def request_timeout_s(stale_s: float) -> float:
    """How long one request about a lease may wait for the store (3.75 s for the default 60 s; never under 1 s): a
    renewal and its one retry end within about a quarter of stale_s, so that one that fails leaves time for
    another before the holder gives the lease up, at half of stale_s, and a release waits for no longer. Slow
    networks set a longer run.lease_stale_s."""
    return max(1.0, stale_s / 16)


class S3LeaseObject:
    """One object on S3 (or an S3-compatible store) with conditional writes, through boto3."""

    def __init__(self, place: RunDir, timeout_s: float) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, _, self.key = place.uri.removeprefix("s3://").partition("/")
        endpoint = place.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        options = {"s3": {"addressing_style": "path"}} if endpoint else {}
        self.client = boto3.client("s3", endpoint_url=endpoint, config=Config(
            retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=timeout_s, read_timeout=timeout_s,
            **options))

    @staticmethod
    def _refused(exc: Exception) -> bool:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412", "409")

    def create(self, body: bytes) -> str | None:
        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfNoneMatch="*")["ETag"]
        except self.client.exceptions.ClientError as exc:
            if self._refused(exc):
                return None
            raise

    def read(self) -> tuple[dict[str, Any], str, float] | None:
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.ClientError as exc:
            if self._refused(exc):
                return None
            raise
        body = json.loads(reply["Body"].read() or b"{}")
        date = reply["ResponseMetadata"].get("HTTPHeaders", {}).get("date")
        now = email.utils.parsedate_to_datetime(date) if date else datetime.now(timezone.utc)
        return body, reply["ETag"], (now - reply["LastModified"]).total_seconds()

    def replace(self, body: bytes, version: str) -> str | None:
        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, IfMatch=version)["ETag"]
        except self.client.exceptions.ClientError as exc:
            if self._refused(exc):
                return None
            raise

    def delete(self, version: str) -> None:
        """Delete the object where it is still `version`: conditionally (S3 `If-Match`), so that a takeover's write
        landing meanwhile is never deleted; on a store without conditional deletes, after looking (a narrow race)."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
            return
        except self.client.exceptions.ClientError as exc:
            if self._refused(exc):  # another's write is there now, or nothing is: leave it
                return
        reply = self.client.head_object(Bucket=self.bucket, Key=self.key)
        if reply["ETag"] == version:
            self.client.delete_object(Bucket=self.bucket, Key=self.key)


class GcsLeaseObject:
    """One object on GCS with generation preconditions, through google-cloud-storage."""

    def __init__(self, place: RunDir, timeout_s: float) -> None:
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY

        bucket, _, self.name = place.uri.split("://", 1)[1].partition("/")
        if place.endpoint:  # an emulator, or a private endpoint
            import google.auth
            from google.auth.credentials import AnonymousCredentials

            try:
                credentials, project = google.auth.default()
            except google.auth.exceptions.DefaultCredentialsError:
                credentials, project = AnonymousCredentials(), None
            client = storage.Client(project=project or "raydiff", credentials=credentials,
                                    client_options={"api_endpoint": place.endpoint})
        else:
            client = storage.Client()
        self.bucket = client.bucket(bucket)
        # Each request, and its retries together (a conditional write's too: its precondition makes it safe).
        self.timeout_s, self.retry = timeout_s, DEFAULT_RETRY.with_deadline(2 * timeout_s)

    def create(self, body: bytes) -> str | None:
        from google.api_core.exceptions import PreconditionFailed

        blob = self.bucket.blob(self.name)
        try:
            blob.upload_from_string(body, if_generation_match=0, timeout=self.timeout_s, retry=self.retry)
        except PreconditionFailed:
            return None
        return str(blob.generation)

    def read(self) -> tuple[dict[str, Any], str, float] | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        renewed = 0
        while True:
            blob = self.bucket.get_blob(self.name, timeout=self.timeout_s, retry=self.retry)
            if blob is None:
                return None
            generation, updated = blob.generation, blob.updated  # (a download may reset the blob's properties)
            try:
                body = json.loads(blob.download_as_bytes(if_generation_match=generation, timeout=self.timeout_s,
                                                         retry=self.retry) or b"{}")
            except NotFound:
                return None
            except PreconditionFailed:  # renewed between the two requests: read the new one
                renewed += 1
                if renewed == 3:
                    raise
                continue
            return body, str(generation), (datetime.now(timezone.utc) - updated).total_seconds()

    def replace(self, body: bytes, version: str) -> str | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = self.bucket.blob(self.name)
        try:
            blob.upload_from_string(body, if_generation_match=int(version), timeout=self.timeout_s,
                                        retry=self.retry)
        except (PreconditionFailed, NotFound):
            return None
        return str(blob.generation)

    def delete(self, version: str) -> None:
        self.bucket.blob(self.name).delete(if_generation_match=int(version), timeout=self.timeout_s, retry=self.retry)
