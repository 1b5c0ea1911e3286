"""JSON request bodies must hold text. A lone surrogate ("\\ud800") is valid JSON but not text:
no UTF-8 encodes it, so it would fail deep inside the tokenizer or the C++ store. Every route
of the API refuses it up front with a 400 that names where it is."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from cartridges.server.errors import APIError


class TextRoute(APIRoute):
    """An APIRoute whose JSON body is checked for lone surrogates before the endpoint runs."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def checked(request: Request) -> Response:
            content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if content_type == "application/json" or content_type.endswith("+json"):
                body = await request.body()
                try:
                    value = json.loads(body) if body else None
                except json.JSONDecodeError:
                    return await handle(request)  # FastAPI answers a syntax error, with its position
                except (ValueError, RecursionError) as error:  # valid JSON past the parser's limits
                    limit = "nested too deeply" if isinstance(error, RecursionError) else str(error)
                    raise APIError(400, f"The body could not be read as JSON: {limit}.", code="invalid_json") from None
                where = lone_surrogate(value)
                if where is not None:
                    raise APIError(400, f"'{where}' is not valid text: it holds a lone UTF-16 surrogate "
                                   "(an unpaired \\ud800-\\udfff escape).", code="invalid_value", param=where)
                request._json = value  # Starlette's Request.json() reads it back instead of parsing again
            return await handle(request)

        return checked


def lone_surrogate(value: Any) -> str | None:
    """Where in a parsed JSON value a string (or an object's key) holds a lone surrogate, as a
    parameter path (`messages[0].content`), or None when every string is text."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else key
                if not _is_text(key):
                    return path or "body"
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
