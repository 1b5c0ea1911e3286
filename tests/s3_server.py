"""A throwaway S3 endpoint for the tests: moto's standalone server (`moto[server]`), a real HTTP
S3 API on a free loopback port, reached through boto3 exactly as AWS or MinIO would be."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import httpx

# What boto3 needs to reach the endpoint (and what a server under test gets in its environment).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self) -> None:
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> S3Server:
        """Starts (or restarts, on the same port) the server; its objects start empty."""
        self.port = self.port or _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                httpx.get(self.endpoint, timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("moto_server did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test",
                            aws_secret_access_key="test", region_name="us-east-1")

    def fresh_bucket(self) -> str:
        name = "t-" + uuid.uuid4().hex[:16]
        self.client().create_bucket(Bucket=name)
        return name
