"""The real 512 MiB limit: an upload just over it is refused while it streams, the server's
memory does not grow with it, and nothing is left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cartridges.server.settings import MAX_UPLOAD_BYTES
from tests.server.conftest import API_KEY, LiveServer

CHUNK = 1 << 20


def peak_rss(pid: int) -> int:
    """VmHWM: the process's peak resident set, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_just_over_512_mib_is_refused_with_flat_memory(tmp_path_factory: pytest.TempPathFactory) -> None:
    live = LiveServer(tmp_path_factory.mktemp("big") / "data")  # default limit
    live.start()
    try:
        assert live.proc is not None
        # Warm up the upload path so that its one-time allocations are counted before.
        warm = live.http().post("/v1/files", files={"file": ("w.txt", b"w" * (4 * CHUNK))}, data={"purpose": "assistants"})
        assert warm.status_code == 200
        before = peak_rss(live.proc.pid)

        boundary = b"bigboundary"
        head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
                b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="big.txt"\r\n\r\n')
        tail = b"\r\n--" + boundary + b"--\r\n"
        size = MAX_UPLOAD_BYTES + 1
        payload = b"z" * CHUNK

        def body() -> Iterator[bytes]:
            yield head
            sent = 0
            while sent < size:
                n = min(CHUNK, size - sent)
                yield payload if n == CHUNK else payload[:n]
                sent += n
            yield tail

        with httpx.Client(timeout=300) as client:
            response = client.post(
                live.url + "/v1/files",
                content=body(),
                headers={
                    "Authorization": f"Bearer {API_KEY}",
                    "Content-Type": "multipart/form-data; boundary=" + boundary.decode(),
                    "Content-Length": str(len(head) + size + len(tail)),
                },
            )
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "file_too_large"
        grown = peak_rss(live.proc.pid) - before
        assert grown < 64 << 20, f"server peak memory grew by {grown >> 20} MiB for a 512 MiB upload"
        assert live.tmp_names() == []
        assert [f["filename"] for f in live.http().get("/v1/files").json()["data"]] == ["w.txt"]
        assert len(live.blob_names()) == 1
    finally:
        live.stop()
