"""`cartridges serve`: the HTTP API (uvicorn)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the HTTP API",
        description="Serve the OpenAI-compatible HTTP API. Each option falls back to its CARTRIDGES_* "
        "environment variable, then to its default. On a store with no users, user 'default' is created "
        "with the key in CARTRIDGES_API_KEY, or a fresh key that is printed once.",
    )
    p.add_argument("--host", help="interface to listen on (CARTRIDGES_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (CARTRIDGES_PORT; default 8000)")
    p.add_argument("--data-dir", help="store directory (CARTRIDGES_DATA_DIR; default ./cartridges-data)")
    p.add_argument("--database-url", metavar="URL",
                   help="where records live: postgresql://user:password@host:port/db shared by replicas, or "
                        "sqlite:///path.db (CARTRIDGES_DATABASE_URL; default SQLite in the data directory)")
    p.add_argument("--blob-url", metavar="URL",
                   help="where blobs live: s3://bucket/prefix, with the AWS_* variables, or file:///path, a "
                        "directory every replica mounts (CARTRIDGES_BLOB_URL; default: the data directory)")
    p.add_argument("--blob-cache", type=float, metavar="MIB", dest="blob_cache_mib",
                   help="with --blob-url, the most the local copies of blobs may take; the oldest go first "
                        "(CARTRIDGES_BLOB_CACHE_MIB; default 10240)")
    p.add_argument("--model", help="base model: HF directory or GGUF file (CARTRIDGES_MODEL; default: embedded)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (CARTRIDGES_DEVICE; default auto: cuda when available)")
    p.add_argument("--training-device", choices=["auto", "cpu", "cuda"],
                   help="where the local training workers load the model (CARTRIDGES_TRAINING_DEVICE; default "
                   "auto: where the server's model runs)")
    p.add_argument("--kv-tokens", type=int, metavar="N",
                   help="KV pool of the engine in tokens, shared by all running requests; a request holds "
                   "its prompt plus max_tokens (CARTRIDGES_KV_TOKENS; default 32768)")
    p.add_argument("--cartridge-memory", type=float, metavar="MIB", dest="cartridge_memory_mib",
                   help="memory for loaded cartridges in MiB; past it the least recently used idle one is "
                   "evicted (CARTRIDGES_CARTRIDGE_MEMORY_MIB; default 1024)")
    p.add_argument("--serve-threads", type=int, metavar="N",
                   help="threads of the serving engine (CARTRIDGES_SERVE_THREADS; default 0: every core, "
                   "minus the training workers' while jobs run)")
    p.add_argument("--worker-threads", type=int, metavar="N",
                   help="threads of each training job's worker (CARTRIDGES_WORKER_THREADS; default 0: half the cores)")
    p.add_argument("--worker-gpus", type=float, metavar="N",
                   help="GPUs each training job asks of the Ray cluster, with --job-backend ray "
                        "(CARTRIDGES_WORKER_GPUS; default 0)")
    p.add_argument("--max-jobs", type=int, metavar="N",
                   help="training jobs run at once (CARTRIDGES_MAX_JOBS; default 1)")
    p.add_argument("--job-backend", choices=["local", "ray"],
                   help="where training jobs run: local worker processes, or tasks on the Ray cluster of "
                        "RAY_ADDRESS (CARTRIDGES_JOB_BACKEND; default local)")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="on CPU with a GGUF's quantized weights, round activations to 8 bits as llama.cpp "
                   "does, about 2x faster decode; --no-int8-activations keeps float32 activations, "
                   "transformers' results (CARTRIDGES_INT8_ACTIVATIONS; default on)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from cartridges.server import Settings, create_app

    try:
        settings = Settings.from_env(
            host=args.host, port=args.port, data_dir=args.data_dir, database_url=args.database_url,
            blob_url=args.blob_url, blob_cache_mib=args.blob_cache_mib, model=args.model, device=args.device,
            training_device=args.training_device,
            kv_tokens=args.kv_tokens, cartridge_memory_mib=args.cartridge_memory_mib,
            serve_threads=args.serve_threads, worker_threads=args.worker_threads, worker_gpus=args.worker_gpus,
            max_jobs=args.max_jobs,
            job_backend=args.job_backend,
            int8_activations=args.int8_activations)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0
