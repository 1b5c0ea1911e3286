"""`cartridges serve`: the HTTP API (uvicorn)."""

from __future__ import annotations

import argparse


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
    p.add_argument("--model", help="base model: HF directory or GGUF file (CARTRIDGES_MODEL; default: embedded)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from cartridges.server import Settings, create_app

    settings = Settings.from_env(host=args.host, port=args.port, data_dir=args.data_dir, model=args.model)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0
