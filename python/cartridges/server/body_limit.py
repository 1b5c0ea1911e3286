"""A cap on the body of every request but a file upload. FastAPI reads a JSON body whole, and
parses it, before a route's dependencies check the API key: without a cap anyone could make the
server hold gigabytes. File uploads stream into a blob under their own limit (uploads.py).

A body whose Content-Length is over the cap is refused before it is read; one sent without a
length is counted as it arrives and refused once past the cap. Either way the answer is an
OpenAI-shaped 413 (`request_too_large`), and as in uploads the rest of a refused body is read
and dropped, up to DRAIN_LIMIT, so that the client reads the answer rather than a reset."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cartridges.server.errors import error_response
from cartridges.server.uploads import DRAIN_LIMIT

CODE = "request_too_large"


class BodyTooLarge(HTTPException):
    """Raised while the body is read. An HTTPException, because FastAPI passes those out of its
    body parsing as they are (any other error there becomes a 400 'error parsing the body')."""

    code = CODE

    def __init__(self, limit: int) -> None:
        super().__init__(413, _message(limit))


def _message(limit: int) -> str:
    return (f"Request body too large: the limit is {limit} bytes for a request that is not a file upload. "
            "Upload long documents as files (POST /v1/files) and refer to them by id.")


class RequestBodyLimit:
    """Pure ASGI, so that streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if headers.get("content-type", "").lower().startswith("multipart/form-data"):
            await self.app(scope, receive, send)  # an upload: its own streaming limit
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _drain(receive, int(declared))
            await error_response(413, _message(self.limit), code=CODE)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_LIMIT - received)
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)


async def _drain(receive: Receive, most: int) -> None:
    """Reads and drops the rest of a refused body, at most `most` bytes (past that the
    connection closes when the answer has gone)."""
    dropped = 0
    while dropped <= min(most, DRAIN_LIMIT):
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
