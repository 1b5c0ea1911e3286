"""The corpus as tokens, and random chunks of it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Corpus:
    tokens: list[int]  # every text, in order, joined by a blank line

    @classmethod
    def from_texts(cls, tokenizer, texts: Sequence[str]) -> Corpus:
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ValueError("the corpus is empty")
        tokens = tokenizer.encode("\n\n".join(texts))
        if not tokens:
            raise ValueError("the corpus is empty")
        return cls(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def chunk(self, rng: random.Random, min_tokens: int, max_tokens: int) -> list[int]:
        """A random window of a length drawn in [min_tokens, max_tokens] (both clipped to the
        corpus length)."""
        hi = min(max_tokens, len(self.tokens))
        lo = min(min_tokens, hi)
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(self.tokens) - length)
        return self.tokens[start : start + length]
