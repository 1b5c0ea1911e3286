"""The application factory: `create_app(settings)`; state is built in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from cartridges import __version__
from cartridges.jobs import Supervisor
from cartridges.server import keys
from cartridges.server.body_limit import RequestBodyLimit
from cartridges.server.completions import SERVER_SEND
from cartridges.server.errors import install_error_handlers, strip_default_422
from cartridges.server.extraction import Extractor
from cartridges.server.metrics import Metrics, RequestCounter
from cartridges.server.openapi_examples import add_examples
from cartridges.server.routers import chat, datablocks, files, serving
from cartridges.server.serving import Serving
from cartridges.server.settings import Settings
from cartridges.blobs import open_blob_mirror
from cartridges.store import core, open_store, store_env

API_PREFIXES = ("/api/v1", "/v1")
# How often a server that could not open its store at start tries again.
STORE_RETRY_S = 5

log = logging.getLogger("cartridges.server")

DESCRIPTION = """Train and serve cartridges: compact trained KV-cache prefixes that stand in for documents.

Upload files, train a datablock (a cartridge) from them, then chat with it through the
OpenAI-compatible `/v1/chat/completions`: `model` is the cartridge's id (or the base model's).

Every endpoint but `/health`, `/v1/status` and `/metrics` needs `Authorization: Bearer <API key>`. Errors are OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`; act on `code`.
Every resource answers under both `/api/v1` and `/v1`."""


class ServerApp(FastAPI):
    """The app, which puts the server's own `send` in each HTTP request's scope: a streamed
    completion writes its events through it, past the middlewares (completions.EventStream)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    def open_app_store(mirror: Any) -> tuple[Any, int]:
        """The store opened, with the first API key and the admin user made, and the admin's id;
        UnavailableError, with nothing left open, while its database or blob store is away."""
        store = open_store(settings.data_dir, sync=settings.store_sync, database_url=settings.database_url,
                           blob_mirror=mirror)
        try:
            keys.bootstrap(store, settings.api_key)
            admin = keys.find_or_create_user(store, keys.ADMIN_USER) if settings.admin_key else None
        except BaseException:
            store.close()
            raise
        return store, admin.id if admin else 0

    async def start_services(app: FastAPI, store: Any, mirror: Any) -> None:
        """What needs the store: the text extractor, the supervisor and the engine."""
        app.state.extractor = Extractor(store, core().Owner(0, True))
        await app.state.extractor.start()
        supervisor = Supervisor(store, settings.data_dir, max_jobs=settings.max_jobs,
                                worker_threads=settings.worker_threads,
                                int8_activations=settings.int8_activations,
                                store_env=store_env(settings.database_url, settings.blob_url),
                                backend=settings.job_backend, blob_mirror=mirror,
                                worker_gpus=settings.worker_gpus, worker_device=settings.worker_device(),
                                blob_cache_bytes=int(settings.blob_cache_mib * (1 << 20)))
        app.state.serving = Serving(settings, store, worker_threads=supervisor.worker_threads,
                                    max_jobs=supervisor.max_jobs)
        supervisor.on_workers_changed = app.state.serving.training_jobs_changed
        app.state.supervisor = supervisor
        app.state.serving.start()  # the model loads in the background; /health says when
        supervisor.start()
        app.state.store = store  # from here on the routes find everything they need

    async def open_and_start(app: FastAPI, mirror: Any) -> bool:
        """Opens the store and starts what needs it; False, with the reason in
        app.state.store_unavailable, while its database or blob store cannot be reached."""
        try:
            store, app.state.admin_user_id = await run_in_threadpool(open_app_store, mirror)
        except core().UnavailableError as error:
            app.state.store_unavailable = str(error)
            return False
        app.state.store_unavailable = None
        try:
            await start_services(app, store, mirror)
        except BaseException:
            if app.state.store is None:
                store.close()
            raise
        return True

    async def open_when_reachable(app: FastAPI, mirror: Any) -> None:
        """Tries again every STORE_RETRY_S until the store opens; until then every call needing
        it is a 503 and /health says why."""
        while True:
            await asyncio.sleep(STORE_RETRY_S)
            try:
                if await open_and_start(app, mirror):
                    log.warning("the store is reachable: started")
                    return
            except Exception as error:  # not an outage (a damaged database...): /health says it
                log.exception("the store could not be started")
                app.state.store_unavailable = f"the store could not be started: {error}"
                return

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        mirror = open_blob_mirror(settings.blob_url)  # downloads stream out of it
        app.state.blob_mirror = mirror
        opener = None
        if not await open_and_start(app, mirror):
            log.error("%s; retrying every %d s, /health answers unhealthy meanwhile", app.state.store_unavailable,
                      STORE_RETRY_S)
            opener = asyncio.create_task(open_when_reachable(app, mirror))
        try:
            yield
        finally:
            if opener is not None:
                opener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await opener
            if app.state.supervisor is not None:
                app.state.supervisor.stop()
            if app.state.serving is not None:
                app.state.serving.close()
            if app.state.extractor is not None:
                await app.state.extractor.stop()
            if app.state.store is not None:
                app.state.store.close()

    app = ServerApp(title="cartridges", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    # Filled by the lifespan once the store opens (at start, or later when its services come back).
    app.state.store = app.state.serving = app.state.supervisor = app.state.extractor = None
    app.state.admin_user_id = 0
    app.state.store_unavailable = None  # why the store could not be opened yet
    app.state.metrics = Metrics()
    app.state.metrics.attach(app)
    app.add_middleware(RequestBodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(RequestCounter, metrics=app.state.metrics)
    install_error_handlers(app)
    for prefix in API_PREFIXES:
        app.include_router(chat.router, prefix=prefix)
        app.include_router(serving.router, prefix=prefix)
        app.include_router(files.router, prefix=prefix)
        app.include_router(datablocks.router, prefix=prefix)
    app.include_router(serving.root)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = add_examples(strip_default_422(schema))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
