"""The application factory: `create_app(settings)`; state is built in the lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from cartridges import __version__
from cartridges.jobs import Supervisor
from cartridges.server import keys
from cartridges.server.errors import install_error_handlers, strip_default_422
from cartridges.server.extraction import Extractor
from cartridges.server.routers import datablocks, files
from cartridges.server.settings import Settings
from cartridges.server.storage import core, open_store

API_PREFIXES = ("/api/v1", "/v1")

DESCRIPTION = """Train and serve cartridges: compact trained KV-cache prefixes that stand in for documents.

Every endpoint needs `Authorization: Bearer <API key>`. Errors are OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`; act on `code`.
Every resource answers under both `/api/v1` and `/v1`."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = open_store(settings.data_dir, sync=settings.store_sync)
        try:
            keys.bootstrap(store, settings.api_key)
            admin = None
            if settings.admin_key:
                admin = store.find_user(keys.ADMIN_USER) or store.create_user(keys.ADMIN_USER)
            app.state.store = store
            app.state.admin_user_id = admin.id if admin else 0
            app.state.extractor = Extractor(store, core().Owner(0, True))
            await app.state.extractor.start()
            app.state.supervisor = Supervisor(store, settings.data_dir, max_jobs=settings.max_jobs,
                                              worker_threads=settings.worker_threads)
            app.state.supervisor.start()
            try:
                yield
            finally:
                app.state.supervisor.stop()
                await app.state.extractor.stop()
        finally:
            store.close()

    app = FastAPI(title="cartridges", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    for prefix in API_PREFIXES:
        app.include_router(files.router, prefix=prefix)
        app.include_router(datablocks.router, prefix=prefix)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = strip_default_422(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
