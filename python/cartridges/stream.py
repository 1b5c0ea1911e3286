"""`Stream`: one request's tokens as they come from the engine, as text, with stop
sequences, log-probabilities and cancellation; and the values it yields."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine


class GenerationError(RuntimeError):
    """The engine failed while computing a request (its message says why)."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities


@dataclass
class Delta:
    """What one sampled token adds: `text` is the newly released text ("" while it might
    still turn out to be the start of a stop sequence)."""

    text: str
    token: int | None = None  # None for the final flush of held-back text
    logprob: TokenLogprob | None = None


@dataclass
class Completion:
    tokens: list[int]  # generated ids, a final stop token included
    text: str  # decoded, without special tokens, cut before a matched stop sequence
    finish_reason: str  # "stop", "length" or "cancelled"
    logprobs: list[TokenLogprob] = field(default_factory=list)


def choice_seeds(seed: int | None, n: int) -> list[int]:
    """Seeds of `n` choices of one request: distinct, and the same for the same seed."""
    if seed is None:
        return [-1] * n
    return [(seed * 1_000_003 + i * 0x9E3779B1) % (2**63 - 1) for i in range(n)]


class Stream:
    """One request's output as it is generated. Iterate it (blocking or async), or call
    `result()`. Not shared between threads."""

    def __init__(self, engine: Engine, request_id: int, *, prompt_tokens: int, prefix_tokens: int,
                 decoder: Any | None, stop_tokens: Sequence[int], stop: Sequence[str],
                 loop: asyncio.AbstractEventLoop | None, condition: threading.Condition | None) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.prefix_tokens = prefix_tokens  # cartridge tokens in front of the prompt
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._engine = engine
        self._decoder = decoder
        self._stop_tokens = set(stop_tokens)
        self._stop = [s for s in stop if s]
        self._keep = max((len(s) for s in self._stop), default=1) - 1  # text held back: could start a stop
        self._held = ""  # decoded text not released yet (could start a stop sequence)
        self._events: collections.deque = collections.deque()
        self._condition = condition or threading.Condition()
        self._loop = loop
        self._waiter: asyncio.Future | None = None  # what an async consumer waits on (`_arrival`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- delivery (dispatcher thread) ------------------------------------------------------

    def _deliver(self, events: list) -> None:
        with self._condition:
            self._events.extend(events)
            self._condition.notify_all()

    def _wake(self) -> None:  # on the stream's event loop
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- consumption -----------------------------------------------------------------------

    def _take(self, limit: int | None = None) -> list[Delta]:
        """Turns the delivered events (at most `limit` of them) into deltas (detokenization,
        stop sequences)."""
        with self._condition:
            if limit is None:
                events = list(self._events)
                self._events.clear()
            else:
                events = [self._events.popleft() for _ in range(min(limit, len(self._events)))]
        out: list[Delta] = []
        for e in events:
            if self.finished:
                break  # ended here (stop sequence, close): later events are dropped
            if e.finished:
                self._finish(e.finish_reason, e.error or None, out)
                continue
            self.tokens.append(e.token)
            lp = None
            if e.top_ids:
                lp = TokenLogprob(e.token, e.logprob, list(zip(e.top_ids, e.top_logprobs)))
                self.logprobs.append(lp)
            text = ""
            if self._decoder is not None and e.token not in self._stop_tokens:
                text = self._release(self._decoder.feed(e.token))
            out.append(Delta(text, e.token, lp))
        return out

    def _release(self, piece: str) -> str:
        """Adds decoded text; returns what can be shown now. A stop sequence ends the request
        there: the text before it is released, the rest never is."""
        if not self._stop:  # nearly every request: nothing to hold back
            self.text += piece
            return piece
        self._held += piece
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if hits:
            released, self._held = self._held[: min(hits)], ""
            self.text += released
            self._end("stop", None)
            self._engine.native.cancel(self.id)
            return released
        cut = len(self._held) - self._keep
        released, self._held = self._held[:cut], self._held[cut:]
        self.text += released
        return released

    def _finish(self, reason: str, error: str | None, out: list[Delta]) -> None:
        if reason != "error" and self._decoder is not None and (tail := self._decoder.flush()):
            if text := self._release(tail):
                out.append(Delta(text))
            if self.finished:  # the tail completed a stop sequence
                return
        if self._held:  # nothing more can come: what was held back is text after all
            out.append(Delta(self._held))
            self.text += self._held
            self._held = ""
        self._end(reason, error)

    def _end(self, reason: str, error: str | None) -> None:
        self.finish_reason = reason
        self.error = error
        self._engine._forget(self.id)

    def _raise_on_error(self) -> None:
        if self.finish_reason == "error":
            raise GenerationError(self.error or "generation failed")

    def __iter__(self) -> Iterator[Delta]:
        try:
            while True:
                yield from self._take()
                if self.finished:
                    self._raise_on_error()
                    return
                with self._condition:
                    while not self._events:
                        self._condition.wait()
        finally:
            self.close()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        async with contextlib.aclosing(self.batches()) as batches:  # leaving early cancels now, not at GC
            async for deltas in batches:
                for delta in deltas:
                    yield delta

    async def batches(self) -> AsyncIterator[list[Delta]]:
        """The deltas as they arrive: one list per wake-up (a step's token, or several when the
        consumer fell behind), never empty. A server sends each list as one event."""
        if self._loop is None:
            raise RuntimeError("this stream was submitted outside an event loop; iterate it without `async`")
        try:
            while True:
                if deltas := self._take():
                    yield deltas
                if self.finished:
                    self._raise_on_error()
                    return
                if (arrival := self._arrival()) is not None:
                    await arrival
        finally:
            self.close()

    def _arrival(self) -> asyncio.Future | None:
        """On the stream's loop: a future that the next delivery (or the stream's close) resolves,
        or None when events are waiting already. A bare future rather than an asyncio.Event: one
        is awaited per token of every streamed reply. A wake-up scheduled for events taken
        since may resolve it early: the consumer then finds nothing and waits again."""
        with self._condition:
            if self._events:
                return None
        self._waiter = self._loop.create_future()
        return self._waiter

    def result(self) -> Completion:
        """Waits for the end and returns the whole completion."""
        for _ in self:
            pass
        return Completion(self.tokens, self.text, self.finish_reason or "cancelled", self.logprobs)

    def close(self) -> None:
        """Cancels the request if it is still going; the tokens so far stay. A consumer
        waiting on the stream (in any thread or task) wakes up and sees it finished."""
        if not self.finished:
            self._engine.native.cancel(self.id)
            self._end("cancelled", None)
            with self._condition:
                self._condition.notify_all()
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._wake)
                except RuntimeError:
                    pass  # its loop is closed

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
