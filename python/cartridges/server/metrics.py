"""`GET /metrics` in the Prometheus text format (docs/api.md §3). Labels never carry user or
object identifiers: requests are counted by route template (`/v1/datablocks/{datablock_id:path}`),
never by the path a client sent.

Counters and histograms are updated as requests go; the engine's, the cartridge cache's and
the training jobs' figures are read when scraped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cartridges.server.serving import loaded_cartridges

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("cartridges_http_requests", "HTTP requests answered, by route template and status.",
                                ["method", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("cartridges_prompt_tokens", "Prompt tokens of chat requests, cartridge tokens "
                                     "included.", registry=r)
        self.cached_tokens = Counter("cartridges_cached_tokens", "Prompt tokens served from cartridges.", registry=r)
        self.completion_tokens = Counter("cartridges_completion_tokens", "Tokens generated for chat requests.",
                                         registry=r)
        self.time_to_first_token = Histogram(
            "cartridges_time_to_first_token_seconds", "From a chat request's arrival to its first generated token.",
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.time_per_output_token = Histogram(
            "cartridges_time_per_output_token_seconds", "Mean time between generated tokens, per chat request.",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56), registry=r)

    def attach(self, app: Any) -> None:
        """Reads the engine, the cartridge cache and the jobs of `app.state` when scraped."""
        self.registry.register(_StateCollector(app))

    def observe_chat(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                     started: float, first_token_at: float | None, choices: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.completion_tokens.inc(completion_tokens)
        if first_token_at is None:
            return
        self.time_to_first_token.observe(first_token_at - started)
        per_choice = completion_tokens / max(1, choices)
        if per_choice > 1:
            self.time_per_output_token.observe((time.monotonic() - first_token_at) / (per_choice - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, app: Any) -> None:
        self._app = app

    def collect(self) -> Iterator[Any]:
        state = self._app.state
        serving = getattr(state, "serving", None)
        engine = serving.engine if serving is not None else None
        yield GaugeMetricFamily("cartridges_model_ready", "1 once the model is loaded and the engine runs.",
                                value=1 if serving is not None and serving.ready else 0)
        if engine is not None:
            s = engine.stats()
            c = s.cartridges
            yield GaugeMetricFamily("cartridges_running_requests", "Requests being generated.", value=s.running)
            yield GaugeMetricFamily("cartridges_waiting_requests", "Requests queued for room.", value=s.waiting)
            yield GaugeMetricFamily("cartridges_kv_pool_tokens_used", "KV pool slots held by requests.",
                                    value=s.kv_tokens_used)
            yield GaugeMetricFamily("cartridges_kv_pool_tokens", "KV pool size in tokens.", value=s.kv_tokens_total)
            yield GaugeMetricFamily("cartridges_engine_threads", "Intra-op threads of the engine now.",
                                    value=engine.native.num_threads)
            yield CounterMetricFamily("cartridges_engine_steps", "Engine steps run.", value=s.steps)
            yield CounterMetricFamily("cartridges_kv_pool_compactions",
                                      "Times the running requests' KV ranges were packed to admit a request.",
                                      value=s.kv_compactions)
            yield GaugeMetricFamily("cartridges_cartridge_cache_bytes", "Bytes of loaded cartridges.", value=c.bytes)
            yield GaugeMetricFamily("cartridges_cartridge_cache_budget_bytes", "Cartridge memory budget.",
                                    value=c.budget_bytes)
            yield GaugeMetricFamily("cartridges_cartridges_loaded", "Cartridges in memory (one in parts once).",
                                    value=loaded_cartridges(engine))
            yield CounterMetricFamily("cartridges_cartridge_cache_hits", "Uses of a cartridge already loaded.",
                                      value=c.hits)
            yield CounterMetricFamily("cartridges_cartridge_cache_misses", "Uses that had to load it.", value=c.misses)
            yield CounterMetricFamily("cartridges_cartridge_loads", "Cartridges loaded (each part of one in parts).",
                                      value=c.loads)
            yield CounterMetricFamily("cartridges_cartridge_evictions",
                                      "Cartridges evicted for room (each part of one in parts).", value=c.evictions)
        counts = job_counts(getattr(state, "store", None))
        jobs = GaugeMetricFamily("cartridges_training_jobs", "Training jobs (datablocks) by status.", labels=["status"])
        for status in JOB_STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs


def job_counts(store: Any) -> dict[str, int]:
    if store is None:
        return {}
    from cartridges.store import core

    admin = core().Owner(0, True)
    return {status: len(store.list_datablocks(admin, status=status, limit=10000).data) for status in JOB_STATUSES}


class RequestCounter:
    """ASGI middleware counting answered requests by method, route template and status (pure
    ASGI, so that streaming responses and client disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = _route_template(scope)
            self.metrics.requests.labels(scope["method"], endpoint, str(status)).inc()


def _route_template(scope: Scope) -> str:
    """The template of the route that answered (set by the router), under its prefix; "other"
    for paths that matched none (so that clients cannot mint label values)."""
    route = scope.get("route")
    template = getattr(route, "path", None)
    if template is None:
        return "other"
    path = scope.get("path", "")
    prefix = next((p for p in ("/api/v1", "/v1") if path.startswith(p + "/") and not template.startswith(p)), "")
    return prefix + template
