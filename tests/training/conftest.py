"""Fixtures of the training tests."""

from __future__ import annotations

import pytest

from .tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    """A tiny Llama with random weights, made once per test module."""
    return tiny_model()
