"""Retrieval in chat (docs/api.md §4.3): the passages of the cartridges' own training files that
best match the user's last message, put in the prompt behind the cartridges.

The index of a set of cartridges is built on first use (chunks of ~300 tokens, BM25) and kept
for the next requests; every request checks first that the caller still has each training file,
so that a deleted file's text is never served."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cartridges.retrieval import Retriever
from cartridges.selfstudy.chunking import named_texts
from cartridges.server.errors import APIError
from cartridges.server.principal import Principal
from cartridges.store import core

MAX_INDEXES = 32  # sets of cartridges whose index stays in memory (a 100K-token corpus: a few MB)


@dataclass(frozen=True)
class Origin:
    """Where an indexed text comes from: a cartridge's training file."""

    cartridge: str
    file_id: str
    filename: str


@dataclass(frozen=True)
class Passage:
    text: str
    score: float  # BM25
    origin: Origin

    def citation(self) -> dict[str, Any]:
        """The passage as a chat response names it (docs/api.md §4.3)."""
        return {"cartridge": self.origin.cartridge, "file_id": self.origin.file_id,
                "filename": self.origin.filename, "score": round(self.score, 4), "text": self.text}


class Passages:
    def __init__(self, store: Any) -> None:
        self.store = store
        self._indexes: OrderedDict[tuple[str, ...], tuple[Retriever, list[Origin]]] = OrderedDict()
        self._lock = threading.Lock()

    def search(self, principal: Principal, records: list[Any], tokenizer: Any, query: str, k: int) -> list[Passage]:
        """The best `k` passages for `query` (fewer when fewer share a word with it) from the
        training files of `records` (succeeded datablocks of the caller), best first. Blocking."""
        files = [[self._checked_file(principal, record, file_id) for file_id in record.training_files]
                 for record in records]
        key = tuple(record.id for record in records)
        with self._lock:
            entry = self._indexes.get(key)
            if entry is not None:
                self._indexes.move_to_end(key)
        if entry is None:
            texts, origins = self._texts(principal, records, files)
            if not texts:  # nothing but blank files: nothing to find
                return []
            entry = Retriever.from_texts(tokenizer, texts), origins
            with self._lock:
                self._indexes[key] = entry
                while len(self._indexes) > MAX_INDEXES:
                    self._indexes.popitem(last=False)
        index, origins = entry
        return [Passage(hit.text, hit.score, origins[hit.source]) for hit in index.hits(query, k)]

    def _checked_file(self, principal: Principal, record: Any, file_id: str) -> Any:
        try:
            return self.store.get_file(principal.owner, file_id)
        except core().NotFoundError:
            raise APIError(409, f"Retrieval searches the training files of cartridge '{record.id}', and its file "
                           f"'{file_id}' has been deleted. Leave out `retrieval`, or train the cartridge again.",
                           code="retrieval_unavailable", param="retrieval") from None

    def _texts(self, principal: Principal, records: list[Any],
               files: list[list[Any]]) -> tuple[list[str], list[Origin]]:
        """Per cartridge, its corpus as training read it (one file as it is, several under their
        names), one text per file, and where each text comes from."""
        texts, origins = [], []
        for record, its_files in zip(records, files):
            try:
                named = named_texts([(f.filename, self.store.file_text(principal.owner, f.id)) for f in its_files])
            except core().NotFoundError:
                raise APIError(409, f"A training file of cartridge '{record.id}' was deleted meanwhile. Leave out "
                               "`retrieval`, or train the cartridge again.", code="retrieval_unavailable",
                               param="retrieval") from None
            for f, text in zip(its_files, named):
                if text.strip():
                    texts.append(text)
                    origins.append(Origin(record.id, f.id, f.filename))
        return texts, origins
