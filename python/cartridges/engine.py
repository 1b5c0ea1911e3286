"""`Engine`: the serving engine of a model, shared by every caller of the process.

    engine = model.engine                       # started on first use, default options
    stream = engine.submit(model.encode_chat(messages), max_new_tokens=64, stop=["\\n\\n"])
    for delta in stream:                        # or `async for delta in stream` in asyncio code
        print(delta.text, end="")
    print(stream.finish_reason)                 # "stop", "length" or "cancelled"

The C++ engine computes on its own thread (continuous batching: requests join and leave at
any step). One dispatcher thread here takes each step's events with one GIL acquisition and
hands them to the streams; asyncio streams are woken with one `call_soon_threadsafe` per
event loop and step. A server whose streams live on one event loop has that loop take the
events itself instead (`deliver_on`): one wake-up a step fewer. Closing a stream (or leaving
its loop early) cancels the request.
"""

from __future__ import annotations

import asyncio
import atexit
import operator
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

import cartridges_core as core

from .models.tokenizer import common_prefix_len
from .stream import Stream

ContextLengthError = core.ContextLengthError
EngineBusyError = core.EngineBusyError
CacheFullError = core.CacheFullError
EngineStoppedError = core.EngineStoppedError

_PRIORITIES = {"interactive": core.Priority.INTERACTIVE, "background": core.Priority.BACKGROUND}
# The sampling defaults, the C++ SamplingParams' own: every signature below takes them from here.
DEFAULT_SAMPLING = core.SamplingParams()
# How several cartridges of one request are composed (cartridges_core.Composition).
COMPOSITIONS = {"mixture": core.Composition.MIXTURE, "route": core.Composition.ROUTE,
                "concatenate": core.Composition.CONCATENATE}
_POLL = timedelta(milliseconds=200)
_NO_WAIT = timedelta(0)
# Openings (template and system prompt) cached as prefixes: at least this many tokens to be
# worth a prefix, at most this many, and at most this many tokens kept in all (the least
# recently used dropped first; 4,096 tokens of the default model's KV are 188 MB).
_MIN_OPENING, _MAX_OPENING, _OPENING_TOKENS_KEPT = 16, 1024, 4096


class Engine:
    """The serving engine over a `Model`. Options (defaults in `cartridges_core.EngineOptions`):
    kv_tokens (KV pool size in tokens), max_running, prefill_tokens_per_step, max_waiting,
    cartridge_cache_bytes, num_threads (intra-op threads of the compute thread), cuda_graphs
    (decode steps on CUDA replay CUDA graphs), fixed_shape_decode (that path on any device, for
    tests).

    `cache_openings`: a request without cartridges whose prompt opens with the same tokens as
    earlier ones (the chat template's opening and the system prompt, up to `weigh_from`) reads
    that opening's KV, computed once, as a prefix in front of the rest of its prompt, instead of
    prefilling it again: the same numbers (a causal prefix of a prompt is a prefix of it), a
    fraction of the prefill when many requests share a system prompt."""

    def __init__(self, model: Any, *, cache_openings: bool = True, **options: int) -> None:
        opts = core.EngineOptions()
        for key, value in options.items():
            if value is None:
                continue
            if not hasattr(opts, key):
                raise TypeError(f"unknown engine option {key!r}")
            setattr(opts, key, value if isinstance(value, bool) else int(value))
        self.model = model
        self.native = core.Engine(model.native, opts)
        self._streams: dict[int, Stream] = {}
        self._opening: list[int] | None = None  # see template_opening()
        self._openings: OrderedDict[tuple[int, ...], core.KVPrefix] | None = OrderedDict() if cache_openings else None
        self._openings_lock = threading.Lock()
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()  # held by whoever takes events and hands them out, in order
        self._events_loop: asyncio.AbstractEventLoop | None = None  # see deliver_on()
        self._dispatcher = threading.Thread(target=self._dispatch, name="cartridges-engine-events", daemon=True)
        self._dispatcher.start()
        _ENGINES.add(self)

    @property
    def options(self) -> core.EngineOptions:
        return self.native.options

    @property
    def cartridges(self) -> core.CartridgeCache:
        return self.native.cartridges

    def stats(self) -> core.EngineStats:
        return self.native.stats()

    def submit(self, prompt: Sequence[int], *, prefixes: Sequence[Any] = (), seed: int | None = None,
               weigh_from: int | None = None, **sampling: Any) -> Stream:
        """Queues one request and returns its stream; see `submit_many` for the options."""
        return self.submit_many([prompt], prefixes=[prefixes], seeds=[seed],
                                weigh_from=None if weigh_from is None else [weigh_from], **sampling)[0]

    # Longer than 60 lines: a signature of every sampling option with its docstring, then one
    # validation and one submission.
    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        prefixes: Sequence[Sequence[Any]] | None = None,
        seeds: Sequence[int | None] | None = None,
        max_new_tokens: int = DEFAULT_SAMPLING.max_new_tokens,
        temperature: float = DEFAULT_SAMPLING.temperature,
        top_p: float = DEFAULT_SAMPLING.top_p,
        top_k: int = DEFAULT_SAMPLING.top_k,
        stop_token_ids: Sequence[int] | None = None,
        stop: Sequence[str] = (),
        logprobs: int = DEFAULT_SAMPLING.logprobs,
        logit_bias: Mapping[int, float] | None = None,
        priority: str = "interactive",
        composition: str = "mixture",
        weigh_from: Sequence[int] | None = None,
        condition: threading.Condition | None = None,
    ) -> list[Stream]:
        """Queues requests at once (all or none; they start in the same step when there is
        room, so a seeded batch is repeatable) and returns their streams.

        `prefixes`: per prompt, cartridges (`Cartridge` objects or KV prefixes) in order.
        `seeds`: per prompt (None draws a fresh one). `stop_token_ids` defaults to the
        tokenizer's end-of-turn ids; `stop` are text stop sequences (the match is not returned);
        `logprobs`: how many top log-probabilities to return per token (of the model's own
        distribution); `logit_bias`: token id -> a value in [-100, 100] added to its logit before
        sampling (-100 bans it); `priority`:
        "interactive" or "background". `composition`, for two or more cartridges: "mixture"
        (one sequence per cartridge, the next token drawn from their distributions weighted
        by how well each explains the conversation since `weigh_from`; each document's
        questions keep their single-cartridge quality), "route" (as "mixture" while the prompt
        is read, then the reply decoded with the heaviest cartridge alone: one sequence, for
        the parts of one corpus) or "concatenate" (their KV one after
        another in front of one sequence: cheaper, but trained cartridges pull every question
        to themselves). `weigh_from`: per prompt, the token from which a mixture's weights
        count the prompt (`ChatTokenizer.conversation_start`); by default, past the chat
        template's opening where a prompt starts with it (a conversation without a system
        prompt). Raises ContextLengthError (can never fit the context or the KV pool),
        EngineBusyError (queue full), ValueError (bad parameters)."""
        if priority not in _PRIORITIES:
            raise ValueError(f"priority must be one of {sorted(_PRIORITIES)}")
        if composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {sorted(COMPOSITIONS)}")
        stops = list(stop_token_ids) if stop_token_ids is not None else self._default_stops()
        kv = [[as_prefix(self.model, p) for p in row] for row in (prefixes or [()] * len(prompts))]
        seeds = seeds or [None] * len(prompts)
        weigh_from = list(weigh_from) if weigh_from is not None else [self.template_opening(p) for p in prompts]
        if len(kv) != len(prompts) or len(seeds) != len(prompts) or len(weigh_from) != len(prompts):
            raise ValueError("prefixes, seeds and weigh_from must have one entry per prompt")
        requests = []
        for prompt, row, seed, start in zip(prompts, kv, seeds, weigh_from):
            submitted, prefixes_in_front, start = self._split_opening(list(prompt), row, start)
            sampling = core.SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k, seed=-1 if seed is None else seed,
                max_new_tokens=max_new_tokens, stop_token_ids=stops, logprobs=logprobs,
                logit_bias=dict(logit_bias or {}))
            requests.append((submitted, prefixes_in_front, sampling, start))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        tokenizer = self.model.tokenizer
        with self._lock:
            try:
                ids = self.native.submit_all(requests, _PRIORITIES[priority], COMPOSITIONS[composition])
            except RuntimeError as error:
                if isinstance(error, (EngineBusyError, EngineStoppedError)):
                    raise
                raise ValueError(str(error).splitlines()[0]) from None  # c10::Error: a bad argument
            streams = [
                Stream(self, request_id, prompt_tokens=len(prompt), prefix_tokens=sum(p.num_tokens for p in row),
                       decoder=tokenizer.stream_decoder() if hasattr(tokenizer, "stream_decoder") else None,
                       stop_tokens=stops, stop=stop, loop=loop, condition=condition)
                for request_id, prompt, row in zip(ids, prompts, kv)
            ]
            for stream in streams:
                self._streams[stream.id] = stream
        return streams

    def _split_opening(self, prompt: list[int], cartridges: list[Any],
                       opening: int) -> tuple[list[int], list[Any], int]:
        """(prompt, prefixes, weigh_from) as submitted: a request without cartridges whose first
        `opening` tokens are worth caching reads them as a cached prefix; any other as is (an
        opening with ids outside the vocabulary too: the engine's submit refuses it clearly)."""
        if (self._openings is None or cartridges or not _MIN_OPENING <= opening <= _MAX_OPENING
                or opening >= len(prompt)):
            return prompt, cartridges, opening
        try:
            key = tuple(operator.index(token) for token in prompt[:opening])
        except TypeError:  # not integers
            return prompt, cartridges, opening
        if min(key) < 0 or max(key) >= self.model.native.config.vocab_size:
            return prompt, cartridges, opening
        with self._openings_lock:
            prefix = self._openings.get(key)
            if prefix is None:
                prefix = self.model.native.prefix_from_tokens(torch.tensor(key, dtype=torch.long))
                self._openings[key] = prefix
                while sum(len(k) for k in self._openings) > _OPENING_TOKENS_KEPT:
                    self._openings.popitem(last=False)
            else:
                self._openings.move_to_end(key)
        return prompt[opening:], [prefix], 0

    def template_opening(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s first tokens are the chat template's opening for a conversation
        without a system prompt (up to where the first user message's text begins)."""
        if self._opening is None:
            tokenizer = self.model.tokenizer
            try:
                question = [{"role": "user", "content": "Why?"}]
                self._opening = tokenizer.encode_chat(question)[:tokenizer.conversation_start(question)]
            except Exception:  # no tokenizer or no chat template: nothing to skip
                self._opening = []
        return common_prefix_len([prompt, self._opening]) if self._opening else 0

    def _default_stops(self) -> list[int]:
        if self.model.tokenizer is not None:
            return list(self.model.tokenizer.eos_token_ids)
        return list(getattr(self.model.config, "eos_token_ids", []))

    def close(self) -> None:
        """Cancels everything and stops the compute thread."""
        self.native.shutdown()
        if self._dispatcher is not threading.current_thread():
            self._dispatcher.join(timeout=5)

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Has `loop` take the engine's events itself, as a reader of the engine's events file
        descriptor, instead of the dispatcher thread: a step's events reach that loop's streams
        without a second thread's wake-up and hop (0.14-0.18 ms of CPU a step at one client;
        benchmarks/README.md, "The HTTP layer's cost per step").
        For a server, whose streams all live on one loop; streams of other loops and threads are
        still served. Callable from any thread; False (the thread stays) without an eventfd."""
        fd = self.native.events_fd()
        if fd < 0 or self._events_loop is not None:
            return False
        self._events_loop = loop  # the dispatcher thread ends after the events it holds
        loop.call_soon_threadsafe(loop.add_reader, fd, self._take_events_on_loop, fd)
        return True

    def _take_events_on_loop(self, fd: int) -> None:
        try:
            os.read(fd, 8)  # the eventfd's counter back to 0: readable again at the next step
        except BlockingIOError:
            pass
        with self._poll_lock:
            events = self.native.poll(_NO_WAIT)
            if events:
                self._hand_out(events, here=self._events_loop)
        if self.native.drained:  # shut down, and its last events are out
            self._events_loop.remove_reader(fd)

    def _dispatch(self) -> None:
        while True:
            with self._poll_lock:
                if self._events_loop is not None:
                    return  # the loop takes the events from here on
                events = self.native.poll(_POLL)
                if events:
                    self._hand_out(events)
            if not events and not self.native.running:
                return

    def _hand_out(self, events: list, here: asyncio.AbstractEventLoop | None = None) -> None:
        """Delivers a poll's events to their streams, and wakes their consumers: those of loop
        `here` (the caller runs on it) at once, those of other loops with one
        `call_soon_threadsafe` each."""
        by_stream: dict[int, list] = {}
        for e in events:
            by_stream.setdefault(e.request, []).append(e)
        loops: dict[asyncio.AbstractEventLoop, list[Stream]] = {}
        with self._lock:
            streams = [(self._streams.get(i), evs) for i, evs in by_stream.items()]
        for stream, evs in streams:
            if stream is None:
                continue  # closed by its consumer
            stream._deliver(evs)
            if stream._loop is not None:
                loops.setdefault(stream._loop, []).append(stream)
        for loop, woken in loops.items():
            if loop is here:
                _wake_all(woken)
                continue
            try:
                loop.call_soon_threadsafe(_wake_all, woken)
            except RuntimeError:
                pass  # that loop is closed: nobody is waiting any more


def as_prefix(model: Any, item: Any) -> core.KVPrefix:
    """A KV prefix as is, or a `Cartridge`'s prefix for this model (made once, then shared)."""
    return item if isinstance(item, core.KVPrefix) else item.prefix(model)


def _wake_all(streams: list[Stream]) -> None:
    for s in streams:
        s._wake()


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_engines() -> None:
    for engine in list(_ENGINES):
        engine.close()
