"""Dependencies of the routes, as `Annotated` aliases: the store, settings, the serving side
(engine and cartridges), the training supervisor, metrics, the text extractor and the caller.
Routes take what they use through these, never from `request.app.state` directly."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cartridges.jobs.supervisor import Supervisor
from cartridges.server.errors import APIError
from cartridges.server.extraction import Extractor
from cartridges.server.keys import hash_key
from cartridges.server.metrics import Metrics
from cartridges.server.principal import Principal
from cartridges.server.serving import Serving
from cartridges.server.settings import Settings


def _started(request: Request, name: str) -> Any:
    """A part of the server that exists once its store is open; until then (the database or
    the blob store unreachable since start) an UnavailableError, a 503."""
    part = getattr(request.app.state, name)
    if part is None:
        from cartridges.store import core

        why = request.app.state.store_unavailable or "the store is opening"
        raise core().UnavailableError(why)
    return part


def get_store(request: Request) -> Any:
    return _started(request, "store")


def get_blob_mirror(request: Request) -> Any:
    """The store's blob mirror (`cartridges.blobs`), None when blobs live in the data directory."""
    return getattr(request.app.state, "blob_mirror", None)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_serving(request: Request) -> Serving:
    return _started(request, "serving")


def get_supervisor(request: Request) -> Supervisor:
    return _started(request, "supervisor")


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_extractor(request: Request) -> Extractor:
    return _started(request, "extractor")


def _on_loop(accessor: Callable[[Request], Any]) -> Callable[[Request], Awaitable[Any]]:
    """An accessor of the app's state as a dependency that runs on the event loop. FastAPI runs a
    plain `def` dependency in its threadpool, a thread hop per dependency and request; these
    only read attributes and never block."""

    async def dependency(request: Request) -> Any:
        return accessor(request)

    dependency.__name__ = accessor.__name__
    return dependency


StoreDep = Annotated[Any, Depends(_on_loop(get_store))]
BlobMirrorDep = Annotated[Any, Depends(_on_loop(get_blob_mirror))]
SettingsDep = Annotated[Settings, Depends(_on_loop(get_settings))]
ServingDep = Annotated[Serving, Depends(_on_loop(get_serving))]
SupervisorDep = Annotated[Supervisor, Depends(_on_loop(get_supervisor))]
MetricsDep = Annotated[Metrics, Depends(_on_loop(get_metrics))]
ExtractorDep = Annotated[Extractor, Depends(_on_loop(get_extractor))]


_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <API key>`")


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def bearer_key(request: Request) -> str | None:
    """The key of a well-formed `Authorization: Bearer <key>` header; None otherwise."""
    scheme, _, key = (request.headers.get("authorization") or "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key and " " not in key else None


def principal_for_key(request: Request, store: Any, key: str) -> Principal | None:
    """Who the key belongs to: the admin (CARTRIDGES_ADMIN_KEY), a user, or nobody."""
    admin_key = get_settings(request).admin_key
    if admin_key and hmac.compare_digest(key.encode(), admin_key.encode()):
        return Principal(request.app.state.admin_user_id, "admin", admin=True)
    user = store.user_for_key(hash_key(key))
    return Principal(user.id, user.name) if user is not None else None


def current_user(
    request: Request,
    store: StoreDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> Principal:
    if request.headers.get("authorization") is None:
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <API key>'.")
    key = bearer_key(request)
    if key is None:
        raise _unauthorized("Malformed Authorization header: expected 'Bearer <API key>'.")
    principal = principal_for_key(request, store, key)
    if principal is None:
        raise _unauthorized("Incorrect API key provided.")
    return principal


CurrentUser = Annotated[Principal, Depends(current_user)]
