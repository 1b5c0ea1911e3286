"""Responses that send a stored blob: from the local file (`RangedFileResponse`) or streamed
out of the blob mirror (`MirroredBlobResponse`) when this machine has no copy, so that a
download through any replica neither waits for a whole fetch nor fills the replica's disk.
Both honour a `Range` header and refuse a bad one in OpenAI's error shape."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from fastapi.responses import FileResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cartridges.server.errors import error_response


def blob_response(content: Any, mirror: Any, media_type: str, headers: Mapping[str, str]) -> Response:
    """The response for a stored blob (`cartridges_core.BlobContent`): its local file when this
    machine holds it whole, else streamed out of `mirror`."""
    if content.local_path:
        return RangedFileResponse(content.local_path, media_type=media_type, headers=dict(headers))
    return MirroredBlobResponse(mirror, content.blob_id, content.bytes, media_type, headers)


def _range_refused(http_range: str, size: int) -> tuple[list[tuple[int, int]], Response | None]:
    """The byte ranges [start, end) of a Range header (Starlette's own parser, so that what is
    refused here is exactly what Starlette refuses), or the error response that refuses it."""
    try:
        return FileResponse._parse_range_header(http_range, size), None
    except MalformedRangeHeader as error:
        return [], error_response(400, f"Malformed Range header: {error.content}", code="invalid_range",
                                  param="Range")
    except RangeNotSatisfiable:
        return [], error_response(416, f"The requested range is outside the file ({size} bytes).",
                                  code="range_not_satisfiable", headers={"Content-Range": f"bytes */{size}"})


class RangedFileResponse(FileResponse):
    """A FileResponse whose refused `Range` headers are answered in OpenAI's error shape, where
    Starlette's answers a plain-text 400 or an empty 416."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.stat_result is None:  # as Starlette does first: If-Range compares with these headers
            self.stat_result = await run_in_threadpool(os.stat, self.path)
            self.set_stat_headers(self.stat_result)
        headers = Headers(scope=scope)
        http_range, if_range = headers.get("range"), headers.get("if-range")
        if http_range is not None and (if_range is None or self._should_use_range(if_range)):
            _, refused = _range_refused(http_range, self.stat_result.st_size)
            if refused is not None:
                return await refused(scope, receive, send)
        await super().__call__(scope, receive, send)


class MirroredBlobResponse(Response):
    """A blob streamed out of the blob mirror: the whole of it (200), or one byte range (206).
    A request for several ranges gets the whole blob, as HTTP allows a server to answer."""

    def __init__(self, mirror: Any, blob_id: str, size: int, media_type: str, headers: Mapping[str, str]) -> None:
        super().__init__(media_type=media_type, headers=dict(headers))
        self.mirror, self.blob_id, self.size = mirror, blob_id, size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start, end, status = 0, self.size, 200
        http_range = Headers(scope=scope).get("range")
        if http_range is not None and self.size > 0:
            ranges, refused = _range_refused(http_range, self.size)
            if refused is not None:
                return await refused(scope, receive, send)
            if len(ranges) == 1:
                (start, end), status = ranges[0], 206
        headers = {k: v for k, v in self.headers.items() if k not in ("content-length", "content-type")}
        headers["Accept-Ranges"] = "bytes"
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{self.size}"
        if scope["method"] == "HEAD" or start == end:
            response: Response = Response(b"", status_code=status, media_type=self.media_type, headers=headers)
            response.headers["content-length"] = str(end - start)
            return await response(scope, receive, send)
        # The object is asked for before the response starts: an unreachable store is a 503.
        chunks = await run_in_threadpool(self.mirror.read_range, self.blob_id, start, end)
        response = StreamingResponse(iterate_in_threadpool(chunks), status_code=status, media_type=self.media_type,
                                     headers={**headers, "Content-Length": str(end - start)})
        await response(scope, receive, send)


def content_disposition(filename: str) -> str:
    """`filename=` with an ASCII fallback, plus `filename*=` (RFC 6266) for the exact name."""
    fallback = "".join(c if 0x20 <= ord(c) < 0x7F and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"
