"""`cartridges keys create|list|revoke`: API keys of the store (works while the server runs)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("keys", help="manage API keys", description="Create, list and revoke API keys.")
    p.add_argument("--data-dir", help="store directory (CARTRIDGES_DATA_DIR; default ./cartridges-data)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a key for a user (and the user if new); prints it once")
    create.add_argument("--user", required=True, help="user name, [A-Za-z0-9._-]{1,64}")
    create.add_argument("--data-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    actions.add_parser("list", help="list keys (hints only)").add_argument(
        "--data-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    revoke = actions.add_parser("revoke", help="revoke a key by its id (see `keys list`)")
    revoke.add_argument("key_id", type=int)
    revoke.add_argument("--data-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from cartridges.server import keys
    from cartridges.server.settings import Settings
    from cartridges.store import core, open_store

    errors = core()
    try:
        settings = Settings.from_env(data_dir=args.data_dir)
    except ValueError as exc:  # a CARTRIDGES_* variable that does not parse: it is named
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.action != "create" and settings.database_url is None and not Path(settings.data_dir).is_dir():
        # Opening would make an empty store there: a mistyped directory would list no keys.
        print(f"error: no store at {settings.data_dir}; give the server's --data-dir (or CARTRIDGES_DATA_DIR)",
              file=sys.stderr)
        return 1
    try:
        store = open_store(settings.data_dir, database_url=settings.database_url, blob_url=settings.blob_url)
    except errors.StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if args.action == "create":
            if args.user == keys.ADMIN_USER:
                print(f"error: '{keys.ADMIN_USER}' is reserved for CARTRIDGES_ADMIN_KEY", file=sys.stderr)
                return 2
            key = keys.create_key(store, args.user)
            print(key)
            print(f"(key for user '{args.user}'; it is not shown again)", file=sys.stderr)
        elif args.action == "list":
            print(f"{'ID':>4}  {'USER':<20} {'KEY':<16} {'CREATED':<20} REVOKED")
            for k in store.list_keys():
                revoked = _time(k.revoked_at) if k.revoked_at is not None else "-"
                print(f"{k.id:>4}  {k.user_name:<20} {k.hint:<16} {_time(k.created_at):<20} {revoked}")
        else:
            store.revoke_key(args.key_id)
            print(f"revoked key {args.key_id}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except errors.StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


def _time(seconds: int) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
