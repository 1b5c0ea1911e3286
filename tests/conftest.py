"""Fixtures every test directory may use: a PostgreSQL server for the store's shared-database
backend (tests/postgres_server.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from postgres_server import ENV, PostgresServer, drop_database, fresh_database


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """The admin URL of a running PostgreSQL server: CARTRIDGES_TEST_POSTGRES_URL's (make test
    starts one), else a throwaway one started here for the session."""
    if os.environ.get(ENV):
        yield os.environ[ENV]
        return
    server = PostgresServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty database for one test; dropped after it."""
    url = fresh_database(postgres_admin_url)
    try:
        yield url
    finally:
        drop_database(postgres_admin_url, url)
