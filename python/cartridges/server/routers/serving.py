"""Models, preload, health, status and metrics (docs/api.md §3)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cartridges import __version__
from cartridges.server.text_route import TextRoute
from cartridges.server.serving_schemas import MAX_PRELOAD_IDS, Health, ModelList, ModelObject
from cartridges.server.deps import (CurrentUser, MetricsDep, Principal, ServingDep, SettingsDep, StoreDep,
                                   SupervisorDep, bearer_key, get_serving, get_store, principal_for_key)
from cartridges.server.errors import APIError, error_responses
from cartridges.server.metrics import CONTENT_TYPE, job_counts
from cartridges.cores import cpu_cores
from cartridges.store import core
from cartridges.server.serving import CartridgeUnavailable, LoadedCartridge, Serving, loaded_cartridges

router = APIRouter(tags=["models"], route_class=TextRoute)  # under /v1 and /api/v1
root = APIRouter(route_class=TextRoute)  # at the root: /health, /preload, /metrics


def _model_object(serving: Serving, loaded: LoadedCartridge) -> ModelObject:
    return ModelObject(id=loaded.id, created=loaded.loaded_at, parent=serving.model_id, num_tokens=loaded.num_tokens)


@router.get("/models", summary="List loaded cartridges", response_model=ModelList,
            responses=error_responses(401, 500))
def list_models(user: CurrentUser, serving: ServingDep) -> ModelList:
    """The caller's cartridges loaded in memory now, most recently used first; `created` is
    when each was loaded. The base model is not listed; its id works as `model` in chat."""
    return ModelList(data=[_model_object(serving, c) for c in serving.loaded(user)])


@router.get("/models/{model_id:path}", summary="Retrieve a model", response_model=ModelObject,
            responses=error_responses(401, 404, 500))
def retrieve_model(user: CurrentUser, serving: ServingDep,
                   model_id: Annotated[str, Path(description="The base model's id, or a loaded cartridge's.")]
                   ) -> ModelObject:
    """The base model, or one of the caller's loaded cartridges (full or bare run id)."""
    if model_id == serving.model_id:
        return ModelObject(id=serving.model_id, created=int(serving.started_at))
    for loaded in serving.loaded(user):
        if model_id in (loaded.id, loaded.id.rsplit("/", 1)[-1]):
            return _model_object(serving, loaded)
    raise APIError(404, f"No model '{model_id}' is loaded.", code="model_not_found", param="model")


@root.post(
    "/preload",
    tags=["models"],
    summary="Load cartridges into memory",
    response_model=dict[str, str],
    responses=error_responses(400, 401, 500, 503),
)
async def preload(
    user: CurrentUser,
    serving: ServingDep,
    ids: Annotated[list[str], Body(max_length=MAX_PRELOAD_IDS, description="Cartridge ids (full or bare run ids).",
                                   examples=[["alice/handbook/k3v9x2m1q8"]])],
) -> dict[str, str]:
    """Loads each cartridge so that the first chat on it is fast (a cartridge in parts with the
    index that search finds its parts by). The answer maps each id, as given, to `"loaded"` or
    `"error: <why>"`; one cartridge's failure never fails the others."""
    model, _ = serving.require_ready()
    results: dict[str, str] = {}
    for identifier in dict.fromkeys(ids):
        try:
            record, parts = await run_in_threadpool(serving.cartridge, user, identifier, param="ids")
            if len(parts) > 1:
                await run_in_threadpool(serving.passages.part_search, user, record, model.tokenizer, len(parts))
            results[identifier] = "loaded"
        except CartridgeUnavailable as unavailable:
            results[identifier] = f"error: {unavailable.error.message}"
    return results


@root.get("/health", tags=["service"], summary="Health", response_model=Health,
          responses={503: {"model": Health, "description": "Still starting, or the model could not be loaded."}})
def health(request: Request, settings: SettingsDep) -> JSONResponse:
    """`healthy` (200) once the model is loaded and the engine runs, else `unhealthy` (503).
    No key needed; `loaded_cartridges` lists what the presented key may see (none without one)."""
    try:
        serving, store = get_serving(request), get_store(request)
    except core().UnavailableError as error:  # the store could not be opened since start
        body = Health(status="unhealthy", device=settings.device, loaded_cartridges=[], reason=str(error))
        return JSONResponse(body.model_dump(), status_code=503)
    reason = None if serving.ready else serving.unready_reason
    principal = None
    try:
        store.ping()
        principal = _optional_principal(request, store)
    except core().UnavailableError as error:  # the database or the object store
        reason = str(error)
    body = Health(status="unhealthy" if reason else "healthy", device=serving.device,
                  loaded_cartridges=[c.id for c in serving.loaded(principal)], reason=reason)
    return JSONResponse(body.model_dump(), status_code=503 if reason else 200)


def _optional_principal(request: Request, store: Any) -> Principal | None:
    """The caller if it presents a valid key; nobody otherwise (health needs no key)."""
    key = bearer_key(request)
    return principal_for_key(request, store, key) if key is not None else None


@root.get("/metrics", tags=["service"], summary="Prometheus metrics",
          responses={200: {"content": {"text/plain": {}}, "description": "The Prometheus text format."}})
def metrics(metrics: MetricsDep) -> Response:
    """Requests by endpoint and status, tokens, latency histograms, the engine's queue and KV
    pool, the cartridge cache and training jobs. No key needed; no user or object ids."""
    return Response(metrics.exposition(), media_type=CONTENT_TYPE)


@router.get("/status", tags=["service"], summary="Service status")
def status(serving: ServingDep, supervisor: SupervisorDep, store: StoreDep) -> dict[str, Any]:
    """For operators, no key needed: readiness, version, device, base model, uptime, loaded
    cartridges against the memory budget, training jobs, and the engine's settings."""
    settings = serving.settings
    engine = serving.engine
    stats = engine.stats() if engine is not None else None
    counts = job_counts(store)
    return {
        "status": "ok" if serving.ready else ("error" if serving.load_error else "starting"),
        "version": __version__,
        "device": serving.device,
        "model": serving.model_id,
        "uptime_s": int(time.time() - serving.started_at),
        "cartridges": {
            "loaded": loaded_cartridges(engine) if engine is not None else 0,
            "bytes": stats.cartridges.bytes if stats else 0,
            "budget_bytes": serving.budget_bytes,
        },
        "training_jobs": {"queued": counts.get("queued", 0), "running": counts.get("running", 0),
                          "max_jobs": supervisor.max_jobs, "worker_threads": supervisor.worker_threads},
        "engine": {
            "kv_tokens": settings.kv_tokens,
            "kv_tokens_used": stats.kv_tokens_used if stats else 0,
            "running_requests": stats.running if stats else 0,
            "waiting_requests": stats.waiting if stats else 0,
            "threads": engine.native.num_threads if engine is not None else serving.serve_threads(),
            "serve_threads_setting": settings.serve_threads,
            "cpu_cores": cpu_cores(),
            "default_max_tokens": settings.default_max_tokens,
        },
    }
