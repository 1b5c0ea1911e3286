"""`POST /v1/chat/completions` (docs/api.md §4): OpenAI's chat completions, with cartridges as context."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cartridges.stream import GenerationError
from cartridges.server.text_route import TextRoute
from cartridges.server import completions
from cartridges.server.chat_schemas import ChatCompletionRequest
from cartridges.server.deps import CurrentUser, MetricsDep, ServingDep
from cartridges.server.errors import APIError, error_responses

router = APIRouter(tags=["chat"], route_class=TextRoute)
log = logging.getLogger("cartridges.server")

_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string", "description": "`data: {chat.completion.chunk}` "
                                                "events, then `data: [DONE]`."}}}


@router.post(
    "/chat/completions",
    summary="Create a chat completion",
    responses={200: {"description": "A `chat.completion`, or with `stream: true` server-sent "
                     "`chat.completion.chunk` events.", "content": _STREAM_DOC},
               **error_responses(400, 401, 404, 409, 429, 500, 503)},
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, user: CurrentUser,
                                 serving: ServingDep, metrics: MetricsDep) -> Any:
    """Answers the conversation with the base model, or with cartridges as context: `model` a
    cartridge id (loaded on demand), and/or the `cartridges` extension to compose several in
    order. A `file` content part puts a processed file's text in the prompt. A client that
    disconnects stops its generation."""
    arrived = time.monotonic()
    plan = await run_in_threadpool(completions.prepare, serving, user, body)
    answer = completions.Answer(serving, plan, body.model, arrived)
    streams = completions.submit(serving, plan)
    disconnected = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_disconnect(request, disconnected))

    def observe() -> None:
        watcher.cancel()
        usage = answer.usage(streams)
        metrics.observe_chat(prompt_tokens=usage["prompt_tokens"], cached_tokens=plan.cartridge_tokens,
                             completion_tokens=usage["completion_tokens"], started=answer.started,
                             first_token_at=answer.first_token_at, choices=len(streams))

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        return completions.EventStream(streams, answer, include_usage, disconnected, on_end=observe,
                                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    try:
        result = await completions.collect(streams, answer, disconnected)
    except GenerationError as error:
        log.error("generation failed: %s", error)
        raise APIError(500, "The engine failed while generating.") from None
    finally:
        observe()
    if result is None:  # the client is gone; nobody reads this
        return JSONResponse({}, status_code=499)
    return JSONResponse(result)


async def _watch_disconnect(request: Request, disconnected: asyncio.Event) -> None:
    """Sets `disconnected` when the client goes away (the body is read: the next message the
    server gets for this request is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            disconnected.set()
            return
