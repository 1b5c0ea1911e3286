"""Subcommands of the `cartridges` CLI, one module each (see cartridges.cli), and what they share."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="a Hugging Face model directory or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")


def load_model_or_report(path: str | None) -> Any | None:
    """The model at `path` (None: the default), or None after printing why it cannot be loaded."""
    from ..model import load_model
    from ..models import ModelLoadError

    print("loading model...", file=sys.stderr, flush=True)
    try:
        return load_model(path)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return None
