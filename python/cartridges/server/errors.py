"""OpenAI-shaped errors (docs/api.md §0): every error body is
`{"error": {"message", "type", "param", "code"}}`; validation failures are 400, never 422."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("cartridges.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    416: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
DEFAULT_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "file_too_large",
    416: "range_not_satisfiable",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error answered to the client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code if code is not None else DEFAULT_CODES.get(status)
        self.param = param
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, code=self.code, param=self.param, headers=self.headers)


def error_response(
    status: int, message: str, *, code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code if code is not None else DEFAULT_CODES.get(status),
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


_DESCRIPTIONS = {
    400: "The request is invalid (`code` says how: e.g. `invalid_purpose`, `unsupported_file_type`, `empty_file`).",
    401: "Missing, malformed or unknown API key (`invalid_api_key`).",
    404: "No such object, or it belongs to someone else (`not_found`, `model_not_found`).",
    409: "The object's state forbids the action (`conflict`, `cartridge_not_ready`).",
    413: "The upload is over the size limit (`file_too_large`).",
    416: "The requested byte range is outside the file (`range_not_satisfiable`, with `Content-Range: bytes "
    "*/<size>`).",
    429: "Over a limit for now (`rate_limited`, `cartridge_memory_full`); retry after `Retry-After` seconds.",
    500: "A bug or damaged storage (`internal_error`); never a stack trace.",
    503: "The model is still loading, or the engine is down (`unavailable`).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for these statuses, all with the error schema."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


_NOT_FIELDS = {"body", "query", "path", "header", "str", "int", "float", "bool", "list", "dict", "none"}


def _is_field_name(part: object) -> bool:
    """Parts of a validation error's location that name a parameter (not a list index, nor
    the member of a union that was tried, like `str` or `list[str]`)."""
    return isinstance(part, str) and part not in _NOT_FIELDS and part.isidentifier() and part.islower()


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    # The parameter's path: "config.epochs", "messages[0].role" (list indexes in brackets).
    param = ""
    for part in first.get("loc", ()):
        if isinstance(part, int) and param:
            param += f"[{part}]"
        elif isinstance(part, str) and _is_field_name(part):
            param += f".{part}" if param else part
    param = param or None
    if first.get("type") == "missing":
        code = "missing_required_parameter"
        message = f"Missing required parameter: '{param}'."
    elif first.get("type") == "json_invalid":
        code, param = "invalid_json", None
        message = f"The body is not valid JSON: {first.get('ctx', {}).get('error', 'invalid')}."
    elif first.get("type") == "extra_forbidden":
        code = "unknown_parameter"
        message = f"Unknown parameter: '{param}'."
    elif first.get("type") == "unsupported_parameter":
        code = "unsupported_parameter"
        message = f"Unsupported parameter '{param}': {first.get('msg')}."
    elif param is None:
        code = "invalid_value"
        message = f"Invalid body: {str(first.get('msg', 'invalid')).removeprefix('Value error, ')}."
    else:
        code = "invalid_purpose" if param == "purpose" else "invalid_value"
        message = f"Invalid value for '{param}': {str(first.get('msg', 'invalid')).removeprefix('Value error, ')}."
    return error_response(400, message, code=code, param=param)


def install_error_handlers(app: FastAPI) -> None:
    from cartridges.store import core as load_core

    core = load_core()

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = {404: "Not found.", 405: "Method not allowed."}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, code=getattr(exc, "code", None),
                              headers=getattr(exc, "headers", None))

    async def on_not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(404, str(exc), param=None)

    async def on_conflict(request: Request, exc: Exception) -> JSONResponse:
        return error_response(409, str(exc))

    async def on_unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.error("store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, "The server cannot reach its database or object store right now; retry in a "
                              "few seconds.", headers={"Retry-After": "5"})

    async def on_store_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("store error on %s %s: %s", request.method, request.url.path, exc)
        return error_response(500, "The server could not read or write its storage.")

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal server error.")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(core.NotFoundError, on_not_found)
    app.add_exception_handler(core.ConflictError, on_conflict)
    app.add_exception_handler(core.UnavailableError, on_unavailable)
    app.add_exception_handler(core.StoreError, on_store_error)  # CorruptError and the rest
    app.add_exception_handler(Exception, on_unexpected)


def strip_default_422(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents validation failures as 422; this API answers them with 400."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
