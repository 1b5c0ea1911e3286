"""Streaming multipart uploads: the file part goes straight from the socket into a blob.

Nothing holds the whole file: chunks are parsed as they arrive (python-multipart), batched
up to WRITE_BATCH bytes and written by a worker thread. The size limit is checked on the
running count; once it is passed, the temporary blob is removed at once and the rest of the
body is read and dropped (so that the client can read the 413), up to DRAIN_LIMIT.
"""

from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from cartridges.server.errors import APIError
from cartridges.server.file_schemas import MEDIA_TYPES, PURPOSES

WRITE_BATCH = 1 << 20
DRAIN_LIMIT = 1 << 30  # past this, a refused body is no longer read: the connection closes
MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose)
MAX_FILENAME_BYTES = 255

_FILENAME_STAR = re.compile(rb"filename\*\s*=\s*([^';]*)'[^']*'([^;]*)", re.IGNORECASE)


def safe_filename(raw: str) -> str:
    """The base name only, without control or format characters, at most 255 bytes of UTF-8
    (the extension is kept when the stem is shortened)."""
    name = raw.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if unicodedata.category(ch)[0] != "C").strip()
    if name in (".", ".."):
        return ""
    stem, ext = os.path.splitext(name)
    if len(name.encode()) > MAX_FILENAME_BYTES:
        if len(ext.encode()) > 16:
            stem, ext = name, ""
        budget = MAX_FILENAME_BYTES - len(ext.encode())
        stem = stem.encode()[:budget].decode("utf-8", "ignore")
        name = stem + ext
    return name


def file_extension(filename: str) -> str:
    return os.path.splitext(filename)[1].lower()


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    headers: dict[bytes, bytes] = field(default_factory=dict)


class _UploadState:
    """Callbacks of the multipart parser; decisions are recorded, I/O is left to the caller."""

    def __init__(self, store: Any, limit: int) -> None:
        self.store = store
        self.limit = limit
        self.part = _Part()
        self._header_field = b""
        self._header_value = b""
        self.writer: Any = None
        self.filename: str | None = None
        self.file_parts = 0
        self.file_bytes = 0
        self.pending = bytearray()
        self.purpose: bytearray | None = None
        self.field: bytearray | None = None
        self.error: APIError | None = None
        self.ended = False

    def fail(self, error: APIError) -> None:
        if self.error is None:
            self.error = error
        self.pending.clear()
        if self.writer is not None:
            self.writer.abort()  # removes the temporary blob right away

    # --- parser callbacks ---
    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if len(self.part.headers) < 16:
            self.part.headers[self._header_field.strip().lower()] = self._header_value.strip()
        self._header_field = self._header_value = b""

    def on_headers_finished(self) -> None:
        disposition = self.part.headers.get(b"content-disposition", b"")
        _, options = parse_options_header(disposition)
        self.part.name = options.get(b"name", b"").decode("utf-8", "replace")
        raw_name: bytes | None = options.get(b"filename")
        star = _FILENAME_STAR.search(disposition)
        if star:
            raw_name = unquote(star.group(2).decode("latin-1"), encoding="utf-8", errors="replace").encode()
        self.part.filename = None if raw_name is None else raw_name.decode("utf-8", "replace")
        if self.error is not None:
            return
        if self.part.name == "file":
            self._begin_file()
        elif self.part.name == "purpose":
            self.purpose = bytearray()
            self.field = self.purpose
        else:
            self.field = None  # unknown fields are ignored

    def _begin_file(self) -> None:
        self.file_parts += 1
        if self.file_parts > 1:
            self.fail(APIError(400, "Send exactly one 'file' part.", code="invalid_request", param="file"))
            return
        if self.part.filename is None:
            self.fail(APIError(400, "The 'file' part has no filename.", code="invalid_request", param="file"))
            return
        self.filename = safe_filename(self.part.filename)
        if file_extension(self.filename) not in MEDIA_TYPES:
            self.fail(
                APIError(
                    400,
                    f"Unsupported file type: '{self.filename}'. Accepted: {', '.join(MEDIA_TYPES)}.",
                    code="unsupported_file_type",
                    param="file",
                )
            )
            return
        self.writer = self.store.begin_blob()
        self.field = None

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        if self.part.name == "file":
            self.file_bytes += end - start
            if self.file_bytes > self.limit:
                self.fail(
                    APIError(
                        413,
                        f"File too large: the limit is {self.limit} bytes.",
                        code="file_too_large",
                        param="file",
                    )
                )
                return
            self.pending += data[start:end]
        elif self.field is not None:
            self.field += data[start:end]
            if len(self.field) > MAX_FIELD_BYTES:
                self.fail(APIError(400, f"Field '{self.part.name}' is too long.", code="invalid_request", param=self.part.name))

    def on_part_end(self) -> None:
        if self.error is None and self.part.name == "purpose" and self.purpose is not None:
            self._check_purpose()
        self.field = None

    def on_end(self) -> None:
        self.ended = True

    def _check_purpose(self) -> None:
        purpose = bytes(self.purpose or b"").decode("utf-8", "replace")
        if purpose not in PURPOSES:
            self.fail(
                APIError(
                    400,
                    f"Invalid purpose '{purpose[:64]}': expected one of {', '.join(PURPOSES)}.",
                    code="invalid_purpose",
                    param="purpose",
                )
            )

    def callbacks(self) -> dict[str, Any]:
        names = ("part_begin", "header_field", "header_value", "header_end", "headers_finished")
        names += ("part_data", "part_end", "end")
        return {f"on_{n}": getattr(self, f"on_{n}") for n in names}


@dataclass
class Upload:
    writer: Any  # cartridges_core.BlobWriter holding the content, not yet committed
    filename: str
    purpose: str


async def receive_upload(request: Request, store: Any, limit: int) -> Upload:
    """Streams the multipart body of request into a blob. On any error the blob is gone."""
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise APIError(400, "Expected a multipart/form-data body with a boundary.", code="invalid_multipart")
    state = _UploadState(store, limit)
    parser = MultipartParser(boundary, state.callbacks())
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if state.error is None:
                try:
                    parser.write(chunk)
                except MultipartParseError as exc:
                    state.fail(APIError(400, f"Malformed multipart body: {exc}.", code="invalid_multipart"))
                if len(state.pending) >= WRITE_BATCH:
                    await _flush(state)
            elif received > DRAIN_LIMIT:
                break
        if state.error is None:
            parser.finalize()
            await _flush(state)
        if state.error is not None:
            raise state.error
        if not state.ended:
            raise APIError(400, "Malformed multipart body: it ends before the closing boundary.", code="invalid_multipart")
        if state.writer is None:
            raise APIError(400, "Missing required parameter: 'file'.", code="missing_required_parameter", param="file")
        if state.purpose is None:
            raise APIError(400, "Missing required parameter: 'purpose'.", code="missing_required_parameter", param="purpose")
        if state.file_bytes == 0:
            raise APIError(400, "The file is empty.", code="empty_file", param="file")
        assert state.filename is not None
        return Upload(state.writer, state.filename, bytes(state.purpose).decode())
    except BaseException:
        if state.writer is not None:
            state.writer.abort()
        raise


async def _flush(state: _UploadState) -> None:
    if state.pending and state.writer is not None and state.error is None:
        data = bytes(state.pending)
        state.pending.clear()
        await run_in_threadpool(state.writer.write, data)
