"""Files API over loopback: upload and download throughput, server peak memory, list latency.

    .venv/bin/python benchmarks/bench_files.py [--sizes-mib 1 64 512] [--list-files 10000]
                                               [--backends local,shared]

Starts `cartridges serve` on a fresh port and data directory (fsync on, as in production),
streams each upload from memory (no client disk reads), and reads downloads in 1 MiB chunks.
Server peak memory is VmHWM of the server process. For the list latency, 10 000 files are
loaded straight into a second store (fsync off), then served.

Backends, measured one after the other in the same run:
  local   SQLite and blobs in the data directory (the default)
  shared  records in PostgreSQL and blobs in S3 (docs/deployment.md): a throwaway PostgreSQL
          server and moto's S3 server on loopback (tests/postgres_server.py, tests/s3_server.py).
          Uploads go through one replica; downloads through a second replica with its own data
          directory, which streams each one out of the object store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the throwaway servers

KEY = "sk-cart-bench-0123456789abcdef0123"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Server:
    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, CARTRIDGES_API_KEY=KEY, **(env or {}))
        cmd = [sys.executable, "-m", "cartridges.cli", "serve", "--port", str(self.port), "--data-dir", str(data_dir),
               "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/openapi.json", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def upload_body(size: int, boundary: bytes) -> tuple[Iterator[bytes], int]:
    head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
            b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="bench.txt"\r\n\r\n')
    tail = b"\r\n--" + boundary + b"--\r\n"
    chunk = b"c" * MiB

    def body() -> Iterator[bytes]:
        yield head
        sent = 0
        while sent < size:
            n = min(MiB, size - sent)
            yield chunk if n == MiB else chunk[:n]
            sent += n
        yield tail

    return body(), len(head) + size + len(tail)


def bench_throughput(server: Server, sizes_mib: list[int], reader: Server | None = None) -> list[dict]:
    """Uploads through `server`, downloads through `reader` (another replica) or `server`."""
    rows = []
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=600) as client, \
            httpx.Client(base_url=(reader or server).url, headers=headers, timeout=600) as download_client:
        for size_mib in sizes_mib:
            size = size_mib * MiB
            repeats = 10 if size_mib <= 4 else 3 if size_mib <= 64 else 1
            up, down = [], []
            for _ in range(repeats):
                body, length = upload_body(size, b"benchboundary")
                start = time.perf_counter()
                response = client.post("/v1/files", content=body, headers={
                    "Content-Type": "multipart/form-data; boundary=benchboundary", "Content-Length": str(length)})
                up.append(time.perf_counter() - start)
                response.raise_for_status()
                file_id = response.json()["id"]
                start = time.perf_counter()
                received = 0
                with download_client.stream("GET", f"/v1/files/{file_id}/content") as stream:
                    for part in stream.iter_bytes(MiB):
                        received += len(part)
                down.append(time.perf_counter() - start)
                assert received == size
                client.delete(f"/v1/files/{file_id}").raise_for_status()
            rows.append({
                "size_mib": size_mib,
                "upload_mb_s": size / 1e6 / statistics.median(up),
                "download_mb_s": size / 1e6 / statistics.median(down),
                "peak_rss_mib": peak_rss(server.proc.pid) / MiB,
            })
            print(f"{size_mib:>5} MiB  upload {rows[-1]['upload_mb_s']:8.1f} MB/s  "
                  f"download {rows[-1]['download_mb_s']:8.1f} MB/s  server peak RSS {rows[-1]['peak_rss_mib']:.0f} MiB",
                  flush=True)
    return rows


def bench_list(data_dir: Path, count: int, env: dict[str, str]) -> None:
    from cartridges.server.keys import create_key
    from cartridges.store import BLOB_URL_ENV, DATABASE_URL_ENV, core, open_store

    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # this process' S3 client
    store = open_store(data_dir, sync=False, database_url=env.get(DATABASE_URL_ENV), blob_url=env.get(BLOB_URL_ENV))
    key = create_key(store, "default", KEY)
    owner = core().Owner(store.find_user("default").id)
    start = time.perf_counter()
    for i in range(count):
        writer = store.begin_blob()
        writer.write(b"x" * 100)
        store.create_file(owner, writer, f"doc{i}.txt", "assistants")
    print(f"loaded {count} files in {time.perf_counter() - start:.1f} s (fsync off)", flush=True)
    store.close()
    server = Server(data_dir, env)
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            for params in ({"limit": 100}, {"limit": 10000}, {"limit": 100, "purpose": "assistants", "order": "asc"}):
                times = []
                for _ in range(10):
                    start = time.perf_counter()
                    response = client.get("/v1/files", params=params)
                    times.append(time.perf_counter() - start)
                    response.raise_for_status()
                n = len(response.json()["data"])
                print(f"list {params}: {n} entries, median {statistics.median(times) * 1e3:.1f} ms "
                      f"(min {min(times) * 1e3:.1f} ms)", flush=True)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--list-files", type=int, default=10000)
    parser.add_argument("--backends", default="local,shared", help="local, shared (PostgreSQL + S3), or both")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        print(f"== {backend}: " + ("SQLite and blobs in the data directory" if backend == "local" else
                                   "PostgreSQL and S3 (moto) on loopback"), flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-files-") as tmp, shared_services(backend) as services:
            env = services.env()  # both replicas share one database and one bucket
            server = Server(Path(tmp) / "throughput", env)
            reader = Server(Path(tmp) / "reader", env) if backend == "shared" else None
            try:
                bench_throughput(server, args.sizes_mib, reader)
            finally:
                server.stop()
                if reader:
                    reader.stop()
            if args.list_files:
                bench_list(Path(tmp) / "list", args.list_files, services.env())


class _Services:
    """The backing services of a backend, with a fresh database and bucket per env() call."""

    def __init__(self, postgres=None, s3=None) -> None:
        self.postgres, self.s3 = postgres, s3

    def env(self) -> dict[str, str]:
        if self.postgres is None:
            return {}
        from cartridges.store import BLOB_URL_ENV, DATABASE_URL_ENV
        from postgres_server import fresh_database

        return {**self.s3.env, DATABASE_URL_ENV: fresh_database(self.postgres.url),
                BLOB_URL_ENV: f"s3://{self.s3.fresh_bucket()}/blobs"}


@contextlib.contextmanager
def shared_services(backend: str) -> Iterator[_Services]:
    if backend == "local":
        yield _Services()
        return
    if backend != "shared":
        raise SystemExit(f"unknown backend {backend!r}: local or shared")
    from postgres_server import PostgresServer
    from s3_server import S3Server

    postgres, s3 = PostgresServer().start(), S3Server().start()
    try:
        yield _Services(postgres, s3)
    finally:
        s3.stop()
        postgres.stop()


if __name__ == "__main__":
    main()
