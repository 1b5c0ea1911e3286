"""kill -9 in the middle of an upload: after a restart the partial upload is gone without a
trace, and what was stored before is intact byte for byte."""

from __future__ import annotations

import socket
import time

import pytest

from tests.server.conftest import LiveServer, make_pdf, wait_processed


def test_kill_during_upload(tmp_path_factory: pytest.TempPathFactory) -> None:
    live = LiveServer(tmp_path_factory.mktemp("durability") / "data")
    live.start()
    try:
        stored = {
            "a.txt": b"first file\n" * 1000,
            "b.pdf": make_pdf("survives a crash"),
            "c.csv": b"k,v\n1,2\n",
        }
        ids = {}
        for name, content in stored.items():
            response = live.http().post("/v1/files", files={"file": (name, content)}, data={"purpose": "assistants"})
            ids[name] = response.json()["id"]
            assert wait_processed(live.http(), ids[name])["status"] == "processed"
        blobs_before = live.blob_names()

        # An upload that stops half-way (4 MiB of a declared 64 MiB), held open when the server dies.
        boundary = b"crashboundary"
        head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
                b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="partial.txt"\r\n\r\n')
        with socket.create_connection(("127.0.0.1", live.port)) as sock:
            sock.sendall(
                b"POST /v1/files HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + live_key() + b"\r\n"
                b"Content-Type: multipart/form-data; boundary=" + boundary + b"\r\n"
                b"Content-Length: %d\r\n\r\n" % (64 << 20) + head
            )
            chunk = b"p" * (1 << 20)
            for _ in range(4):
                sock.sendall(chunk)
            deadline = time.monotonic() + 20
            tmp = live.data_dir / "blobs" / "tmp"
            while not any(p.stat().st_size > 0 for p in tmp.iterdir()):
                assert time.monotonic() < deadline, "the upload never reached the disk"
                time.sleep(0.02)
            live.stop(kill=True)
        assert live.tmp_names() != []  # the crash did leave a temporary behind

        live.start()
        listed = {f["id"] for f in live.http().get("/v1/files").json()["data"]}
        assert listed == set(ids.values())
        assert live.tmp_names() == []
        assert live.blob_names() == blobs_before
        for name, content in stored.items():
            assert live.http().get(f"/v1/files/{ids[name]}/content").content == content
            assert live.http().get(f"/v1/files/{ids[name]}").json()["status"] == "processed"
    finally:
        live.stop()


def live_key() -> bytes:
    from tests.server.conftest import API_KEY

    return API_KEY.encode()
