"""Fixtures of the loading tests."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from model_files import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return make_tiny_tokenizer()
