"""Retrieval beside a cartridge (cartridges.retrieval): chunks cut at paragraphs, BM25 ranking,
passages that share no word with the query left out, and the prompt they go in."""

from __future__ import annotations

import pytest

from cartridges.retrieval import Retriever, passages_prompt, split_chunks
from cartridges.selfstudy.prompts import SYSTEM_PROMPT


class WordTokenizer:
    """One token per word: chunk sizes can be counted by eye."""

    def encode(self, text: str) -> list[str]:
        return text.split()

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def paragraph(word: str, n: int) -> str:
    return " ".join(f"{word}{i}" for i in range(n))


def test_chunks_join_paragraphs_up_to_the_size_and_cut_longer_ones() -> None:
    text = "\n\n".join([paragraph("a", 4), paragraph("b", 4), paragraph("c", 3), paragraph("d", 25)]) + "\n\n  \n\n"
    chunks = split_chunks(WordTokenizer(), text, chunk_tokens=10)
    assert chunks == [
        f"{paragraph('a', 4)}\n\n{paragraph('b', 4)}",  # 8 words; c's 3 would make 11
        paragraph("c", 3),
        " ".join(f"d{i}" for i in range(10)),
        " ".join(f"d{i}" for i in range(10, 20)),
        " ".join(f"d{i}" for i in range(20, 25)),
    ]


def test_search_ranks_by_bm25_and_leaves_out_passages_without_a_shared_word() -> None:
    chunks = ["The ferry Maribel crosses the lake twice a day.",
              "The captain of the ferry keeps goats on the island.",
              "The bell Brannick was cast in 1402 by Odo Ferr."]
    retriever = Retriever(chunks)
    assert retriever.search("Who keeps goats?", k=3) == [chunks[1]]
    assert retriever.search("When was the bell cast?", k=3) == [chunks[2]]
    ferry = retriever.search("ferry captain", k=3)
    assert ferry[0] == chunks[1] and set(ferry) == {chunks[0], chunks[1]}
    assert retriever.search("ferry", k=1) in ([chunks[0]], [chunks[1]])
    assert retriever.search("what is it?", k=3) == []  # no word of the query is in the corpus
    assert retriever.search_many(["goats", "bell"], k=3) == [[chunks[1]], [chunks[2]]]


def test_hits_carry_their_score_and_source() -> None:
    retriever = Retriever(["ferry goats goats", "ferry", "bell"], sources=[0, 0, 1])
    hits = retriever.hits("goats ferry", k=3)
    assert [h.text for h in hits] == ["ferry goats goats", "ferry"] and [h.source for h in hits] == [0, 0]
    assert hits[0].score > hits[1].score > 0
    assert retriever.hits("bell")[0].source == 1
    with pytest.raises(ValueError, match="2 sources for 3 chunks"):
        Retriever(["a", "b", "c"], sources=[0, 1])


def test_a_corpus_of_stop_words_alone_finds_nothing_rather_than_failing() -> None:
    retriever = Retriever(["The and of it.", "Is it a?"])  # nothing for BM25 to index
    assert retriever.search("the lighthouse", k=2) == [] and retriever.search_many(["of", "bell"]) == [[], []]


def test_from_texts_never_joins_two_texts_in_a_chunk() -> None:
    retriever = Retriever.from_texts(WordTokenizer(), ["alpha beta", "gamma delta"], chunk_tokens=100)
    assert retriever.chunks == ["alpha beta", "gamma delta"] and retriever.sources == [0, 1]
    assert [h.source for h in retriever.hits("delta")] == [1]
    with pytest.raises(ValueError, match="no chunks"):
        Retriever.from_texts(WordTokenizer(), ["", "\n\n"])


def test_passages_go_in_the_teachers_system_prompt_best_first() -> None:
    assert passages_prompt(["first", "second"]) == SYSTEM_PROMPT.format(chunk="first\n\nsecond")
