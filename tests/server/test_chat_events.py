"""The server-sent events of a streamed chat, in process: an engine failure after the stream
has started becomes an OpenAI-shaped error event (the HTTP status is already sent); one
text-only choice's own path writes what the general path writes, to the server's own send."""

from __future__ import annotations

import asyncio
import json

import pytest

from cartridges.models.tokenizer import ChatTokenizer
from cartridges.stream import Delta, GenerationError
from model_files import make_tiny_tokenizer
from cartridges.server.completions import SERVER_SEND, Answer, EventStream, Plan, events


class FailingStream:
    """Yields one token, then fails as the engine reports a step error."""

    finish_reason = None
    tokens = [5]

    async def batches(self):
        yield [Delta("Hel", token=5)]
        raise GenerationError("CUDA error: an illegal memory access was encountered")

    def close(self) -> None:
        self.closed = True


class FinishingStream:
    """Two wake-ups' worth of tokens (the second brings two), then the end."""

    finish_reason = None
    error = None
    tokens = [5, 6, 7]

    async def batches(self):
        yield [Delta("Hel", token=5)]
        yield [Delta("lo", token=6), Delta(" w", token=7)]
        self.finish_reason = "stop"

    def close(self) -> None:
        self.closed = True


class FakeAnswer:
    first_token_at = None

    def __init__(self, top_logprobs: int | None = None) -> None:
        self.plan = type("Plan", (), {"top_logprobs": top_logprobs})()  # set: the general path

    def chunk(self, choices, usage=None, with_usage=False, extra=None) -> bytes:
        return ("data: " + json.dumps({"choices": choices, **(extra or {})}) + "\n\n").encode()

    def content_chunk(self, index, text, with_usage=False) -> bytes:
        return self.chunk([{"index": index, "delta": {"content": text}}])

    def extensions(self):
        return {}

    def logprobs(self, entries):
        return None

    def usage(self, streams):
        return {}


def collect_events(stream, answer: FakeAnswer) -> list[bytes]:
    """The events a streamed completion's response writes (ASGI 2.4: no disconnect listener)."""
    bodies: list[bytes] = []

    async def run() -> None:
        async def receive() -> dict:
            await asyncio.Event().wait()

        async def send(message: dict) -> None:
            if message.get("body"):
                bodies.append(message["body"])

        response = EventStream([stream], answer, False, asyncio.Event(), on_end=lambda: None)
        await response({"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST"}, receive, send)

    asyncio.run(run())
    return bodies


# One text-only choice takes a path of its own (the per-token cost); logprobs take the general one.
@pytest.mark.parametrize("top_logprobs", [None, 2])
def test_an_engine_failure_mid_stream_is_an_error_event(top_logprobs: int | None) -> None:
    stream = FailingStream()
    out = collect_events(stream, FakeAnswer(top_logprobs))

    bodies = [json.loads(e.decode().removeprefix("data: ")) for e in out]
    assert bodies[0]["choices"][0]["delta"]["role"] == "assistant"
    assert bodies[1]["choices"][0]["delta"]["content"] == "Hel"  # what came before the failure is sent
    error = bodies[-1]["error"]
    assert error == {"message": "The engine failed while generating.", "type": "server_error", "param": None,
                     "code": "internal_error"}  # no engine internals reach the client
    assert b"[DONE]" not in b"".join(out) and stream.closed


def test_one_text_choice_streams_the_events_of_the_general_path() -> None:
    """The one-choice path sends what the general path sends: the role, each wake-up's text as
    one chunk, the finish reason, [DONE]."""
    direct, general = FakeAnswer(None), FakeAnswer(2)
    out = collect_events(FinishingStream(), direct)
    assert out == collect_events(FinishingStream(), general)
    texts = [json.loads(e.decode().removeprefix("data: "))["choices"][0]["delta"] for e in out[:-1]]
    assert texts == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo w"}, {}]
    assert out[-1] == b"data: [DONE]\n\n"
    assert direct.first_token_at is not None and general.first_token_at is not None


def test_the_general_path_is_what_the_response_writes() -> None:
    """`events`, which the response serves for several choices or log-probabilities, yields
    what the response writes."""
    async def run() -> list[bytes]:
        return [e async for e in events([FinishingStream()], FakeAnswer(2), False, asyncio.Event())]

    assert asyncio.run(run()) == collect_events(FinishingStream(), FakeAnswer(2))


@pytest.mark.parametrize("top_logprobs", [None, 2])
def test_events_go_to_the_servers_own_send_past_the_middlewares(top_logprobs: int | None) -> None:
    """The app puts the server's `send` in the scope: the response's start goes through the
    middlewares' `send` (they note its status), every body message straight to the server's."""
    through_middlewares: list[str] = []
    direct: list[bytes] = []

    async def run() -> None:
        async def receive() -> dict:
            await asyncio.Event().wait()

        async def send(message: dict) -> None:
            through_middlewares.append(message["type"])

        async def server_send(message: dict) -> None:
            assert message["type"] == "http.response.body"
            direct.append(message["body"])

        response = EventStream([FinishingStream()], FakeAnswer(top_logprobs), False, asyncio.Event(),
                               on_end=lambda: None)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", SERVER_SEND: server_send}
        await response(scope, receive, send)

    asyncio.run(run())
    assert through_middlewares == ["http.response.start"]
    assert [b for b in direct if b] == collect_events(FinishingStream(), FakeAnswer(top_logprobs))
    assert direct[-1] == b""  # the end of the body


def respond(stream, start_send_waits: bool, client_gone: bool) -> tuple[list[str], list[int]]:
    """Runs a streamed completion's response as the server would (ASGI 2.3, whose streaming
    response listens for the disconnect beside the stream): the ASGI messages sent, and the
    calls of `on_end`."""
    ended: list[int] = []
    sent: list[str] = []

    async def run() -> None:
        response = EventStream([stream], FakeAnswer(), False, asyncio.Event(), on_end=lambda: ended.append(1))
        gone = asyncio.Event()
        if client_gone:
            gone.set()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if start_send_waits and message["type"] == "http.response.start":
                await asyncio.sleep(0.05)  # as a send to a full socket does
            sent.append(message["type"])
            if message.get("more_body") is False:
                gone.set()

        await response({"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}, receive, send)

    asyncio.run(run())
    return sent, ended


def test_a_streamed_response_ends_its_streams_once_however_it_ends() -> None:
    """A client gone before the first event: Starlette cancels the response before the events'
    generator has run; the engine's stream is closed all the same (or it would generate for
    nobody) and the request's metrics are taken once. A whole response: once as well."""
    stream = FinishingStream()
    sent, ended = respond(stream, start_send_waits=True, client_gone=True)
    assert "http.response.body" not in sent  # the generator never ran
    assert stream.closed and ended == [1]

    stream = FinishingStream()
    sent, ended = respond(stream, start_send_waits=False, client_gone=False)
    assert sent == ["http.response.start"] + ["http.response.body"] * 6  # role, 2 texts, finish, [DONE], end
    assert stream.closed and ended == [1]


@pytest.mark.parametrize("model", ["base-model", "cart_\u00e9t\u00e9 \"quoted\""])
def test_a_content_chunk_is_the_general_chunk_byte_for_byte(model: str) -> None:
    """Stream events of text alone come from a template (the per-token path); they must be
    exactly what the general chunk writes."""
    plan = Plan(prompt=[1, 2], prefixes=[], composition="mixture", weigh_from=0, cartridge_tokens=0,
                max_new_tokens=4, stop=[], top_logprobs=None, seeds=[-1])
    serving = type("Serving", (), {"model": type("Model", (), {"tokenizer": ChatTokenizer(make_tiny_tokenizer(), None)})()})()
    answer = Answer(serving, plan, model, started=0.0)
    for text in ["Hello", " world", "", 'a "quote", a \\ and a\nnew line', "caf\u00e9 \u2603 \U0001f600", "</script>"]:
        for index in (0, 3):
            for with_usage in (False, True):
                general = answer.chunk([{"index": index, "delta": {"content": text}, "logprobs": None,
                                         "finish_reason": None}], with_usage=with_usage)
                assert answer.content_chunk(index, text, with_usage=with_usage) == general
                assert json.loads(general.decode().removeprefix("data: "))["choices"][0]["delta"]["content"] == text
