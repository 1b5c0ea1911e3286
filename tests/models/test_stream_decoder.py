"""The streaming detokenizer: the pieces it gives, joined, are `decode` of the ids, for the
byte-level table (byte-level BPE vocabularies) and for `tokenizers`' DecodeStream (the rest)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cartridges.models.tokenizer import ByteStreamDecoder, ChatTokenizer, StreamDecoder


def streamed(tokenizer: ChatTokenizer, ids: list[int], skip_special_tokens: bool) -> tuple[str, list[str]]:
    decoder = tokenizer.stream_decoder(skip_special_tokens)
    pieces = [decoder.feed(i) for i in ids]
    return "".join(pieces) + decoder.flush(), pieces


def random_ids(tokenizer: ChatTokenizer, rng: random.Random, texts: list[str]) -> list[int]:
    """Ids of any kind: random ones (special tokens, bytes that are not UTF-8) or a text's, cut
    anywhere (inside a character), with random ones after."""
    if rng.random() < 0.5:
        return [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
    ids = tokenizer.encode(rng.choice(texts))
    return ids[: rng.randrange(1, len(ids) + 1)] + [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(3))]


TEXTS = ["Ünïcödé 日本語 🎉👩‍💻 and plain text.\n", "ok 🎉", "a\u00a0b \t\n\r x <|im_end|> y", "caf\u00e9 \u2603"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_byte_level_table_streams_what_decode_gives(tiny_tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    tokenizer = ChatTokenizer(tiny_tokenizer, None)
    assert isinstance(tokenizer.stream_decoder(), ByteStreamDecoder)
    rng = random.Random(0)
    for _ in range(500):
        ids = random_ids(tokenizer, rng, TEXTS)
        assert streamed(tokenizer, ids, skip_special_tokens)[0] == tokenizer.decode(ids, skip_special_tokens), ids


def test_a_character_split_across_tokens_waits_for_its_last_byte(tiny_tokenizer: Tokenizer) -> None:
    tokenizer = ChatTokenizer(tiny_tokenizer, None)
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # the tiny vocabulary spells the emoji in bytes
    text, pieces = streamed(tokenizer, ids, True)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉" == text
    cut = ids[:-1]  # a stream cut inside the character: U+FFFD, as decode gives
    assert streamed(tokenizer, cut, True)[0] == tokenizer.decode(cut) == "\ufffd"


def test_another_decoder_streams_through_decode_stream() -> None:
    """A vocabulary that is not byte-level (SentencePiece's metaspace here) keeps `tokenizers`'
    own streaming decoder."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁caf": 4, "é": 5}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace()
    inner.decoder = decoders.Metaspace()
    tokenizer = ChatTokenizer(inner, None)
    assert isinstance(tokenizer.stream_decoder(), StreamDecoder)
    ids = [1, 2, 3, 4, 5]
    assert streamed(tokenizer, ids, True)[0] == tokenizer.decode(ids) == "hello world! café"
