"""Blobs in an S3-compatible object store (`CARTRIDGES_BLOB_URL=s3://bucket/prefix`), through
boto3. The C++ store calls this mirror: every blob is uploaded before it is recorded, fetched
into the data directory's blobs/ on first use, and removed after its record
(`cartridges_core.BlobMirror`; docs/deployment.md).

boto3 reads the standard settings: AWS_ENDPOINT_URL (MinIO, moto, any S3-compatible server),
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, profiles and instance roles.
Uploads and downloads are multipart and go between the object store and files on disk, never
through memory whole.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from .store import core

# Parts of 16 MiB, four at a time: a 512 MiB upload is 32 parts.
PART_BYTES = 16 << 20


def parse_blob_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of s3://bucket/prefix; ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"blob URL must look like s3://bucket/prefix, got {url!r}")
    prefix = parsed.path.strip("/")
    return parsed.netloc, prefix + "/" if prefix else ""


def open_blob_mirror(url: str | None) -> Any | None:
    """The mirror for a blob URL; None (blobs on local disk only) when unset."""
    if not url:
        return None
    return S3Blobs(url)


class S3Blobs(core().BlobMirror):  # type: ignore[misc]
    """The store's blobs as objects <prefix><blob_id> of one bucket."""

    def __init__(self, url: str) -> None:
        super().__init__()
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.url = url
        self.bucket, self.prefix = parse_blob_url(url)
        # Short timeouts and few retries: an unreachable store is a 503 within seconds, not a hang.
        self._client = boto3.client("s3", config=Config(connect_timeout=5, read_timeout=60,
                                                        retries={"max_attempts": 3, "mode": "standard"}))
        self._transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                        max_concurrency=4)

    def _key(self, blob_id: str) -> str:
        return self.prefix + blob_id

    def upload(self, blob_id: str, local_path: str) -> None:
        self._client.upload_file(local_path, self.bucket, self._key(blob_id), Config=self._transfer)

    def download(self, blob_id: str, local_path: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.download_file(self.bucket, self._key(blob_id), local_path, Config=self._transfer)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def remove(self, blob_id: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(blob_id))

    def check(self) -> None:
        self._client.head_bucket(Bucket=self.bucket)
