"""Servers whose records live in PostgreSQL (CARTRIDGES_DATABASE_URL): two replicas answer for
the same users and files, the CLI's keys reach both, and a database outage is a 503 and
`unhealthy`, never a hang or a crash, until the database is back.

The replicas here share one data directory for blobs (one machine, or a shared volume); blobs
in an object store are not built yet (docs/deployment.md)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from cartridges.store import DATABASE_URL_ENV
from postgres_server import PostgresServer, drop_database, fresh_database

from .conftest import API_KEY, LiveServer, running_replicas

pytestmark = pytest.mark.slow


def _replica(data_dir: Path, database_url: str, model: Path) -> LiveServer:
    return LiveServer(data_dir, model=model, env={DATABASE_URL_ENV: database_url})


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str, tiny_model_dir: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    data_dir = tmp_path / "data"
    second = _replica(data_dir, postgres_url, tiny_model_dir)
    second.log_path = tmp_path / "second-server.log"
    yield from running_replicas(_replica(data_dir, postgres_url, tiny_model_dir), second)


def test_files_uploaded_through_one_replica_are_served_by_the_other(replicas: tuple[LiveServer, LiveServer]) -> None:
    first, second = replicas
    alice, bob = first.add_user("alice"), first.add_user("bob")
    assert first.data_dir == second.data_dir and first.port != second.port

    uploaded = first.openai(alice).files.create(file=("notes.txt", io.BytesIO(b"shared notes")), purpose="assistants")
    other = second.openai(alice)
    assert [f.id for f in other.files.list()] == [uploaded.id]
    assert other.files.retrieve(uploaded.id).filename == "notes.txt"
    assert other.files.content(uploaded.id).read() == b"shared notes"

    # Per-user isolation holds on every replica.
    with pytest.raises(openai.NotFoundError):
        second.openai(bob).files.retrieve(uploaded.id)
    assert list(second.openai(bob).files.list()) == []

    other.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        first.openai(alice).files.retrieve(uploaded.id)
    # The default key bootstrapped by the first replica is accepted by the second.
    assert second.http(API_KEY).get("/v1/files").status_code == 200


def test_a_key_made_by_the_cli_is_accepted_by_every_replica(replicas: tuple[LiveServer, LiveServer]) -> None:
    first, second = replicas
    env = dict(os.environ, **{DATABASE_URL_ENV: first.env[DATABASE_URL_ENV]})
    made = subprocess.run([sys.executable, "-m", "cartridges.cli", "keys", "create", "--user", "carol",
                           "--data-dir", str(first.data_dir)], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().splitlines()[-1]
    for replica in (first, second):
        assert replica.http(key).get("/v1/files").status_code == 200
    assert first.http("sk-cart-not-a-key").get("/v1/files").status_code == 401


def _wait_status(http: httpx.Client, path: str, status: int, timeout: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = http.get(path)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def test_a_database_outage_is_a_503_and_unhealthy_until_it_is_back(tmp_path: Path, tiny_model_dir: Path) -> None:
    database = PostgresServer().start()  # its own server: this test stops it
    try:
        replica = _replica(tmp_path / "data", fresh_database(database.url), tiny_model_dir).start()
        try:
            key = replica.add_user("alice")
            client = replica.http(key)
            assert client.get("/v1/files").status_code == 200

            database.pause()
            started = time.monotonic()
            listed = client.get("/v1/files")
            assert listed.status_code == 503, listed.text
            assert listed.json()["error"]["code"] == "unavailable"
            assert "database" in listed.json()["error"]["message"]
            health = replica.http(None).get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "unhealthy"
            assert "database" in health.json()["reason"]
            assert time.monotonic() - started < 20  # answered, not hung
            assert replica.alive()

            database.resume()
            assert _wait_status(replica.http(None), "/health", 200).json()["status"] == "healthy"
            assert client.get("/v1/files").status_code == 200
        finally:
            replica.stop()
    finally:
        database.stop()


def test_a_server_whose_database_is_unreachable_at_start_waits_for_it_unhealthy(
        tmp_path: Path, tiny_model_dir: Path, postgres_admin_url: str) -> None:
    """It does not exit: /health says unhealthy and why, every API call is a 503, and once the
    database answers the server starts and serves."""
    import psycopg

    name = "t_later_" + os.urandom(6).hex()
    replica = _replica(tmp_path / "data", postgres_admin_url.rsplit("/", 1)[0] + "/" + name, tiny_model_dir)
    replica.start(healthy=False)
    try:
        health = replica.http(None).get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "cannot reach the database" in health.json()["reason"]
        listed = replica.http(API_KEY).get("/v1/files")
        assert listed.status_code == 503 and listed.json()["error"]["code"] == "unavailable"
        assert listed.headers["retry-after"] == "5"
        assert replica.http(None).get("/metrics").status_code == 200
        assert replica.alive()

        with psycopg.connect(postgres_admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        assert _wait_status(replica.http(None), "/health", 200).json()["status"] == "healthy"
        assert replica.http(API_KEY).get("/v1/files").status_code == 200  # the bootstrap key works
    finally:
        replica.stop()
        drop_database(postgres_admin_url, replica.env[DATABASE_URL_ENV])


def test_an_unreachable_database_at_start_is_a_clear_error(tmp_path: Path) -> None:
    from cartridges.store import core, open_store

    started = time.monotonic()
    with pytest.raises(core().UnavailableError, match="cannot reach the database"):
        open_store(tmp_path / "data", database_url="postgresql://nobody@127.0.0.1:1/nothing")
    assert time.monotonic() - started < 10


def test_the_database_connection_probes_a_silent_peer(tmp_path: Path, postgres_url: str) -> None:
    """A database cut off by the network sends no reset: TCP keepalives (and the TCP user
    timeout) make a waiting call fail as unavailable instead of hanging for the kernel's
    retransmission time. The store's sockets carry the keepalive timer (`ss -o` shows it)."""
    from urllib.parse import urlsplit

    from cartridges.store import open_store

    store = open_store(tmp_path / "data", sync=False, database_url=postgres_url)
    try:
        port = urlsplit(postgres_url).port
        sockets = subprocess.run(["ss", "-tnopH", "state", "established", f"( dport = :{port} )"],
                                 capture_output=True, text=True, check=True).stdout.splitlines()
        ours = [line for line in sockets if f"pid={os.getpid()}," in line]
        assert ours, sockets
        # The first probe within keepalives_idle (10 s), not the system's default of two hours.
        timers = [re.search(r"timer:\(keepalive,(?:(\d+)min)?(\d*\.?\d*)(ms|sec)?", line) for line in ours]
        assert all(t is not None for t in timers), ours
        seconds = [int(t[1] or 0) * 60 + float(t[2] or 0) / (1000 if t[3] == "ms" else 1) for t in timers]
        assert all(s <= 10 for s in seconds), ours
    finally:
        store.close()


def test_a_stalled_database_process_fails_the_call_and_the_next_reconnects(
        tmp_path: Path, postgres_url: str, postgres_admin_url: str) -> None:
    """A server process that stops answering while its host stays up (a hung disk or a paused
    machine; SIGSTOP here) still has every packet acknowledged by the host's kernel, so TCP
    keepalives never fire and its statement timeout never runs. The store gives up on the reply
    after the statement timeout (30 s) and two seconds: the call fails as unavailable (a 503).
    The next call reconnects to a fresh server process while the stalled one stays stopped; and
    a stalled process that resumes before any next call finds its connection closed and ends,
    rather than idling until then. Two stores, one of each, stall together."""
    import signal

    import psycopg

    from cartridges.store import core, open_store

    def backends() -> set[int]:
        with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
            return {row[0] for row in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'cartridges' AND datname = %s",
                (postgres_url.rsplit("/", 1)[1],))}

    reconnecting = open_store(tmp_path / "a", sync=False, database_url=postgres_url)
    resumed = None
    try:
        reconnecting.create_user("alice")
        first = backends()
        resumed = open_store(tmp_path / "b", sync=False, database_url=postgres_url)
        resumed.list_users()
        second = backends() - first
        assert first and second
        try:
            os.kill(next(iter(first)), 0)
        except ProcessLookupError:
            pytest.skip("the test database runs on another machine: its processes cannot be stopped from here")
        stalled = first | second
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        calls = ThreadPoolExecutor(2)  # a call that hangs fails its result(timeout) below, not the suite
        try:
            started = time.monotonic()
            waits = [calls.submit(store.list_users) for store in (reconnecting, resumed)]
            for wait in waits:
                with pytest.raises(core().UnavailableError, match="no reply in 32 s"):
                    wait.result(timeout=60)
            assert 30 <= time.monotonic() - started < 45
            assert [u.name for u in reconnecting.list_users()] == ["alice"]  # a fresh connection
            reconnecting.create_user("bob")
        finally:
            calls.shutdown(wait=False)
            for pid in stalled:
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while any(process_runs(pid) for pid in stalled) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_runs(pid) for pid in stalled), "a stalled server process outlived its connection"
        assert sorted(u.name for u in resumed.list_users()) == ["alice", "bob"]  # a fresh connection
    finally:
        reconnecting.close()
        if resumed is not None:
            resumed.close()


def process_runs(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a PostgreSQL backend is reaped by its
    postmaster, but not at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return False
