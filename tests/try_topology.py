"""The whole scaled-out topology on one machine, for a try-out (docs/deployment.md): a throwaway
PostgreSQL server, moto's S3 server, a Ray head node and two `cartridges serve` replicas sharing
them, each with its own data directory. Prints the replicas' URLs and an API key, runs until
Ctrl-C, then stops everything and removes what it made.

    .venv/bin/python tests/try_topology.py [--model PATH] [--port 8001]

Made of the test suite's throwaway servers (tests/postgres_server.py, tests/s3_server.py):
nothing here is for production, where PostgreSQL, the object store and Ray are your own.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from postgres_server import PostgresServer, fresh_database  # noqa: E402
from s3_server import S3Server  # noqa: E402


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy; see {log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="base model (default: the embedded one)")
    parser.add_argument("--port", type=int, default=8001, help="the first replica's port; the second gets the next")
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    root = Path(tempfile.mkdtemp(prefix="cartridges-topology-"))
    database, s3, replicas = PostgresServer(), S3Server(), []
    ray_env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    ray_started = False
    try:
        database.start()
        s3.start()
        bucket = s3.fresh_bucket()
        ray_port = args.port + 100
        subprocess.run([str(bin_dir / "ray"), "start", "--head", "--port", str(ray_port), "--include-dashboard=false",
                        "--disable-usage-stats"], check=True, env={**ray_env, **s3.env},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ray_started = True
        import ray

        key = "sk-" + secrets.token_hex(16)
        env = {**ray_env, **s3.env, "CARTRIDGES_DATABASE_URL": fresh_database(database.url),
               "CARTRIDGES_BLOB_URL": f"s3://{bucket}/blobs", "CARTRIDGES_JOB_BACKEND": "ray",
               "RAY_ADDRESS": f"{ray.util.get_node_ip_address()}:{ray_port}", "CARTRIDGES_API_KEY": key}
        for i in range(2):
            port, data_dir, log = args.port + i, root / f"replica-{i + 1}", root / f"replica-{i + 1}.log"
            cmd = [str(bin_dir / "cartridges"), "serve", "--port", str(port), "--data-dir", str(data_dir)]
            if args.model:
                cmd += ["--model", args.model]
            with open(log, "ab") as out:
                replicas.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            _wait_healthy(f"http://127.0.0.1:{port}", replicas[-1], log)
        print(f"PostgreSQL  {env['CARTRIDGES_DATABASE_URL']}")
        print(f"S3          {s3.endpoint}  bucket {bucket}")
        print(f"Ray         {env['RAY_ADDRESS']}")
        for i in range(2):
            print(f"replica {i + 1}   http://127.0.0.1:{args.port + i}  (log {root / f'replica-{i + 1}.log'})")
        print(f"API key     {key}")
        print("Ctrl-C stops everything.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    finally:
        for proc in replicas:
            proc.terminate()
        for proc in replicas:
            proc.wait(timeout=30)
        if ray_started:
            subprocess.run([str(bin_dir / "ray"), "stop", "--force"], env=ray_env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        s3.stop()
        database.stop()
        shutil.rmtree(root, ignore_errors=True)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops everything as Ctrl-C does


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(main())
