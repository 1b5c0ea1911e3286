"""Retrieval in chat (docs/api.md §4.3): the passages of the cartridges' own training files that
best match the user's last message, put in the prompt behind the cartridges.

The index of a set of cartridges is built on first use (chunks of ~300 tokens, BM25) and kept
for the next requests; every request checks first that the caller still has each training file,
so that a deleted file's text is never served."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from cartridges.retrieval import Retriever
from cartridges.selfstudy.chunking import named_texts
from cartridges.server.errors import APIError
from cartridges.server.principal import Principal
from cartridges.store import core

MAX_INDEXES = 32  # sets of cartridges whose index stays in memory (a 100K-token corpus: a few MB)


class Passages:
    def __init__(self, store: Any) -> None:
        self.store = store
        self._indexes: OrderedDict[tuple[str, ...], Retriever] = OrderedDict()
        self._lock = threading.Lock()

    def search(self, principal: Principal, records: list[Any], tokenizer: Any, query: str, k: int) -> list[str]:
        """The best `k` passages for `query` (fewer when fewer share a word with it) from the
        training files of `records` (succeeded datablocks of the caller). Blocking."""
        files = [[self._checked_file(principal, record, file_id) for file_id in record.training_files]
                 for record in records]
        key = tuple(record.id for record in records)
        with self._lock:
            index = self._indexes.get(key)
            if index is not None:
                self._indexes.move_to_end(key)
        if index is None:
            index = Retriever.from_texts(tokenizer, self._texts(principal, records, files))
            with self._lock:
                self._indexes[key] = index
                while len(self._indexes) > MAX_INDEXES:
                    self._indexes.popitem(last=False)
        return index.search(query, k)

    def _checked_file(self, principal: Principal, record: Any, file_id: str) -> Any:
        try:
            return self.store.get_file(principal.owner, file_id)
        except core().NotFoundError:
            raise APIError(409, f"Retrieval searches the training files of cartridge '{record.id}', and its file "
                           f"'{file_id}' has been deleted. Leave out `retrieval`, or train the cartridge again.",
                           code="retrieval_unavailable", param="retrieval") from None

    def _texts(self, principal: Principal, records: list[Any], files: list[list[Any]]) -> list[str]:
        """Per cartridge, its corpus as training read it: one file as it is, several under their names."""
        texts = []
        for record, its_files in zip(records, files):
            try:
                texts += named_texts([(f.filename, self.store.file_text(principal.owner, f.id)) for f in its_files])
            except core().NotFoundError:
                raise APIError(409, f"A training file of cartridge '{record.id}' was deleted meanwhile. Leave out "
                               "`retrieval`, or train the cartridge again.", code="retrieval_unavailable",
                               param="retrieval") from None
        return [t for t in texts if t.strip()]
