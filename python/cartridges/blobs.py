"""Blobs kept outside the data directory (`CARTRIDGES_BLOB_URL`): in an S3-compatible object
store (`s3://bucket/prefix`, through boto3) or in a directory every replica mounts
(`file:///path`, e.g. NFS). The C++ store calls this mirror: every blob is uploaded before it is
recorded, fetched into the data directory's blobs/ on first use (training, chat), and removed
after its record (`cartridges_core.BlobMirror`; docs/deployment.md). Downloads over HTTP stream
out of the mirror (`read_range`) without landing on the serving machine's disk.

boto3 reads the standard settings: AWS_ENDPOINT_URL (MinIO, moto, any S3-compatible server),
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, profiles and instance roles.
Uploads and downloads are multipart and go between the object store and files on disk, never
through memory whole.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from .store import core

# Parts of 16 MiB, four at a time: a 512 MiB upload is 32 parts.
PART_BYTES = 16 << 20
# What one read of a ranged download hands the HTTP response at a time.
READ_CHUNK = 1 << 20
# How long a successful check of the bucket stands (a failed one is not remembered).
CHECK_TTL_S = 5.0


def parse_blob_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of s3://bucket/prefix; ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"blob URL must look like s3://bucket/prefix, got {url!r}")
    prefix = parsed.path.strip("/")
    return parsed.netloc, prefix + "/" if prefix else ""


def parse_directory_url(url: str) -> Path:
    """The absolute directory of file:///path; ValueError for anything else (file://host/...)."""
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ValueError(f"blob URL must look like file:///absolute/path, got {url!r}")
    return Path(unquote(parsed.path))


def open_blob_mirror(url: str | None) -> Any | None:
    """The mirror for a blob URL; None (blobs in the data directory only) when unset."""
    if not url:
        return None
    if url.startswith("file:"):
        return DirectoryBlobs(url)
    return S3Blobs(url)


def unavailable(error: Exception) -> Exception:
    """An error of the blob store as the store's UnavailableError (HTTP 503)."""
    return core().UnavailableError(f"the object store failed: {error}")


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
        self._checked_at = -CHECK_TTL_S

    def _key(self, blob_id: str) -> str:
        return self.prefix + blob_id

    @contextlib.contextmanager
    def _recheck_on_failure(self) -> Iterator[None]:
        """Any failure makes the next check() ask the bucket again."""
        try:
            yield
        except Exception:
            self._checked_at = -CHECK_TTL_S
            raise

    def upload(self, blob_id: str, local_path: str) -> None:
        with self._recheck_on_failure():
            self._client.upload_file(local_path, self.bucket, self._key(blob_id), Config=self._transfer)

    def download(self, blob_id: str, local_path: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            with self._recheck_on_failure():
                self._client.download_file(self.bucket, self._key(blob_id), local_path, Config=self._transfer)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def remove(self, blob_id: str) -> None:
        with self._recheck_on_failure():
            self._client.delete_object(Bucket=self.bucket, Key=self._key(blob_id))

    def check(self) -> None:
        # /health asks on every call: a bucket that answered within CHECK_TTL_S is not asked again.
        if time.monotonic() - self._checked_at < CHECK_TTL_S:
            return
        with self._recheck_on_failure():
            self._client.head_bucket(Bucket=self.bucket)
        self._checked_at = time.monotonic()

    def listing(self, prefix: str) -> list[tuple[str, float]]:
        """(name as given to upload, last modified in epoch seconds) of the objects under `prefix`."""
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        return [(item["Key"][len(self.prefix):], item["LastModified"].timestamp())
                for page in pages for item in page.get("Contents", [])]

    def names(self, prefix: str) -> list[str]:
        """The names (as given to upload) of the objects under `prefix`."""
        return [name for name, _ in self.listing(prefix)]

    def read_range(self, blob_id: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of a blob, in chunks as they arrive. The request is made before the
        first chunk is asked for, so that an unreachable store fails the call (UnavailableError)
        rather than a response already under way."""
        from botocore.exceptions import ClientError

        try:
            with self._recheck_on_failure():
                body = self._client.get_object(Bucket=self.bucket, Key=self._key(blob_id),
                                               Range=f"bytes={start}-{end - 1}")["Body"]
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                # Recorded but gone: lost storage, as download() reports it (a 500), not a 503 to retry.
                raise core().CorruptError(f"blob {blob_id} is missing from the object store") from None
            raise unavailable(error) from None
        except Exception as error:
            raise unavailable(error) from None
        return _closing(body.iter_chunks(READ_CHUNK), body)


class DirectoryBlobs(core().BlobMirror):  # type: ignore[misc]
    """The store's blobs as files of one directory that every replica mounts (file:///path)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.directory = parse_directory_url(url)
        try:  # made when missing, as the data directory is; check() reports one that cannot be
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass

    def upload(self, blob_id: str, local_path: str) -> None:
        # Written under a temporary name, flushed and renamed: the directory never shows half a blob.
        target = self.directory / blob_id
        target.parent.mkdir(parents=True, exist_ok=True)  # a name with a folder: a job's checkpoints
        handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
        try:
            with open(local_path, "rb") as source, os.fdopen(handle, "wb") as copy:
                shutil.copyfileobj(source, copy, PART_BYTES)
                copy.flush()
                os.fsync(copy.fileno())
            os.replace(tmp, target)
            _fsync_directory(target.parent)  # the rename too is durable before the blob is recorded
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def download(self, blob_id: str, local_path: str) -> bool:
        try:
            shutil.copyfile(self.directory / blob_id, local_path)
        except FileNotFoundError:
            return False
        return True

    def remove(self, blob_id: str) -> None:
        (self.directory / blob_id).unlink(missing_ok=True)

    def check(self) -> None:
        if not (self.directory.is_dir() and os.access(self.directory, os.W_OK | os.X_OK)):
            raise OSError(f"{self.directory} is not a writable directory")

    def listing(self, prefix: str) -> list[tuple[str, float]]:
        """(name as given to upload, modification time) of the files under `prefix`."""
        folder = self.directory / prefix.rsplit("/", 1)[0] if "/" in prefix else self.directory
        if not folder.is_dir():
            return []
        found = ((p.relative_to(self.directory).as_posix(), p) for p in folder.rglob("*") if p.is_file())
        return sorted((name, path.stat().st_mtime) for name, path in found
                      if name.startswith(prefix) and not name.rsplit("/", 1)[-1].startswith(".upload-"))

    def names(self, prefix: str) -> list[str]:
        """The names (as given to upload) of the files under `prefix`."""
        return [name for name, _ in self.listing(prefix)]

    def remove_stale_uploads(self, min_age_s: float) -> int:
        """Removes the temporary files of uploads that never finished (a server killed while
        copying a blob) once older than `min_age_s`; returns how many."""
        now, removed = time.time(), 0
        for path in self.directory.rglob(".upload-*"):
            try:
                if path.is_file() and now - path.stat().st_mtime >= min_age_s:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # finished or removed meanwhile
                pass
        return removed

    def read_range(self, blob_id: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of a blob, in chunks (UnavailableError when it cannot be opened)."""
        try:
            file = open(self.directory / blob_id, "rb")
            file.seek(start)
        except OSError as error:
            raise unavailable(error) from None
        return _closing(_read(file, end - start), file)


# An object younger than this may be an upload whose record is being written: never an orphan.
ORPHAN_AGE_S = 3600.0


def sweep_orphans(mirror: Any, store: Any, min_age_s: float = ORPHAN_AGE_S) -> int:
    """Removes the blob store's objects that no record names and that are older than
    `min_age_s`: uploads whose server died before recording them (a blob is uploaded before it
    is recorded), and in a shared directory the temporary files of uploads cut short. Jobs'
    checkpoints (names with a folder) are not blobs and are left alone. Returns how many were
    removed."""
    now, removed = time.time(), 0
    stale_uploads = getattr(mirror, "remove_stale_uploads", None)
    if stale_uploads is not None:
        removed += stale_uploads(min_age_s)
    # Read before the listing: a blob is recorded within moments of its upload, so an object old
    # enough to be swept was recorded before this read if it is recorded at all.
    recorded = set(store.recorded_blobs())
    for name, modified in mirror.listing(""):
        if "/" in name or now - modified < min_age_s or name in recorded:
            continue
        mirror.remove(name)
        removed += 1
    return removed


def evict_cache(blobs_dir: str | os.PathLike[str], budget_bytes: int) -> int:
    """Removes local copies of blobs from `blobs_dir` (the data directory's blobs/, a cache when
    a blob store holds every blob), those written or fetched longest ago first, until the rest
    take at most `budget_bytes`; returns the bytes freed. A copy removed while it is read stays
    readable to its reader (POSIX), and the next use fetches it again. Never for a data directory
    without a blob store: its blobs/ holds the only copies."""
    entries = []
    for entry in os.scandir(blobs_dir):
        if entry.is_file(follow_symlinks=False):
            stat = entry.stat(follow_symlinks=False)
            entries.append((stat.st_mtime, stat.st_size, entry.path))
    total, freed = sum(size for _, size, _ in entries), 0
    for _, size, path in sorted(entries):
        if total - freed <= budget_bytes:
            break
        try:
            os.unlink(path)
            freed += size
        except FileNotFoundError:
            pass
    return freed


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(file: Any, remaining: int) -> Iterator[bytes]:
    while remaining > 0:
        chunk = file.read(min(READ_CHUNK, remaining))
        if not chunk:
            return
        remaining -= len(chunk)
        yield chunk


def _closing(chunks: Iterator[bytes], resource: Any) -> Iterator[bytes]:
    """`chunks`, closing `resource` when they are done or abandoned (a client that hung up)."""
    try:
        yield from chunks
    finally:
        resource.close()
