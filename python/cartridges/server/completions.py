"""Chat completions over the engine (docs/api.md §4): a request becomes a prompt, a list of
cartridges and sampling options; the engine's streams become a `chat.completion` or a stream
of `chat.completion.chunk` events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cartridges.engine import COMPOSITIONS, ContextLengthError, EngineBusyError, EngineStoppedError
from cartridges.stream import Delta, GenerationError, Stream, TokenLogprob, choice_seeds
from cartridges.retrieval import with_passages
from cartridges.server.chat_schemas import ChatCompletionRequest, FilePart, RetrievalOptions
from cartridges.server.principal import Principal
from cartridges.server.errors import APIError
from cartridges.server.passages import Passage
from cartridges.server.serving import CartridgeUnavailable, Serving
from cartridges.store import core

log = logging.getLogger("cartridges.server")
FILE_WAIT_S = 30.0  # file parts still being processed are waited for this long, all of a request's together


@dataclass
class Plan:
    """A chat request ready for the engine."""

    prompt: list[int]
    prefixes: list[Any]
    composition: str
    weigh_from: int  # where a mixture starts weighing its cartridges: the conversation, past the system prompt
    cartridge_tokens: int
    max_new_tokens: int
    stop: list[str]
    top_logprobs: int | None  # None: no log-probabilities
    seeds: list[int]
    sampling: dict[str, float] = field(default_factory=dict)
    logit_bias: dict[int, float] = field(default_factory=dict)
    passages: list[Passage] | None = None  # what retrieval put in the prompt; None: not asked for
    searched: list[dict[str, Any]] | None = None  # the parts found per cartridge in parts; None: none searched


def prepare(serving: Serving, user: Principal, body: ChatCompletionRequest) -> Plan:
    """Resolves cartridges and files, renders the prompt, checks the context. Blocking."""
    model, _ = serving.require_ready()
    records, parts_of = [], []  # parts_of[i]: the KV prefixes of records[i], one per part
    ids: list[tuple[str, str]] = []
    if body.model != serving.model_id:
        ids.append((body.model, "model"))
    ids += [(c if isinstance(c, str) else c.id, "cartridges") for c in body.cartridges or []]
    options = body.retrieval if isinstance(body.retrieval, RetrievalOptions) else RetrievalOptions()
    for identifier, param in ids:
        try:
            if body.retrieval and options.passages_only:  # their files are searched, their KV never loaded
                records.append(serving.record(user, identifier, param=param))
                parts_of.append([])
                continue
            record, parts = serving.cartridge(user, identifier, param=param)
        except CartridgeUnavailable as unavailable:
            raise unavailable.error from None
        if len(parts) > 1 and body.composition == "concatenate":
            raise APIError(400, f"Cartridge '{identifier}' was trained in parts, which are not concatenated: "
                           "leave out `composition` (or give \"search\", \"mixture\" or \"route\").",
                           code="invalid_value", param="composition")
        records.append(record)
        parts_of.append(parts)

    files_deadline = time.monotonic() + FILE_WAIT_S
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _content(serving, user, m.content, i, files_deadline)} for i, m in enumerate(body.messages)]
    query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    searched = None
    if body.composition == "search":  # each cartridge in parts: the parts the query is about, or all
        searched = []
        for i, (record, parts) in enumerate(zip(records, parts_of)):
            if len(parts) > 1:
                found = serving.passages.find_parts(user, record, model.tokenizer, len(parts), query) \
                    or list(range(len(parts)))
                searched.append({"id": record.id, "parts": [j + 1 for j in found], "of": len(parts)})
                parts_of[i] = [parts[j] for j in found]
        searched = searched or None  # no cartridge in parts: nothing was searched, and the response says nothing
    prefixes = [prefix for parts in parts_of for prefix in parts]
    cartridge_tokens = sum(prefix.num_tokens for prefix in prefixes)
    composition = "mixture" if body.composition == "search" else body.composition
    passages = None
    if body.retrieval:
        messages, passages = _with_passages(serving, user, records, messages, query, options.top_k)
    try:
        prompt = model.encode_chat(messages)
        weigh_from = model.conversation_start(messages, prompt)
    except Exception as error:  # the model's chat template refuses the conversation (e.g. roles out of order)
        raise APIError(400, f"The conversation cannot be rendered with the model's chat template: {error}",
                       code="invalid_value", param="messages") from None

    # The engine's rule (a mixture gives each cartridge its own sequence: only the longest
    # takes context in front), asked of the engine so that the two never disagree.
    in_front = core().tokens_in_front([p.num_tokens for p in prefixes], COMPOSITIONS[composition])
    context, used = model.context_length, in_front + len(prompt)
    requested = body.max_completion_tokens or body.max_tokens
    if requested is None:
        requested = min(serving.settings.default_max_tokens, context - used)
    if requested < 1 or used + requested > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens; the request needs "
                       f"{used + max(requested, 1)} ({in_front} in cartridges, {len(prompt)} in the messages, "
                       f"{max(requested, 1)} for the completion). Shorten the messages or lower max_tokens.",
                       code="context_length_exceeded", param="messages")

    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    logit_bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
    outside = sorted(t for t in logit_bias if t >= model.config.vocab_size)
    if outside:
        raise APIError(400, f"logit_bias names token id {outside[0]}, outside the model's vocabulary of "
                       f"{model.config.vocab_size} tokens.", code="invalid_value", param="logit_bias")
    return Plan(
        prompt=prompt, prefixes=prefixes, composition=composition, weigh_from=weigh_from,
        cartridge_tokens=cartridge_tokens,
        max_new_tokens=requested,
        stop=[s for s in stop if s], top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        seeds=choice_seeds(body.seed, body.n),
        sampling={"temperature": 1.0 if body.temperature is None else body.temperature,
                  "top_p": 1.0 if body.top_p is None else body.top_p},
        logit_bias=logit_bias,
        passages=passages,
        searched=searched,
    )


def _with_passages(serving: Serving, user: Principal, records: list[Any], messages: list[dict[str, str]],
                   query: str, top_k: int) -> tuple[list[dict[str, str]], list[Passage]]:
    """The messages with the passages that best match `query` (the last user message) in a system
    message in front (a system message of the caller's follows them in the same message), and the
    passages."""
    if not records:
        raise APIError(400, "`retrieval` searches the training files of the request's cartridges, and it names "
                       "none: give a cartridge as `model` or in `cartridges`, or leave out `retrieval`.",
                       code="invalid_value", param="retrieval")
    passages = serving.passages.search(user, records, serving.model.tokenizer, query, top_k) if query.strip() else []
    return with_passages(messages, [p.text for p in passages]), passages


def _content(serving: Serving, user: Principal, content: Any, index: int, deadline: float) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        texts.append(_file_text(serving, user, part.file.file_id, index, deadline) if isinstance(part, FilePart)
                     else part.text)
    return "\n\n".join(texts)


def _file_text(serving: Serving, user: Principal, file_id: str, index: int, deadline: float) -> str:
    param = f"messages[{index}].content"
    try:
        record = serving.store.get_file(user.owner, file_id)
        while record.status == "uploaded" and time.monotonic() < deadline:
            time.sleep(0.1)
            record = serving.store.get_file(user.owner, file_id)
        if record.status != "processed":
            reason = record.status_details or "it is still being processed"
            raise APIError(400, f"File '{file_id}' has no text to use: {reason}.", code="file_not_processed",
                           param=param)
        return serving.store.file_text(user.owner, file_id)
    except core().NotFoundError:
        raise APIError(404, f"No file '{file_id}'.", param=param) from None


def submit(serving: Serving, plan: Plan) -> list[Stream]:
    """Queues the request's choices on the engine (call on the event loop: the streams wake it)."""
    _, engine = serving.require_ready()
    try:
        return engine.submit_many(
            [plan.prompt] * len(plan.seeds), prefixes=[plan.prefixes] * len(plan.seeds), seeds=plan.seeds,
            max_new_tokens=plan.max_new_tokens, stop=plan.stop, composition=plan.composition,
            weigh_from=[plan.weigh_from] * len(plan.seeds),
            logprobs=0 if plan.top_logprobs is None else max(1, plan.top_logprobs), logit_bias=plan.logit_bias,
            **plan.sampling)
    except ContextLengthError as error:
        raise APIError(400, f"The request does not fit: {error}", code="context_length_exceeded",
                       param="max_tokens") from None
    except EngineBusyError:
        raise APIError(429, "The server has too many requests waiting; retry shortly.",
                       headers={"Retry-After": "1"}) from None
    except EngineStoppedError:
        raise APIError(503, "The engine has stopped.") from None
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_value") from None


# -- answers ---------------------------------------------------------------------------------


class Answer:
    """Builds the response objects of one request, and times it."""

    def __init__(self, serving: Serving, plan: Plan, model: str, started: float) -> None:
        """`started`: when the request arrived (time.monotonic()), for time to first token."""
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.plan = plan
        self._tokenizer = serving.model.tokenizer
        self._token_bytes = _byte_decoder(self._tokenizer)
        self._stop_ids = set(self._tokenizer.eos_token_ids)
        self.started = started
        self.first_token_at: float | None = None
        # A chunk's fields before its choices, and their JSON up to the choices' first (content_chunk).
        self._chunk_fields = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                              "model": model, "system_fingerprint": None}
        self._chunk_head = json.dumps(self._chunk_fields, separators=(",", ":"))[:-1] + ',"choices":['

    def usage(self, streams: list[Stream]) -> dict[str, Any]:
        prompt = len(self.plan.prompt) + self.plan.cartridge_tokens
        completion = sum(len(s.tokens) for s in streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.plan.cartridge_tokens},
                "completion_tokens_details": None}

    def completion(self, streams: list[Stream]) -> dict[str, Any]:
        choices = []
        for index, stream in enumerate(streams):
            choices.append({
                "index": index,
                "message": {"role": "assistant", "content": stream.text, "refusal": None},
                "logprobs": self.logprobs(stream.logprobs),
                "finish_reason": _finish_reason(stream),
            })
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, "usage": self.usage(streams), **self.extensions()}

    def extensions(self) -> dict[str, Any]:
        """Extensions (docs/api.md §4.3): the passages retrieval put in the prompt, when asked for,
        and the parts `composition: "search"` (the default) used of each cartridge in parts."""
        out: dict[str, Any] = {}
        if self.plan.passages is not None:
            out["retrieval"] = {"passages": [p.citation() for p in self.plan.passages]}
        if self.plan.searched is not None:
            out["search"] = {"cartridges": self.plan.searched}
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage: bool = False, extra: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {**self._chunk_fields, "choices": choices, **(extra or {})}
        if with_usage:
            body["usage"] = usage
        return sse_event(json.dumps(body, separators=(",", ":")))

    def content_chunk(self, index: int, text: str, with_usage: bool = False) -> bytes:
        """`chunk` of one choice's text alone, nearly every event of a stream: the same bytes,
        with only the text encoded per token."""
        usage = ',"usage":null' if with_usage else ""
        return sse_event(f'{self._chunk_head}{{"index":{index},"delta":{{"content":{json.dumps(text)}}},'
                         f'"logprobs":null,"finish_reason":null}}]{usage}}}')

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.plan.top_logprobs is None:
            return None
        return {"content": [self._logprob(e) for e in entries if e.token not in self._stop_ids], "refusal": None}

    def _logprob(self, entry: TokenLogprob) -> dict[str, Any]:
        top = [self._token(t, lp) for t, lp in entry.top[: self.plan.top_logprobs]]
        return {**self._token(entry.token, entry.logprob), "top_logprobs": top}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _finish_reason(stream: Stream) -> str:
    if stream.finish_reason == "error":
        raise GenerationError(stream.error or "generation failed")
    return "length" if stream.finish_reason == "length" else "stop"


def _byte_decoder(tokenizer: Any) -> Callable[[int], bytes]:
    """A token's bytes, special tokens included: from the tokenizer's byte table for a
    byte-level BPE vocabulary, otherwise the token decoded as text."""
    table = tokenizer.byte_table(skip_special_tokens=False)

    def token_bytes(token: int) -> bytes:
        if table is not None and 0 <= token < len(table):
            return table[token]
        return tokenizer.decode([int(token)], skip_special_tokens=False).encode("utf-8")

    return token_bytes


# -- non-streaming and streaming -------------------------------------------------------------


async def collect(streams: list[Stream], answer: Answer, disconnected: asyncio.Event) -> dict[str, Any] | None:
    """Waits for every choice; None when the client went away first (the choices are cancelled)."""

    async def drain(stream: Stream) -> None:
        async for delta in stream:
            if answer.first_token_at is None and delta.token is not None:
                answer.first_token_at = time.monotonic()

    work = asyncio.gather(*(drain(s) for s in streams))
    gone = asyncio.ensure_future(disconnected.wait())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return None
        work.result()  # raises GenerationError
        return answer.completion(streams)
    finally:
        gone.cancel()
        for stream in streams:
            stream.close()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)


# Longer than 60 lines: the event order (one choice per chunk, usage last) and the merging of
# what arrived together share the response's state.
async def events(streams: list[Stream], answer: Answer, include_usage: bool,
                 disconnected: asyncio.Event) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed completion, ending with `data: [DONE]` (served by
    `EventStream`, which ends the request however the events end, and writes those of one
    text-only choice itself: `EventStream.send_text_events`).

    As OpenAI streams `n` > 1: every chunk carries exactly one choice, its `index` saying which;
    a choice's first chunk brings the role, its last (a chunk of its own) the finish reason; the
    usage chunk, when asked for, comes last with no choices. What a choice's stream delivered
    together (the loop fell behind the engine) goes out as one chunk."""

    async def watch() -> None:
        await disconnected.wait()
        for stream in streams:
            stream.close()

    def one(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
            finish_reason: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
        return answer.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
                            with_usage=include_usage, extra=extra)

    watcher = asyncio.ensure_future(watch())
    arrivals = _arrivals(streams)
    try:
        for index in range(len(streams)):  # the extensions (retrieved passages, parts found), once, first
            yield one(index, {"role": "assistant", "content": ""}, extra=answer.extensions() if index == 0 else None)
        remaining = len(streams)
        while remaining:
            batch = await anext(arrivals)
            merged: dict[int, dict[str, Any]] = {}
            failure: BaseException | None = None
            for index, item in batch:
                if isinstance(item, BaseException):
                    failure = item
                    break
                entry = merged.setdefault(index, {"text": "", "logprobs": [], "finish_reason": None})
                if item is None:
                    remaining -= 1
                    entry["finish_reason"] = _finish_reason(streams[index])
                    continue
                if item.token is not None and answer.first_token_at is None:
                    answer.first_token_at = time.monotonic()
                entry["text"] += item.text
                if item.logprob is not None:
                    entry["logprobs"].append(item.logprob)
            for index, entry in merged.items():
                logprobs = answer.logprobs(entry["logprobs"])
                if logprobs and logprobs["content"]:
                    yield one(index, {"content": entry["text"]}, logprobs)
                elif entry["text"]:
                    yield answer.content_chunk(index, entry["text"], with_usage=include_usage)
            if failure is not None:  # after what came before it
                yield _error_event(failure)
                return
            for index, entry in merged.items():
                if entry["finish_reason"] is not None:
                    yield one(index, {}, finish_reason=entry["finish_reason"])
        if include_usage:
            yield answer.chunk([], answer.usage(streams), with_usage=True)
        yield sse_event("[DONE]")
    except GenerationError as error:
        yield _error_event(error)
    finally:
        for stream in streams:
            stream.close()
        watcher.cancel()
        await arrivals.aclose()
        await asyncio.gather(watcher, return_exceptions=True)


Arrival = tuple[int, Delta | BaseException | None]  # a choice's delta, its end (None) or its failure


async def _arrivals(streams: list[Stream]) -> AsyncIterator[list[Arrival]]:
    """What the choices' streams delivered, a list per wake-up, in order of arrival. One choice
    (nearly every request) is read directly; several are pumped into one queue by a task each."""
    if len(streams) == 1:
        try:
            async with contextlib.aclosing(streams[0].batches()) as batches:
                async for deltas in batches:
                    yield [(0, delta) for delta in deltas]
            yield [(0, None)]
        except Exception as error:  # noqa: BLE001 - sent to the client as an error event
            yield [(0, error)]
        return
    queue: asyncio.Queue[Arrival] = asyncio.Queue()

    async def pump(index: int, stream: Stream) -> None:
        try:
            async for deltas in stream.batches():
                for delta in deltas:
                    queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as error:  # noqa: BLE001 - sent to the client as an error event
            queue.put_nowait((index, error))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


# The scope key under which the app (app.ServerApp) puts the server's own `send`, ahead of every
# middleware, for the events of a streamed completion.
SERVER_SEND = "cartridges.server_send"


class EventStream(StreamingResponse):
    """A streamed completion's response: `events` over its streams. However the response ends,
    the streams are closed and `on_end` runs, once, here: Starlette cancels a response whose
    client is gone, and a cancellation that lands before the events' generator first runs (a
    send that waits, as one to a full socket does) skips the generator's own cleanup, which
    would leave the engine generating for nobody.

    The response's start goes through the middlewares, which note its status; its events, one
    or more per token, go straight to the server's `send` when the app put it in the scope: the
    middlewares pass a body on untouched, and five wrappers' calls per event were a twentieth
    of the HTTP layer's cost (benchmarks/README.md, "The HTTP layer's cost per step")."""

    media_type = "text/event-stream"

    def __init__(self, streams: list[Stream], answer: Answer, include_usage: bool, disconnected: asyncio.Event,
                 on_end: Callable[[], None], headers: dict[str, str] | None = None) -> None:
        self._streams = streams
        self._answer, self._include_usage, self._disconnected = answer, include_usage, disconnected
        self._on_end = on_end
        self._body_send: Send | None = None
        super().__init__(events(streams, answer, include_usage, disconnected), headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._body_send = scope.get(SERVER_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()
            self._on_end()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send_body = self._body_send or send

        async def write(event: bytes) -> None:
            await send_body({"type": "http.response.body", "body": event, "more_body": True})

        if len(self._streams) == 1 and self._answer.plan.top_logprobs is None:
            await self.send_text_events(write)
        else:
            async for event in self.body_iterator:
                await write(event)
        await send_body({"type": "http.response.body", "body": b"", "more_body": False})

    async def send_text_events(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        """`events` of one text-only choice (nearly every request), written as its stream's
        batches arrive: the same events, without the general path's generators and merging
        between the stream and the socket (the HTTP layer's cost per token)."""
        stream, answer, usage = self._streams[0], self._answer, self._include_usage

        async def watch() -> None:
            await self._disconnected.wait()
            stream.close()

        def one(delta: dict[str, Any], finish_reason: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
            return answer.chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                                with_usage=usage, extra=extra)

        watcher = asyncio.ensure_future(watch())
        try:
            await write(one({"role": "assistant", "content": ""}, extra=answer.extensions()))
            async with contextlib.aclosing(stream.batches()) as batches:
                while True:
                    try:  # the stream's failures become an error event; the socket's are not caught
                        deltas = await anext(batches)
                    except StopAsyncIteration:
                        break
                    except Exception as error:  # noqa: BLE001 - sent to the client as an error event
                        await write(_error_event(error))
                        return
                    if answer.first_token_at is None and any(d.token is not None for d in deltas):
                        answer.first_token_at = time.monotonic()
                    if text := "".join(delta.text for delta in deltas):
                        await write(answer.content_chunk(0, text, with_usage=usage))
            try:
                finish = one({}, finish_reason=_finish_reason(stream))
            except GenerationError as error:
                await write(_error_event(error))
                return
            await write(finish)
            if usage:
                await write(answer.chunk([], answer.usage(self._streams), with_usage=True))
            await write(sse_event("[DONE]"))
        finally:
            stream.close()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


def sse_event(data: str) -> bytes:
    """One server-sent event of one `data:` line (JSON as `json.dumps` writes it has no line breaks)."""
    return b"data: " + data.encode() + b"\n\n"


def _error_event(error: BaseException) -> bytes:
    """The engine's own message goes to the server log only: it may name internals."""
    log.error("generation failed: %s", error)
    body = {"error": {"message": "The engine failed while generating.", "type": "server_error", "param": None,
                      "code": "internal_error"}}
    return sse_event(json.dumps(body))

