"""`cartridges datablocks train|list|get|delete|wait`: datablocks of a running server, over
`cartridges.Client`. Objects are printed as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("datablocks", help="train and manage datablocks on a server",
                              description="Datablocks (trained cartridges) of a running server.")
    p.add_argument("--base-url", help=f"server URL (CARTRIDGES_BASE_URL; default {DEFAULT_URL})")
    p.add_argument("--api-key", help="API key (CARTRIDGES_API_KEY)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = actions.add_parser("train", help="queue training on uploaded files; prints the datablock")
    train.add_argument("files", nargs="+", metavar="FILE_ID", help="ids of processed cartridge-training files")
    train.add_argument("--name", help="project name (default: default)")
    train.add_argument("--model", help="base model id (default: the server's)")
    train.add_argument("--config", metavar="JSON", help='training config overrides, e.g. \'{"num_samples": 64}\'')
    train.add_argument("--parts", action=argparse.BooleanOptionalAction, help="a cartridge per part of about "
                       "--part-tokens, served together: a question is answered by its part (default: in parts for a "
                       "corpus of more than four of the model's contexts; --no-parts for one cartridge however long "
                       "the corpus)")
    train.add_argument("--part-tokens", type=int, metavar="N", help="about how many tokens a part holds; implies "
                       "--parts (default: two of the model's contexts)")
    train.add_argument("--wait", action="store_true", help="wait for the end, with a progress bar")
    listing = actions.add_parser("list", help="list datablocks")
    listing.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    for name, text in (("get", "show one datablock"), ("delete", "cancel and delete a datablock"),
                       ("wait", "wait for a datablock to end, with a progress bar")):
        action = actions.add_parser(name, help=text)
        action.add_argument("datablock_id", metavar="ID", help="<user>/<project>/<run_id> or the run id")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from ..client import APIError, Client

    url = args.base_url or os.environ.get("CARTRIDGES_BASE_URL") or DEFAULT_URL
    key = args.api_key or os.environ.get("CARTRIDGES_API_KEY")
    if not key:
        print("error: give --api-key or set CARTRIDGES_API_KEY", file=sys.stderr)
        return 2
    try:
        config = json.loads(args.config) if getattr(args, "config", None) else None
    except json.JSONDecodeError as error:
        print(f"error: --config is not JSON: {error}", file=sys.stderr)
        return 2
    with Client(url, key) as client:
        blocks = client.datablocks
        try:
            if args.action == "train":
                block = blocks.train(args.files, name=args.name, model=args.model, config=config, parts=args.parts,
                                     part_tokens=args.part_tokens)
                if args.wait:
                    print(f"queued {block['id']}; waiting (Ctrl-C stops waiting, not the job)", file=sys.stderr)
                    block = blocks.wait(block["id"])
                    _print(block)
                    return 0 if block["status"] == "succeeded" else 1
                _print(block)
            elif args.action == "list":
                for block in blocks.list(status=args.status):
                    print(f"{block['id']}  {block['status']:<9}  {block['progress']['stage']:<12} "
                          f"{block['created_at']}")
            elif args.action == "get":
                _print(blocks.retrieve(args.datablock_id))
            elif args.action == "delete":
                _print(blocks.delete(args.datablock_id))
            else:
                block = blocks.wait(args.datablock_id)
                _print(block)
                return 0 if block["status"] == "succeeded" else 1
        except APIError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except httpx.HTTPError as error:  # refused, unresolvable, not an http(s) URL, cut off
            print(f"error: cannot reach the server at {url}: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("stopped waiting; the job goes on (cartridges datablocks wait ID)", file=sys.stderr)
            return 130
    return 0


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2))
