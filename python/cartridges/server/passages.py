"""Search over the cartridges' own training files in chat (docs/api.md §4.3): the passages that
best match the user's last message, put in the prompt behind the cartridges (`retrieval`), and
the part of a cartridge trained in parts that the message is about (`composition: "search"`).

The index of a set of cartridges is built on first use (chunks of ~300 tokens, BM25) and kept
for the next requests; every request for passages checks first that the caller still has each
training file, so that a deleted file's text is never served. The index of a cartridge's parts
serves no text: it only names a part."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cartridges.parts import PartSearch, search_of_cut
from cartridges.retrieval import Retriever
from cartridges.selfstudy.chunking import named_texts
from cartridges.server.errors import APIError
from cartridges.server.principal import Principal
from cartridges.store import core

log = logging.getLogger("cartridges.server")
MAX_INDEXES = 32  # indexes of sets of cartridges (and of parts) kept in memory (a 100K-token corpus: a few MB)


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
        self._part_indexes: OrderedDict[str, PartSearch | None] = OrderedDict()
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

    def find_parts(self, principal: Principal, record: Any, tokenizer: Any, parts: int, query: str) -> list[int]:
        """Which of the `parts` parts of `record`'s cartridge `query` is about (`PartSearch`, the
        best first): BM25 over the parts as its training cut them (its training files, joined as
        training joins them, cut by `corpus_parts` at the datablock's `part_tokens`). No part (an
        empty list) when the query shares no word with them, or the parts cannot be rebuilt: a
        cartridge imported from a file (no training files), a training file since deleted or
        damaged in the store, or a cut that no longer gives `parts` parts. Blocking."""
        search = self.part_search(principal, record, tokenizer, parts)
        return search.find(query) if search is not None and query.strip() else []

    def part_search(self, principal: Principal, record: Any, tokenizer: Any, parts: int) -> PartSearch | None:
        """The index of the `parts` parts of `record`'s cartridge, built on first use (re-reading
        and re-cutting its training files: one to two seconds per 50K tokens) and kept for the next
        requests, or None where the parts cannot be rebuilt (`find_parts`). Blocking."""
        with self._lock:
            known = record.id in self._part_indexes
            search = self._part_indexes.get(record.id)
            if known:
                self._part_indexes.move_to_end(record.id)
        if not known:
            search = self._built_part_search(principal, record, tokenizer, parts)
            with self._lock:
                self._part_indexes[record.id] = search
                while len(self._part_indexes) > MAX_INDEXES:
                    self._part_indexes.popitem(last=False)
        return search

    def _built_part_search(self, principal: Principal, record: Any, tokenizer: Any, parts: int) -> PartSearch | None:
        part_tokens = json.loads(record.config or "{}").get("part_tokens")
        if not record.training_files or not isinstance(part_tokens, int):
            return None
        try:
            files = [self.store.get_file(principal.owner, file_id) for file_id in record.training_files]
            texts = named_texts([(f.filename, self.store.file_text(principal.owner, f.id)) for f in files])
        except core().NotFoundError:
            return None
        except core().CorruptError as error:  # the request still has every part to answer by mixture
            log.warning("cartridge %s: its parts cannot be searched: %s", record.id, error)
            return None
        return search_of_cut(tokenizer, texts, part_tokens, parts)

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
