"""`cartridges train FILE... --out CART.safetensors`: self-study from text files to a cartridge."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

from . import add_model_argument, load_model_or_report

def _config_argument(parser: argparse.ArgumentParser, name: str, info: Any, summary: str) -> None:
    """The flag of TrainConfig field `name`: its type, choices and default from the field."""
    from ..selfstudy.config import DECIDED_FROM_CORPUS, field_aliases

    # The field's own name, and the other names it is read by (--lr for --learning-rate).
    names = [name, *(alias for alias, field in field_aliases().items() if field == name)]
    flags = ["--" + n.replace("_", "-") for n in names]
    summary = summary.replace("%", "%%")  # argparse formats help with %
    kind = info.annotation
    if typing.get_origin(kind) is not typing.Literal and typing.get_args(kind):  # X | None: X
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if info.default is None and typing.get_origin(kind) is typing.Literal:
        parser.add_argument(*flags, dest=name, default=None, choices=typing.get_args(kind),
                            help=f"{summary} (default: {DECIDED_FROM_CORPUS[name]})")
    elif info.default is None:
        parser.add_argument(*flags, dest=name, type=kind, default=None, metavar="N",
                            help=f"{summary} (default: {DECIDED_FROM_CORPUS[name]})")
    elif kind is bool:
        parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=info.default,
                            help=f"{summary} (default: {info.default})")
    elif typing.get_origin(kind) is typing.Literal:
        parser.add_argument(*flags, dest=name, default=info.default, choices=typing.get_args(kind),
                            help=f"{summary} (default: {info.default})")
    else:
        parser.add_argument(*flags, dest=name, type=kind, default=info.default, help=f"{summary} (default: {info.default})")


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..selfstudy.config import TrainConfig, field_summaries

    parser = subparsers.add_parser(
        "train",
        help="train a cartridge for text files by self-study",
        description="Train a cartridge for one or more text files (.txt, .md, or .pdf) by self-study on the "
        "default model (or --model), and write it as a .safetensors file (or a research .pt with --out X.pt). "
        "Every training setting is a flag; docs/configuration.md explains them.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="the corpus: text, markdown or PDF files; several are "
                        "joined in order, each under its file name as a heading")
    parser.add_argument("--out", required=True, metavar="CART", help="where to write the cartridge")
    add_model_argument(parser)
    parser.add_argument("--checkpoint", metavar="PATH", help="keep training state here (and resume from it)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    summaries = field_summaries()
    for name, info in TrainConfig.model_fields.items():
        _config_argument(parser, name, info, summaries[name])
    parser.set_defaults(run=run)


def read_text(path: Path) -> str:
    if path.suffix.lower() == ".pdf":
        from pypdf import PdfReader

        return "\n\n".join(page.extract_text() or "" for page in PdfReader(str(path)).pages)
    return path.read_text(encoding="utf-8", errors="replace")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ..cartridge import Cartridge
    from ..selfstudy.chunking import named_texts
    from ..selfstudy.config import TrainConfig, describe
    from ..training import CheckpointMismatch, train

    try:
        config = TrainConfig(**{name: getattr(args, name) for name in TrainConfig.model_fields})
    except ValidationError as error:  # a value out of its range: say which, with no traceback
        print(f"error: {describe(error)}", file=sys.stderr)
        return 2
    try:
        texts = named_texts([(Path(p).name, read_text(Path(p))) for p in args.files])
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    model = load_model_or_report(args.model)
    if model is None:
        return 1
    try:
        cartridge: Cartridge = train(model, texts, config, progress=not args.no_progress,
                                     checkpoint=args.checkpoint, resume=args.resume)
    except CheckpointMismatch as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.suffix == ".pt":
        cartridge.export_pt(out)
    else:
        cartridge.save(out)
    stats = cartridge.stats
    print(f"wrote {out}: {cartridge.num_tokens} tokens, {cartridge.nbytes / 2**20:.1f} MiB; "
          f"{stats['num_conversations']} conversations, {stats['steps']} steps, final loss "
          f"{stats['losses'][-1] if stats['losses'] else float('nan'):.4f}; initialization {stats['init_s']:.0f} s, "
          f"synthesis {stats['synthesis_s']:.0f} s, training {stats['training_s']:.0f} s", file=sys.stderr)
    if stats.get("signal_by_part"):
        print("training signal by tenth of the corpus: "
              + " ".join(f"{share:.0%}" for share in stats["signal_by_part"]), file=sys.stderr)
    if stats.get("quality") is not None:
        from ..quality import describe as describe_quality

        for line in describe_quality(stats["quality"]):
            print(line, file=sys.stderr)
    return 0
