"""The server-sent events of a streamed chat, in process: an engine failure after the stream
has started becomes an OpenAI-shaped error event (the HTTP status is already sent)."""

from __future__ import annotations

import asyncio
import json

from cartridges.stream import Delta, GenerationError
from cartridges.server.completions import events


class FailingStream:
    """Yields one token, then fails as the engine reports a step error."""

    finish_reason = None
    tokens = [5]

    async def __aiter__(self):
        yield Delta("Hel", token=5)
        raise GenerationError("CUDA error: an illegal memory access was encountered")

    def close(self) -> None:
        self.closed = True


class FakeAnswer:
    first_token_at = None

    def chunk(self, choices, usage=None, with_usage=False, extra=None) -> bytes:
        return ("data: " + json.dumps({"choices": choices, **(extra or {})}) + "\n\n").encode()

    def retrieval(self):
        return {}

    def logprobs(self, entries):
        return None

    def usage(self, streams):
        return {}


def test_an_engine_failure_mid_stream_is_an_error_event() -> None:
    stream = FailingStream()

    async def run() -> list[bytes]:
        return [e async for e in events([stream], FakeAnswer(), False, asyncio.Event())]

    out = asyncio.run(run())
    bodies = [json.loads(e.decode().removeprefix("data: ")) for e in out]
    assert bodies[0]["choices"][0]["delta"]["role"] == "assistant"
    assert bodies[1]["choices"][0]["delta"]["content"] == "Hel"  # what came before the failure is sent
    error = bodies[-1]["error"]
    assert error == {"message": "The engine failed while generating.", "type": "server_error", "param": None,
                     "code": "internal_error"}  # no engine internals reach the client
    assert b"[DONE]" not in b"".join(out) and stream.closed
