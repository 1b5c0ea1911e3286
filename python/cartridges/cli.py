"""The `cartridges` command line: `serve`, `keys`, `train`, `chat`, `datablocks`, `export`, `import`.

Each subcommand lives in its own module under `cartridges.commands` and registers itself
with `register(subparsers)`, setting `run` to the function that executes it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them.
COMMANDS = ("serve", "keys", "train", "chat", "datablocks", "formats")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cartridges",
        description="Train and serve cartridges: compact trained KV-cache prefixes that stand in for documents.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"cartridges.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
