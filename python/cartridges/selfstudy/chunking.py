"""The corpus as tokens, and the plan of which part of it each synthesis batch reads.

Each batch gets a *chunk* (what "A" writes its message about) inside a *window* (what "B", the
teacher, has in context: the whole corpus when it fits). Chunks tile the corpus evenly rather
than at random, so that every part of it is asked about once the batches go round once; windows
tile it likewise, and the batches of one window come one after another, so that its KV is
computed once per round.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Corpus:
    tokens: list[int]  # every text, in order, joined by a blank line
    texts: tuple[str, ...] = ()  # the texts themselves (one per file), for what searches them one by one

    @classmethod
    def from_texts(cls, tokenizer, texts: Sequence[str]) -> Corpus:
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ValueError("the corpus is empty")
        tokens = tokenizer.encode(_joined(texts))
        if not tokens:
            raise ValueError("the corpus is empty")
        return cls(tokens, tuple(texts))

    def __len__(self) -> int:
        return len(self.tokens)

    def digest(self) -> str | None:
        """`corpus_digest` of the texts, or None for a corpus made from tokens alone."""
        return corpus_digest(self.texts) if self.texts else None


def _joined(texts: Sequence[str]) -> str:
    return "\n\n".join(t for t in texts if t.strip())


def corpus_digest(texts: str | Sequence[str]) -> str:
    """"sha256:" + the hex digest (UTF-8) of `texts` joined as `Corpus.from_texts` joins them:
    what a cartridge records of the text it was trained on (`corpus_sha256` in its config), so
    that other texts are told from it."""
    return "sha256:" + hashlib.sha256(_joined([texts] if isinstance(texts, str) else texts).encode()).hexdigest()


def named_texts(files: Sequence[tuple[str, str]]) -> list[str]:
    """The texts of (name, text) files as one corpus reads them: one file as it is; several, in
    their order, each under its name as a heading, so that a reader of a passage ("A", the
    teacher, a user of the cartridge) can tell which file it comes from."""
    if len(files) == 1:
        return [files[0][1]]
    return [f"# {name}\n\n{text}" for name, text in files]


@dataclass(frozen=True)
class Span:
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BatchView:
    chunk: Span  # what A reads
    window: Span  # what B reads; it contains the chunk


def even_spans(start: int, end: int, length: int, count: int | None = None) -> list[Span]:
    """Spans of `length` tokens (less when [start, end) is shorter) that cover [start, end),
    `count` of them (at least the fewest that cover it), evenly spaced: the first starts at
    `start`, the last ends at `end`, neighbours overlap by the same amount."""
    total = end - start
    length = min(length, total)
    fewest = math.ceil(total / length)
    count = max(count or fewest, fewest)
    if count == 1:
        return [Span(start, start + length)]
    gap = (total - length) / (count - 1)
    return [Span(start + round(i * gap), start + round(i * gap) + length) for i in range(count)]


def plan_views(corpus_tokens: int, num_batches: int, chunk_tokens: int, window_tokens: int,
               rng: random.Random) -> list[BatchView]:
    """What each of `num_batches` batches reads, in order.

    Windows of `window_tokens` cover the corpus (one window when it fits); chunks of
    `chunk_tokens` cover each window. When `num_batches` is too few for chunks of that length
    to cover the corpus, chunks grow (up to the window) until they do. Rounds follow each
    other until every batch has a view: a round visits every chunk once, window by window in a
    random order, and odd rounds use one more chunk per window than even rounds, so that their
    boundaries fall elsewhere."""
    if corpus_tokens < 1 or num_batches < 1:
        raise ValueError("plan_views needs a non-empty corpus and at least one batch")
    window_tokens = max(1, min(window_tokens, corpus_tokens))
    chunk_tokens = max(1, min(chunk_tokens, window_tokens))
    windows = even_spans(0, corpus_tokens, window_tokens)

    def chunks_of_round(round_index: int, length: int) -> list[list[Span]]:
        return [even_spans(w.start, w.end, length, math.ceil(len(w) / length) + round_index % 2) for w in windows]

    while chunk_tokens < window_tokens and sum(map(len, chunks_of_round(0, chunk_tokens))) > num_batches:
        chunk_tokens = min(window_tokens, math.ceil(chunk_tokens * 1.25))

    views: list[BatchView] = []
    round_index = 0
    while len(views) < num_batches:
        per_window = chunks_of_round(round_index, chunk_tokens)
        for w in rng.sample(range(len(windows)), len(windows)):
            chunks = per_window[w]
            views.extend(BatchView(c, windows[w]) for c in rng.sample(chunks, len(chunks)))
        round_index += 1
    return views[:num_batches]


def partner_chunk(corpus_tokens: int, chunk: Span, rng: random.Random, min_gap: float = 0.25) -> Span | None:
    """A span as long as `chunk`, not overlapping it, whose centre lies at least `min_gap` of
    the corpus away from the chunk's centre, drawn uniformly among those; None when the corpus
    has none (it is too short for two parts that far apart)."""
    length, gap = len(chunk), max(corpus_tokens * min_gap, len(chunk))
    centre = (chunk.start + chunk.end) / 2
    last = corpus_tokens - length  # the last start
    # Starts s with |s + length / 2 - centre| >= gap: below `low` or above `high`.
    low, high = math.floor(centre - gap - length / 2), math.ceil(centre + gap - length / 2)
    ranges = [(0, min(low, last)), (max(high, 0), last)]
    ranges = [(a, b) for a, b in ranges if a <= b]
    sizes = [b - a + 1 for a, b in ranges]
    if not ranges:
        return None
    pick = rng.randrange(sum(sizes))
    for (a, _), size in zip(ranges, sizes):
        if pick < size:
            return Span(a + pick, a + pick + length)
        pick -= size
    raise AssertionError("unreachable")


PARTS = 10  # the tenths of a corpus, over which training signal and held-out quality are reported


def part_of(span: tuple[int, int], corpus_tokens: int, parts: int = PARTS) -> int:
    """Which of `parts` equal parts of the corpus holds the centre of `span`."""
    centre = (span[0] + span[1]) / 2
    return min(parts - 1, max(0, int(centre * parts / corpus_tokens)))


def part_view(corpus_tokens: int, part: int, parts: int, chunk_tokens: int, window_tokens: int,
              rng: random.Random) -> BatchView:
    """A chunk centred at a random point of part `part` of `parts` equal parts of the corpus, in
    the window (of those that tile the corpus) nearest that point: held-out batches read every
    part of the corpus alike, so that the quality report can be given per part."""
    window_tokens = max(1, min(window_tokens, corpus_tokens))
    chunk_tokens = max(1, min(chunk_tokens, window_tokens))
    centre = corpus_tokens * (part + rng.random()) / parts
    window = min(even_spans(0, corpus_tokens, window_tokens), key=lambda w: abs((w.start + w.end) / 2 - centre))
    start = min(max(window.start, round(centre - chunk_tokens / 2)), window.end - chunk_tokens)
    return BatchView(Span(start, start + chunk_tokens), window)
