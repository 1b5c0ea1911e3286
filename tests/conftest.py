"""Fixtures every test directory may use: a PostgreSQL server for the store's shared-database
backend (tests/postgres_server.py) and an S3 endpoint for its object-store backend
(tests/s3_server.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from postgres_server import ENV, PostgresServer, drop_database, fresh_database
from s3_server import S3Server


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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server for the session (tests/s3_server.py)."""
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_blob_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """s3://<a fresh bucket>/blobs, with the AWS_* variables of the endpoint set for this process."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_server.fresh_bucket()}/blobs"
