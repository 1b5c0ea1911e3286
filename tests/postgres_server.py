"""A throwaway PostgreSQL server for the tests: Debian's `postgresql` binaries, a fresh
cluster in a temporary directory on a free loopback port, removed when stopped.

    python tests/postgres_server.py -- COMMAND...   runs COMMAND with CARTRIDGES_TEST_POSTGRES_URL
                                                    set to the running server's admin URL

The store's tests (GoogleTest and pytest) read CARTRIDGES_TEST_POSTGRES_URL; pytest starts a
server of its own when it is unset (tests/conftest.py). Run as root, the server runs as the
`postgres` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ENV = "CARTRIDGES_TEST_POSTGRES_URL"


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        raise RuntimeError("PostgreSQL's server is not installed: apt-get install postgresql (make test does)")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """`start()`: initdb and pg_ctl start; `pause()` / `resume()` stop and restart it on the same
    port (an outage); `stop()` removes everything."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="cartridges-pg-"))
        self.port = 0
        self._as_postgres = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql://cartridges@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stdout}{done.stderr}{tail}")

    def start(self) -> PostgresServer:
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        data = self.root / "data"
        bin_dir = _bin_dir()
        self._run(str(bin_dir / "initdb"), "-D", str(data), "-U", "cartridges", "-A", "trust", "--no-sync",
                  "-E", "UTF8", "--locale=C")
        # A port taken between choosing and binding fails the start: try a few.
        for attempt in range(5):
            self.port = _free_port()
            try:
                self.resume()
                return self
            except RuntimeError:
                if attempt == 4:
                    raise
        return self

    def pause(self) -> None:
        """Shuts the server down (fast: connections are cut), keeping its data."""
        self._run(str(_bin_dir() / "pg_ctl"), "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")

    def resume(self) -> None:
        """Starts the server (again) on its port."""
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(str(_bin_dir() / "pg_ctl"), "-D", str(self.root / "data"), "-o", options, "-l",
                  str(self.root / "server.log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            try:
                self._run(str(_bin_dir() / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def fresh_database(admin_url: str) -> str:
    """Creates an empty database on the server of `admin_url`; returns its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:16]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + "/" + name


def drop_database(admin_url: str, url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    server = PostgresServer().start()
    try:
        return subprocess.run(argv[1:], env=dict(os.environ, **{ENV: server.url})).returncode
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
