"""Retrieval beside a cartridge: BM25 over the corpus' passages, the best ones in the prompt.

A cartridge holds what a corpus says as a whole; retrieval brings its literal detail. On the
long-corpus suite's 16-17K-token documents the two together give more exact answers than either
alone; on its 40-53K-token ones one cartridge with the passages gives fewer than retrieval
alone, and the part of a cartridge in parts that search finds, with the passages, more on the
one such document measured (docs/experiments.md, "Long corpora"). The server offers them
together, or the passages alone (`retrieval` in a chat request, docs/api.md §4.3), and so does
a local `cartridges chat --corpus FILE... --retrieval`. The chunking, the ranking and the
prompt here are the ones the suite measures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .selfstudy.prompts import SYSTEM_PROMPT

CHUNK_TOKENS = 300  # about a paragraph or three: what users' text splitters cut
TOP_K = 4  # four chunks: about 1,200 tokens of prompt
MAX_PASSAGES = 16  # the most a chat request may ask for: 4,800 tokens of an 8,192-token context


def split_chunks(tokenizer: Any, text: str, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """The text cut into chunks of about `chunk_tokens` tokens at paragraph boundaries (a
    paragraph longer than that is cut by tokens), as a user's text splitter would."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in (p.strip() for p in re.split(r"\n\s*\n", text)):
        if not paragraph:
            continue
        ids = tokenizer.encode(paragraph)
        pieces = [paragraph] if len(ids) <= chunk_tokens else [
            tokenizer.decode(ids[i:i + chunk_tokens]) for i in range(0, len(ids), chunk_tokens)]
        for piece in pieces:
            n = len(tokenizer.encode(piece))
            if current and size + n > chunk_tokens:
                chunks.append("\n\n".join(current))
                current, size = [], 0
            current.append(piece)
            size += n
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def _terms(texts: Sequence[str]) -> Any:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", show_progress=False)


@dataclass(frozen=True)
class Hit:
    """A retrieved chunk: its text, its BM25 score and which of the indexed texts it comes from."""

    text: str
    score: float
    source: int  # index into the texts given to `Retriever.from_texts` (0 for `Retriever(chunks)`)


class Retriever:
    """BM25 (bm25s, English stop words) over fixed chunks."""

    def __init__(self, chunks: Sequence[str], sources: Sequence[int] | None = None) -> None:
        import bm25s

        if not chunks:
            raise ValueError("nothing to retrieve from: no chunks")
        self.chunks = list(chunks)
        self.sources = list(sources) if sources is not None else [0] * len(self.chunks)
        if len(self.sources) != len(self.chunks):
            raise ValueError(f"{len(self.sources)} sources for {len(self.chunks)} chunks")
        terms = _terms(self.chunks)
        # Chunks of stop words alone leave nothing to index (bm25s cannot index an empty vocabulary):
        # then no query finds a chunk, as a query of stop words alone finds none.
        self._bm25 = bm25s.BM25() if terms.vocab else None
        if self._bm25 is not None:
            self._bm25.index(terms, show_progress=False)

    @classmethod
    def from_texts(cls, tokenizer: Any, texts: Sequence[str], chunk_tokens: int = CHUNK_TOKENS) -> Retriever:
        """Chunks each text on its own (a chunk never spans two files)."""
        pieces = [(c, i) for i, text in enumerate(texts) for c in split_chunks(tokenizer, text, chunk_tokens)]
        return cls([c for c, _ in pieces], [i for _, i in pieces])

    def hits_many(self, queries: Sequence[str], k: int = TOP_K) -> list[list[Hit]]:
        """Per query, its best chunks first, at most `k`; a chunk that shares no term with the
        query (BM25 score 0) is never returned, so a query of stop words alone gets none, and so
        does every query over chunks of stop words alone."""
        if self._bm25 is None:
            return [[] for _ in queries]
        if not queries:
            return []
        k = min(k, len(self.chunks))
        ids, scores = self._bm25.retrieve(_terms(queries), k=k, show_progress=False)
        return [[Hit(self.chunks[int(i)], float(s), self.sources[int(i)]) for i, s in zip(row, row_scores) if s > 0]
                for row, row_scores in zip(ids, scores)]

    def search_many(self, queries: Sequence[str], k: int = TOP_K) -> list[list[str]]:
        """`hits_many`'s texts."""
        return [[hit.text for hit in hits] for hits in self.hits_many(queries, k)]

    def hits(self, query: str, k: int = TOP_K) -> list[Hit]:
        return self.hits_many([query], k)[0]

    def search(self, query: str, k: int = TOP_K) -> list[str]:
        return self.search_many([query], k)[0]


def passages_prompt(passages: Sequence[str]) -> str:
    """The system prompt that puts retrieved passages in context, best first: the prompt a
    cartridge's teacher read its document in during self-study."""
    return SYSTEM_PROMPT.format(chunk="\n\n".join(passages))


def with_passages(messages: Sequence[dict[str, str]], passages: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages with `passages` in a system message in front (a system message of the
    caller's follows them in the same message); the messages as they are without passages."""
    messages = list(messages)
    if not passages:
        return messages
    system = passages_prompt(passages)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{system}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": system}, *messages]
