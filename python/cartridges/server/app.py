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
from cartridges.server.metrics import Metrics, RequestCounter
from cartridges.server.openapi_examples import add_examples
from cartridges.server.routers import chat, datablocks, files, serving
from cartridges.server.serving import Serving
from cartridges.server.settings import Settings
from cartridges.blobs import open_blob_mirror
from cartridges.store import core, open_store, store_env

API_PREFIXES = ("/api/v1", "/v1")

DESCRIPTION = """Train and serve cartridges: compact trained KV-cache prefixes that stand in for documents.

Upload files, train a datablock (a cartridge) from them, then chat with it through the
OpenAI-compatible `/v1/chat/completions`: `model` is the cartridge's id (or the base model's).

Every endpoint but `/health`, `/v1/status` and `/metrics` needs `Authorization: Bearer <API key>`. Errors are OpenAI-shaped:
`{"error": {"message", "type", "param", "code"}}`; act on `code`.
Every resource answers under both `/api/v1` and `/v1`."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        mirror = open_blob_mirror(settings.blob_url)  # downloads stream out of it
        store = open_store(settings.data_dir, sync=settings.store_sync, database_url=settings.database_url,
                           blob_mirror=mirror)
        app.state.blob_mirror = mirror
        try:
            keys.bootstrap(store, settings.api_key)
            admin = None
            if settings.admin_key:
                admin = keys.find_or_create_user(store, keys.ADMIN_USER)
            app.state.store = store
            app.state.admin_user_id = admin.id if admin else 0
            app.state.extractor = Extractor(store, core().Owner(0, True))
            await app.state.extractor.start()
            supervisor = Supervisor(store, settings.data_dir, max_jobs=settings.max_jobs,
                                    worker_threads=settings.worker_threads,
                                    int8_activations=settings.int8_activations,
                                    store_env=store_env(settings.database_url, settings.blob_url),
                                    backend=settings.job_backend, blob_mirror=mirror,
                                    worker_gpus=settings.worker_gpus)
            app.state.serving = Serving(settings, store, worker_threads=supervisor.worker_threads,
                                        max_jobs=supervisor.max_jobs)
            supervisor.on_workers_changed = app.state.serving.training_jobs_changed
            app.state.supervisor = supervisor
            app.state.serving.start()  # the model loads in the background; /health says when
            supervisor.start()
            try:
                yield
            finally:
                supervisor.stop()
                app.state.serving.close()
                await app.state.extractor.stop()
        finally:
            store.close()

    app = FastAPI(title="cartridges", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.metrics.attach(app)
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
