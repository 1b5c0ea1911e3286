"""Subcommands of the `cartridges` CLI, one module each (see cartridges.cli), and what they share."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="a Hugging Face model directory or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")


def add_device_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--device; None when not given (which load_model_or_report takes as "auto")."""
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"],
                        help=f"where the model {what} (default auto: cuda when a GPU is available; the model "
                        "runs in bfloat16 there)")


def load_model_or_report(path: str | None, device: str | None = "cpu") -> Any | None:
    """The model at `path` (None: the default) on `device` ("auto" or None: cuda when
    available), or None after printing why it cannot be loaded."""
    from ..model import load_model, resolve_device
    from ..models import ModelLoadError

    resolved = resolve_device(device or "auto")
    if resolved.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"error: --device {device}: this torch sees no CUDA device (a CPU build, or no GPU); "
                  "use --device cpu", file=sys.stderr)
            return None
    print(f"loading model ({resolved})...", file=sys.stderr, flush=True)
    try:
        return load_model(path, device=resolved)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return None
